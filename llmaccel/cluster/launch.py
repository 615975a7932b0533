"""`llmaccel serve --replicas N`: engine replicas on Ray Serve behind this process's OpenAI ingress.

This process keeps the HTTP side (uvicorn, the same app, auth, limits, result cache and metrics as
a single-process server) and the router; each replica is an llmaccel engine in a Ray actor process.
Without a --ray-address a local Ray instance is started with this machine's cores and stopped at exit.
"""

from __future__ import annotations

import argparse
import logging
import os

from llmaccel.cluster.deployment import ClusterConfig
from llmaccel.cluster.routing import ROUTERS
from llmaccel.config import EngineConfig, ServerConfig
from llmaccel.model.loader import resolve_model_path

logger = logging.getLogger(__name__)
APP_NAME = "llmaccel"


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


def serve(model: str, engine_options: dict, config: ServerConfig, cluster: ClusterConfig,
          log_level: str = "info", access_log: bool = False) -> int:
    """Start the replicas, serve until SIGTERM/SIGINT, stop them; the process exit code."""
    check_supported(config)
    if engine_options.get("semantic_guard") is not None:  # its verdicts do not cross the replica wire yet
        logger.warning("--replicas: the semantic input guard is not run by replicas yet; the input filter's rules "
                       "run alone")
        engine_options = {**engine_options, "semantic_guard": None}
    EngineConfig.create(model, **engine_options)  # bad flags and paths fail before Ray starts
    resolve_model_path(model)
    try:
        import ray
        from ray import serve as ray_serve
    except ImportError:
        raise ValueError("--replicas needs Ray Serve: pip install 'llmaccel[cluster]' "
                         "(or pip install 'ray[serve]')") from None

    from llmaccel.cluster.deployment import engine_application, ensure_state_actor, replicated_app
    from llmaccel.server.launch import draining_server, run_server

    local = cluster.address is None
    if local:  # Ray runs its workers at nice 15; here the replicas are the work, not background jobs
        os.environ.setdefault("RAY_worker_niceness", "0")
    ray.init(address=cluster.address, namespace=cluster.namespace, include_dashboard=False,
             logging_level=logging.WARNING, configure_logging=False)
    state_actor = None
    try:
        ray_serve.start(proxy_location="Disabled")
        state_actor = ensure_state_actor(cluster.namespace)
        logger.info("starting %s replica(s) of %s (%d thread(s) each, router %s)%s", cluster.replicas, model,
                    cluster.threads, cluster.router, "" if not cluster.autoscaling else
                    f", autoscaling {cluster.min_replicas}..{cluster.max_replicas}")
        try:
            handle = ray_serve.run(engine_application(model, engine_options, config, cluster), name=APP_NAME,
                                   route_prefix=None)
        except RuntimeError as exc:
            raise ValueError(f"the replicas of {model!r} could not start: {exc}") from None
        server = None

        def stop() -> None:
            if server is not None:
                server.should_exit = True

        app = replicated_app(handle, model, engine_options, config, cluster, on_fatal=stop)
        server = draining_server(app, config, log_level, access_log)
        return run_server(server, app, model, config)
    finally:
        _stop(local, state_actor)


def _stop(local: bool, state_actor) -> None:
    """A local Ray instance goes with this process (ray.shutdown stops its processes, the replicas
    among them). On a shared cluster the application is deleted, with a time limit: a cluster that
    lost its head must not keep this process from exiting."""
    import threading

    import ray
    from ray import serve as ray_serve

    def delete() -> None:
        ray_serve.delete(APP_NAME)
        if state_actor is not None:
            ray.kill(state_actor)

    if not local:
        worker = threading.Thread(target=delete, daemon=True)
        worker.start()
        worker.join(timeout=15)
        if worker.is_alive():
            logger.warning("could not delete the Serve application %r within 15 s; delete it with "
                           "`serve shutdown` or `serve delete`", APP_NAME)
    ray.shutdown()
