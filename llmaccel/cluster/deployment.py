"""The Ray Serve application: EngineReplica deployments behind a router, and the ingress.

`llmaccel serve --replicas N` (cluster/launch.py) runs the ingress in its own process, in front of
`engine_application(...)`. For `serve run` or a Serve config file, `build_app` builds the whole
application, the OpenAI ingress included, as a Serve deployment of its own:

    serve run llmaccel.cluster.deployment:build_app model=smollm2-135m replicas=2

`args` (strings from `serve run`, or a config file's `args:`) are the flags of `llmaccel serve`
with underscores: model, replicas, min_replicas, max_replicas, router, plus engine options.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from llmaccel.cluster.kv_index import STATE_ACTOR, ClusterState
from llmaccel.cluster.replica import EngineReplica
from llmaccel.cluster.routing import ROUTERS
from llmaccel.config import ServerConfig

DEPLOYMENT = "LLMEngineReplica"


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


def ensure_state_actor(namespace: str):
    """The one ClusterState actor of this namespace, created by whoever comes first."""
    import ray

    return ray.remote(num_cpus=0)(ClusterState).options(
        name=STATE_ACTOR, namespace=namespace, get_if_exists=True, lifetime="detached").remote()


def engine_application(model: str, engine_options: dict, server: ServerConfig, cluster: ClusterConfig):
    """The EngineReplica deployment, bound to its arguments (a Serve Application)."""
    from ray import serve
    from ray.serve.config import RequestRouterConfig

    kwargs = {"imbalance": cluster.imbalance, "imbalance_ratio": cluster.imbalance_ratio,
              "namespace": cluster.namespace} if cluster.router == "cache-aware" else {}
    scaling = dict(num_replicas=cluster.replicas) if not cluster.autoscaling else dict(autoscaling_config={
        "min_replicas": cluster.min_replicas, "max_replicas": cluster.max_replicas,
        "initial_replicas": cluster.replicas, "target_ongoing_requests": cluster.target_ongoing_requests,
        "upscale_delay_s": cluster.upscale_delay_s, "downscale_delay_s": cluster.downscale_delay_s,
        "look_back_period_s": cluster.autoscale_window_s, "metrics_interval_s": min(1.0, cluster.autoscale_window_s)})
    deployment = serve.deployment(
        EngineReplica, name=DEPLOYMENT, ray_actor_options={"num_cpus": cluster.threads},
        max_ongoing_requests=cluster.max_ongoing_requests, health_check_period_s=cluster.health_check_period_s,
        health_check_timeout_s=cluster.health_check_timeout_s, max_constructor_retry_count=1,
        request_router_config=RequestRouterConfig(request_router_class=ROUTERS[cluster.router],
                                                  request_router_kwargs=kwargs), **scaling)
    return deployment.bind(model, engine_options, cluster.threads, server.max_waiting_requests,
                           server.max_failed_steps, cluster.namespace, cluster.stream_interval_s,
                           cluster.updates_per_s)


class Ingress:
    """The OpenAI server as a Serve deployment (for `serve run` and config files): the same app as
    `llmaccel serve`, over the engine replicas' handle."""

    def __init__(self, engine_handle, model: str, engine_options: dict, server: ServerConfig,
                 cluster: ClusterConfig) -> None:
        self._handle, self._model, self._options = engine_handle, model, engine_options
        self._server, self._cluster = server, cluster

    def __serve_build_asgi_app__(self):
        return replicated_app(self._handle, self._model, self._options, self._server, self._cluster)


def replicated_app(handle, model: str, engine_options: dict, server: ServerConfig, cluster: ClusterConfig,
                   on_fatal=None):
    """The OpenAI app over the engine replicas' handle: the single server's create_app, on a
    ReplicatedEngine, with the cluster's series on its /metrics."""
    import ray

    from llmaccel.cluster.metrics import ClusterCollector
    from llmaccel.cluster.remote_engine import ReplicatedEngine
    from llmaccel.config import EngineConfig
    from llmaccel.server.app import create_app

    state_actor = ray.get_actor(STATE_ACTOR, namespace=cluster.namespace)
    engine = ReplicatedEngine(handle, EngineConfig.create(model, **engine_options), state_actor,
                              server.max_waiting_requests, send_text=cluster.router == "ray-prefix")
    app = create_app(server, None, model_name=model, on_fatal=on_fatal, async_engine_factory=lambda: engine)
    app.state.server.metrics.registry.register(ClusterCollector(engine))
    return app


def build_app(args: dict):
    """The whole application for `serve run llmaccel.cluster.deployment:build_app key=value ...` or a
    Serve config file's `import_path`; `args` are `llmaccel serve` flags without the dashes."""
    from ray import serve

    from llmaccel.cli import _engine_options, build_parser
    from llmaccel.cluster import launch
    from llmaccel.server import launch as server_launch

    flags = ["serve"]
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value in ("true", "True", ""):  # a switch: `no_result_cache=true`
            flags.append(flag)
        elif not (value is False or value in ("false", "False")):
            flags += [flag, str(value)]
    parsed = build_parser().parse_args(flags)
    if not launch.wants_replicas(parsed):
        parsed.replicas = 1
    server, cluster = server_launch.server_config(parsed), launch.cluster_config(parsed)
    launch.check_supported(server)
    options = _engine_options(parsed)
    ensure_state_actor(cluster.namespace)
    ingress = serve.deployment(serve.ingress()(Ingress), name="OpenAIIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine_application(parsed.model, options, server, cluster), parsed.model, options, server,
                        cluster)
