"""ServerState: what the app's routes share (the engines, the config, the limits), in a module of its
own so that the route modules (server/answer.py) and the app that builds it both import it."""

from __future__ import annotations

from dataclasses import dataclass

from llmaccel.config import ServerConfig
from llmaccel.engine.async_engine import AsyncEngine
from llmaccel.safety.rate_limit import RateLimiter
from llmaccel.server.auth import Gate
from llmaccel.server.metrics import ServerMetrics
from llmaccel.server.serving import OpenAIServing
from llmaccel.server.stats import DashboardStats


@dataclass
class ServerState:
    config: ServerConfig
    metrics: ServerMetrics
    model_names: tuple[str, ...]
    engine: AsyncEngine | None = None
    small_engine: AsyncEngine | None = None  # a cascade's small model (--cascade-small)
    serving: OpenAIServing | None = None
    draining: bool = False
    load_error: BaseException | None = None
    created: int = 0
    rate_limiter: RateLimiter | None = None
    gate: Gate | None = None
    engine_died: bool = False  # the engine stopped after failing steps: the process should exit non-zero
    stats: DashboardStats | None = None  # /v1/llmaccel/stats, once the engine is up

    @property
    def engines_alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive and (
            self.small_engine is None or self.small_engine.is_alive)
