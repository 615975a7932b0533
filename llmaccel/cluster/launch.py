"""`llmaccel serve --replicas N`: engine replicas on Ray Serve behind this process's OpenAI ingress.

This process keeps the HTTP side (uvicorn, the same app, auth, limits, result cache and metrics as
a single-process server) and the router; each replica is an llmaccel engine in a Ray actor process.
Without a --ray-address a local Ray instance is started with this machine's cores and stopped at exit.
"""

from __future__ import annotations

import logging
import os

from llmaccel.cluster.options import ClusterConfig, check_supported
from llmaccel.config import EngineConfig, ServerConfig
from llmaccel.model.loader import resolve_model_path

logger = logging.getLogger(__name__)
APP_NAME = "llmaccel"


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
