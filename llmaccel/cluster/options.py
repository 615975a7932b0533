"""`llmaccel serve`'s flags for replicas, the ClusterConfig they give, and the whole serve command line
(engine, server and replica flags): below cluster/launch.py and cluster/deployment.py, which both read
them (deployment's `build_app` parses a Serve config's `args` with them), and below the CLI."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from llmaccel.cluster.routing import ROUTERS
from llmaccel.config import ServerConfig
from llmaccel.engine_args import add_engine_arguments


@dataclass(frozen=True)
class ClusterConfig:
    """How many engine replicas run, how they scale, and how requests are routed among them."""

    replicas: int = 2  # fixed count; with max_replicas, the number to start with
    min_replicas: int | None = None  # with max_replicas: autoscale between the two on ongoing requests
    max_replicas: int | None = None
    target_ongoing_requests: float = 16.0  # per replica, what the autoscaler aims for
    upscale_delay_s: float = 3.0
    downscale_delay_s: float = 30.0
    autoscale_window_s: float = 10.0  # the autoscaler averages load over this look-back window
    router: str = "cache-aware"  # a key of router.ROUTERS
    imbalance: int = 8  # cache-aware: a replica this many requests busier than the lightest ...
    imbalance_ratio: float = 1.5  # ... and this many times as busy loses its claim to the prompt
    threads_per_replica: int | None = None  # torch threads of each replica; None: the cores / most replicas
    max_ongoing_requests: int = 512  # requests one replica accepts at once (the engine queues them)
    stream_interval_s: float = 0.02  # a replica sends a stream's tokens at most this often (the first at once)
    updates_per_s: float = 200.0  # and all its streams together at most this many updates a second
    address: str | None = None  # a running Ray cluster ("auto", "ray://host:10001"); None: start a local one
    namespace: str = "llmaccel"
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.router not in ROUTERS:
            raise ValueError(f"unknown router {self.router!r}; choose one of {', '.join(ROUTERS)}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("--min-replicas and --max-replicas go together (autoscaling between them)")
        if self.autoscaling:
            if not 0 <= self.min_replicas <= self.max_replicas or self.max_replicas < 1:
                raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1, got "
                                 f"{self.min_replicas} and {self.max_replicas}")
            if not self.min_replicas <= self.replicas <= self.max_replicas:
                raise ValueError(f"--replicas {self.replicas} (the starting count) must lie between "
                                 f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas}")
        elif self.replicas < 1:
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def threads(self) -> int:
        if self.threads_per_replica is not None:
            return self.threads_per_replica
        return max(1, len(os.sched_getaffinity(0)) // (self.max_replicas or self.replicas))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("replicas on Ray Serve (pip install 'llmaccel[cluster]'); docs/scaling.md")
    group.add_argument("--replicas", type=int, metavar="N",
                       help="run N engine replicas, each in its own Ray actor process with its own KV cache, behind "
                            "this server (with --max-replicas: the count to start with); without it, one engine "
                            "runs in this process and Ray is not imported")
    group.add_argument("--min-replicas", type=int, metavar="N",
                       help="autoscale down to N replicas (with --max-replicas)")
    group.add_argument("--max-replicas", type=int, metavar="N",
                       help="autoscale up to N replicas on the ongoing requests per replica (Ray Serve's autoscaler)")
    group.add_argument("--target-ongoing-requests", type=float, default=16.0, metavar="R",
                       help="autoscaling: ongoing requests per replica the autoscaler aims for")
    group.add_argument("--upscale-delay-s", type=float, default=3.0, help="autoscaling: load above target this long "
                                                                          "adds replicas")
    group.add_argument("--downscale-delay-s", type=float, default=30.0,
                       help="autoscaling: load below target this long removes replicas")
    group.add_argument("--autoscale-window-s", type=float, default=10.0,
                       help="autoscaling: the load is averaged over this many seconds")
    group.add_argument("--router", default="cache-aware", choices=list(ROUTERS),
                       help="how a request picks its replica: 'cache-aware' (the replica whose prefix cache holds the "
                            "most of the prompt's leading blocks, as the replicas report them, unless it is much "
                            "busier than the least loaded; see --router-imbalance), 'round-robin', 'power-of-two' (Ray "
                            "Serve's default), 'ray-prefix' (Ray Serve LLM's PrefixCacheAffinityRouter)")
    group.add_argument("--router-imbalance", type=int, default=8, metavar="Q",
                       help="cache-aware: a replica with Q more ongoing requests than the least loaded one, and "
                            "--router-imbalance-ratio times as many, is passed over, whatever it holds")
    group.add_argument("--router-imbalance-ratio", type=float, default=1.5, metavar="X",
                       help="cache-aware: see --router-imbalance")
    group.add_argument("--threads-per-replica", type=int, metavar="T",
                       help="torch threads of each replica (default: the cores / the most replicas)")
    group.add_argument("--max-ongoing-requests", type=int, default=512,
                       help="requests one replica takes at once (its engine queues them); more wait in the router")
    group.add_argument("--stream-interval-ms", type=float, default=20.0, metavar="MS",
                       help="a replica sends each stream's new tokens at most this often (the first token at once)")
    group.add_argument("--replica-updates-per-s", type=float, default=200.0, metavar="U",
                       help="and all of a replica's streams together at most U updates a second, so with many "
                            "streams each update carries several tokens: every streamed item costs Ray the same "
                            "CPU whatever it carries (0: no budget)")
    group.add_argument("--ray-address", metavar="ADDR",
                       help="join a running Ray cluster (e.g. 'auto' after `ray start --head`, or "
                            "ray://head:10001); default: start a local Ray instance for this server")


def wants_replicas(args: argparse.Namespace) -> bool:
    return args.replicas is not None or args.max_replicas is not None


def cluster_config(args: argparse.Namespace) -> ClusterConfig:
    replicas = args.replicas if args.replicas is not None else (args.min_replicas or 1)
    return ClusterConfig(replicas=replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                         target_ongoing_requests=args.target_ongoing_requests, upscale_delay_s=args.upscale_delay_s,
                         downscale_delay_s=args.downscale_delay_s, autoscale_window_s=args.autoscale_window_s,
                         router=args.router, imbalance=args.router_imbalance,
                         imbalance_ratio=args.router_imbalance_ratio,
                         threads_per_replica=args.threads_per_replica, max_ongoing_requests=args.max_ongoing_requests,
                         stream_interval_s=args.stream_interval_ms / 1000,
                         updates_per_s=args.replica_updates_per_s, address=args.ray_address)


def check_supported(config: ServerConfig) -> None:
    """What a replicated server cannot do yet is an error before anything starts."""
    unsupported = [(config.cascade_small is not None, "--cascade-small"),
                   (config.guard_sample_rate > 0 or config.guard_confidence is not None,
                    "--guard-sample-rate/--guard-confidence"),
                   (config.quality_check_interval_s is not None, "--quality-check-interval")]
    named = [flag for bad, flag in unsupported if bad]
    if named:
        raise ValueError(f"{', '.join(named)} cannot be combined with --replicas yet (they score answers on the "
                         "serving engine itself); drop them or serve one engine")


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """Every flag of `llmaccel serve`: the engine's, the server's, the replicas'."""
    from llmaccel.server import launch

    add_engine_arguments(parser)
    launch.add_arguments(parser)
    add_arguments(parser)
