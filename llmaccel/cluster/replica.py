"""EngineReplica: one llmaccel engine in its own Ray actor process, with its own KV cache.

The ingress calls `generate` (streamed) with a GenerateCall: prompt token ids the ingress already
checked, and the sampling parameters. Outputs go back as the engine's RequestOutputs. The replica
publishes its prefix cache's block hashes and its load to the ClusterState actor (kv_index.py), and
fails Ray Serve's health check once its engine has stopped, so Serve replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from llmaccel.cluster.kv_index import PUBLISH_INTERVAL_S, STATE_ACTOR, STATS_INTERVAL_S, short_hash
from llmaccel.cluster.wire import OutputDelta, OutputEncoder
from llmaccel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class GenerateCall:
    """One engine request as it crosses from the ingress to a replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    block_hashes: list[int] = field(default_factory=list)  # the prompt's full blocks, for the router
    prompt: str = ""  # the prompt's text, only for routers that match text (Ray's PrefixCacheAffinityRouter)


class EngineReplica:
    """The Ray Serve deployment class (wrapped by `serve.deployment` in deployment.py)."""

    async def __init__(self, model: str, engine_options: dict, threads: int, max_waiting_requests: int | None,
                       max_failed_steps: int, namespace: str, stream_interval_s: float = 0.0,
                       updates_per_s: float = 0.0) -> None:
        import ray
        import torch
        from ray import serve

        from llmaccel.config import EngineConfig
        from llmaccel.engine.async_engine import AsyncEngine
        from llmaccel.engine.engine import LLMEngine

        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
        config = EngineConfig.create(model, **engine_options)

        def build() -> LLMEngine:  # in the engine's own thread, which runs every torch op
            torch.set_num_threads(threads)
            return LLMEngine(config)

        self.engine = AsyncEngine(build, max_waiting_requests=max_waiting_requests, max_failed_steps=max_failed_steps)
        self.stream_interval_s = stream_interval_s
        self.updates_per_s = updates_per_s  # a budget for all streams together; 0: none
        self.active = 0
        await self.engine.start()  # a model that fails to load fails the constructor: Serve reports it
        self.name = serve.get_replica_context().replica_id.to_full_id_str()
        self.requests = 0
        self.generated = 0
        self._events = None
        if config.cache.enable_prefix_caching:
            self._events = await self.engine.call(lambda e: e.kv_cache.pool.record_events())
        self._state = ray.get_actor(STATE_ACTOR, namespace=namespace)
        self._state.publish.remote(self.name, self.stats(), [], [], reset=True)
        self._publisher = asyncio.get_running_loop().create_task(self._publish())
        logger.info("replica %s ready: %s with %d thread(s)", self.name, model, threads)

    async def generate(self, call: GenerateCall) -> AsyncIterator[OutputDelta]:
        """The request's updates (wire.py): the first at once, then at most one per interval, each
        covering the steps since the one before, and the last when it finishes. The interval is the
        stream interval, or longer when many streams share the update budget: each streamed item costs
        Ray a fixed share of a core, whatever it carries (64 streams updated every step took a third
        of a core in the ingress alone, on 2 cores)."""
        stream = self.engine.add_request(call.prompt_token_ids, call.params, call.request_id)
        self.requests += 1
        self.active += 1
        encoder = OutputEncoder()
        loop = asyncio.get_running_loop()
        sent_at = None
        try:
            async for output in stream:
                encoder.absorb(output)
                now = loop.time()
                interval = max(self.stream_interval_s, self.active / self.updates_per_s if self.updates_per_s else 0)
                if output.finished or sent_at is None or now - sent_at >= interval:
                    if output.finished:
                        self.generated += sum(len(c.token_ids) for c in output.outputs)
                    sent_at = now
                    yield encoder.encode()
        finally:
            self.active -= 1
            stream.close()  # a cancelled call (the client went away) aborts the request here

    def describe(self) -> dict:
        """What the ingress needs to check, tokenize and hash requests as this engine would."""
        engine = self.engine.engine
        return {"tokenizer": engine.tokenizer, "vocab_size": engine.spec.vocab_size,
                "eos_token_ids": tuple(engine.spec.eos_token_ids), "max_model_len": engine.max_model_len,
                "variant": engine.variant, "block_size": engine.kv_cache.block_size,
                "root_hash": engine.kv_cache.root_hash, "dtype": str(engine.dtype), "device": str(engine.device),
                "num_blocks": engine.num_blocks, "weight_bytes": engine.weight_bytes,
                "prefix_caching": engine.kv_cache.enable_prefix_caching}

    def stats(self) -> dict:
        engine = self.engine.engine
        prefix = engine.prefix_cache_stats
        return {"running": engine.num_running_seqs, "waiting": self.engine.num_waiting,
                "kv_cache_usage": engine.kv_cache_usage, "prefix_queries": prefix.queries,
                "prefix_hits": prefix.hits, "requests": self.requests, "generated_tokens": self.generated,
                "preemptions": engine.num_preemptions, "pid": os.getpid(), **self._shared_tier(engine), **{
                    f"memory_{k}": v for k, v in engine.memory_bytes.items()}}

    @staticmethod
    def _shared_tier(engine) -> dict:
        """With a disk tier written through (replicas share its directory), what one of its blocks is worth against
        one in RAM (None until measured): the cache-aware router counts the blocks any replica computed by it."""
        tier = engine.kv_cache.tier
        return {"kv_tier_block_value": tier.block_value()} if tier is not None and tier.write_through else {}

    def check_health(self) -> None:
        """Ray Serve calls this periodically; raising makes it replace the replica."""
        if not self.engine.is_alive:
            raise RuntimeError(f"replica {self.name}: the engine stopped after repeated internal errors")

    async def _publish(self) -> None:
        loop = asyncio.get_running_loop()
        last_stats = 0.0
        while True:
            await asyncio.sleep(PUBLISH_INTERVAL_S)
            stored: list[int] = []
            removed: list[int] = []
            events = self._events
            while events:
                is_stored, digest = events.popleft()
                (stored if is_stored else removed).append(short_hash(digest))
            now = loop.time()
            due = now - last_stats >= STATS_INTERVAL_S
            if stored or removed or due:
                with contextlib.suppress(Exception):  # the state actor restarts with the cluster
                    self._state.publish.remote(self.name, self.stats(), stored, removed)
                last_stats = now

    async def __del__(self) -> None:
        self._publisher.cancel()
        await self.engine.shutdown()
