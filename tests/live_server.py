"""A real uvicorn server in a background thread, on a free 127.0.0.1 port, for e2e tests."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import httpx
import uvicorn

from llmaccel.config import EngineConfig, ServerConfig
from llmaccel.engine.engine import LLMEngine
from llmaccel.server.app import create_app
from llmaccel.server.metrics import parse_metrics
from llmaccel.server.state import ServerState

MODEL_NAME = "tiny"


@dataclass
class LiveServer:
    url: str  # http://127.0.0.1:PORT
    state: ServerState
    server: uvicorn.Server

    @property
    def engine(self) -> LLMEngine:
        return self.state.engine.engine

    def wait_idle(self, timeout: float = 30.0) -> None:
        """Until the engine has no request left and every KV block is free again."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            engine = self.engine
            if not engine.has_unfinished_requests() and engine.num_free_blocks == engine.num_blocks:
                return
            time.sleep(0.02)
        raise AssertionError(f"engine not idle: {self.engine.num_unfinished_requests} requests, "
                             f"{self.engine.num_free_blocks}/{self.engine.num_blocks} blocks free")


def scrape(url: str) -> dict[str, dict[tuple, float]]:
    """/metrics -> {sample name: {labels: value}}."""
    return parse_metrics(httpx.get(url + "/metrics").text)


def metric(server: LiveServer, name: str, **labels: str) -> float:
    """One sample of /metrics. A metric without labels must be there; a labelled sample not yet
    counted reads 0 (prometheus exports no child before its first increment)."""
    samples = scrape(server.url)
    if not labels:
        return samples[name][()]
    return samples.get(name, {}).get(tuple(sorted(labels.items())), 0.0)


def _free_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    return sock


@contextlib.contextmanager
def live_server(model_dir, engine_factory: Callable[[], LLMEngine] | None = None, wait_ready: bool = True,
                engine_options: dict | None = None, small_dir=None, **server_options: object) -> Iterator[LiveServer]:
    """`small_dir`: a cascade's small model, loaded with the same engine options (set cascade_threshold)."""
    sock = _free_socket()
    port = sock.getsockname()[1]
    server_options.setdefault("result_cache", False)  # engine tests want every request to reach the engine
    if small_dir is not None:
        server_options["cascade_small"] = str(small_dir)
    config = ServerConfig(port=port, **server_options)  # type: ignore[arg-type]
    options = {"num_kv_blocks": 256, "max_num_seqs": 64, **(engine_options or {})}
    factory = engine_factory or (lambda: LLMEngine(EngineConfig.create(str(model_dir), **options)))
    small = None if small_dir is None else (lambda: LLMEngine(EngineConfig.create(str(small_dir), **options)))
    app = create_app(config, factory, model_name=MODEL_NAME, small_engine_factory=small)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, proxy_headers=False))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    live = LiveServer(f"http://127.0.0.1:{port}", app.state.server, server)
    try:
        deadline = time.monotonic() + 180  # a fresh machine compiles the CPU kernels first (~1 min)
        while wait_ready:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(live.url + "/health", timeout=1).status_code == 200:
                    break
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not become ready")
            time.sleep(0.05)
        yield live
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


def wait_until(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.1):
    """condition()'s first truthy value, polled every `interval` s; an AssertionError naming `what`
    after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
