"""The Ray Serve application: EngineReplica deployments behind a router, and the ingress.

`llmaccel serve --replicas N` (cluster/launch.py) runs the ingress in its own process, in front of
`engine_application(...)`. For `serve run` or a Serve config file, `build_app` builds the whole
application, the OpenAI ingress included, as a Serve deployment of its own:

    serve run llmaccel.cluster.deployment:build_app model=smollm2-135m replicas=2

`args` (strings from `serve run`, or a config file's `args:`) are the flags of `llmaccel serve`
with underscores: model, replicas, min_replicas, max_replicas, router, plus engine options.
"""

from __future__ import annotations

import argparse

from llmaccel.cluster.kv_index import STATE_ACTOR, ClusterState
from llmaccel.cluster.options import ClusterConfig
from llmaccel.cluster.replica import EngineReplica
from llmaccel.cluster.routing import ROUTERS
from llmaccel.config import ServerConfig

DEPLOYMENT = "LLMEngineReplica"


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

    from llmaccel.cluster import options as cluster_options
    from llmaccel.engine_args import engine_options
    from llmaccel.server import launch as server_launch

    flags = []
    for key, value in args.items():
        flag = "--" + key.replace("_", "-")
        if value is True or value in ("true", "True", ""):  # a switch: `no_result_cache=true`
            flags.append(flag)
        elif not (value is False or value in ("false", "False")):
            flags += [flag, str(value)]
    parser = argparse.ArgumentParser(prog="llmaccel serve")
    cluster_options.add_serve_arguments(parser)
    parsed = parser.parse_args(flags)
    if not cluster_options.wants_replicas(parsed):
        parsed.replicas = 1
    server, cluster = server_launch.server_config(parsed), cluster_options.cluster_config(parsed)
    cluster_options.check_supported(server)
    options = engine_options(parsed)
    ensure_state_actor(cluster.namespace)
    ingress = serve.deployment(serve.ingress()(Ingress), name="OpenAIIngress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine_application(parsed.model, options, server, cluster), parsed.model, options, server,
                        cluster)
