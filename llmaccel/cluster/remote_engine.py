"""ReplicatedEngine: the AsyncEngine surface the server uses, over a Ray Serve deployment of replicas.

The OpenAI server (server/app.py, server/serving.py) runs unchanged on top: it checks, tokenizes and
queues requests here as it would on a local engine, and reads RequestStreams. Each request becomes
one streamed call to the deployment; its router picks the replica. A request whose replica dies
before sending anything (queued there, or mid-prefill) is sent again, to another replica; so is one
whose outputs the server had not yet read. One that dies after that ends with ReplicaLostError (a
stream's error event). Load and cache
figures come from the ClusterState actor, refreshed every second.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
from types import SimpleNamespace

from llmaccel.cluster import routing
from llmaccel.cluster.kv_index import STATS_INTERVAL_S, prompt_block_hashes
from llmaccel.cluster.replica import GenerateCall
from llmaccel.cluster.wire import OutputDecoder
from llmaccel.engine.kv_cache_manager import PrefixCacheStats
from llmaccel.engine.request_checks import check_request
from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import EngineDeadError, EngineOverloadedError, InvalidRequestError, RequestFailedError
from llmaccel.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class ReplicaLostError(RequestFailedError):
    """The replica generating this request stopped after the request had produced output."""

    def __init__(self, request_id: str) -> None:
        super().__init__(request_id)
        self.args = (f"the replica generating request {request_id} stopped mid-answer; send the request again",)


class ClusterView:
    """What the server reads off `async_engine.engine`: the model's facts (from a replica's
    describe()) and the cluster's load (summed over the live replicas)."""

    def __init__(self, info: dict, config, replica_stats) -> None:
        from llmaccel.structured.compiler import GrammarCompiler

        self.tokenizer = info["tokenizer"]
        self.spec = SimpleNamespace(vocab_size=info["vocab_size"], eos_token_ids=info["eos_token_ids"])
        self.max_model_len = info["max_model_len"]
        self.variant = info["variant"]
        self.dtype, self.device = info["dtype"], info["device"]
        self.num_blocks = info["num_blocks"]  # of one replica
        self.weight_bytes = info["weight_bytes"]
        self.config = config
        self.record_confidence = False
        self.speculation_stats = None
        self.grammars = GrammarCompiler(self.tokenizer, info["vocab_size"], info["eos_token_ids"])
        self._stats = replica_stats  # () -> {replica: stats}

    def check_request(self, token_ids: list[int], params: SamplingParams) -> None:
        check_request(token_ids, params, self.max_model_len, self.spec.vocab_size, self.grammars)

    def _sum(self, key: str) -> float:
        return sum(s.get(key, 0) for s in self._stats().values())

    @property
    def num_running_seqs(self) -> int:
        return int(self._sum("running"))

    @property
    def kv_cache_usage(self) -> float:
        stats = self._stats()
        return sum(s.get("kv_cache_usage", 0.0) for s in stats.values()) / max(len(stats), 1)

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return PrefixCacheStats(queries=int(self._sum("prefix_queries")), hits=int(self._sum("prefix_hits")))

    @property
    def memory_bytes(self) -> dict[str, int]:
        return {k: int(self._sum(f"memory_{k}")) for k in ("weights", "kv_pool", "kv_pool_touched")}


class ReplicatedEngine:
    def __init__(self, handle, config, state_actor, max_waiting_requests: int | None = None,
                 max_retries: int = 3, send_text: bool = False) -> None:
        self._plain_handle = handle
        self._handle = handle.options(stream=True)
        self._config = config
        self._state = state_actor
        self.max_waiting_requests = max_waiting_requests
        self.max_retries = max_retries
        self.send_text = send_text  # Ray's PrefixCacheAffinityRouter matches the prompt's text
        self.replica_stats: dict[str, dict] = {}
        self.engine: ClusterView | None = None  # start() asks a replica to describe the model
        self._streams: dict[str, RequestStream] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._ids = itertools.count()
        self._alive = False
        self._poller: asyncio.Task | None = None

    async def start(self) -> None:
        info = await self._plain_handle.describe.remote()
        self.engine = ClusterView(info, self._config, lambda: self.replica_stats)
        self._root, self._block_size = info["root_hash"], info["block_size"]
        self._hash_blocks = info["prefix_caching"]
        await self._poll_once()
        self._poller = asyncio.get_running_loop().create_task(self._poll())
        self._alive = True

    @property
    def is_alive(self) -> bool:
        return self._alive

    @property
    def num_waiting(self) -> int:
        return int(self.engine._sum("waiting"))

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None,
                    timeout: float | None = None, arrival_time: float | None = None, priority: int = 0,
                    owner: str = "") -> RequestStream:
        """As AsyncEngine.add_request: raises before sending anything if the request is invalid, the
        replicas' queues are full or the cluster is shut down. The replicas schedule in arrival order: `priority`
        and `owner` are not forwarded yet."""
        if not self._alive:
            raise EngineDeadError("the replicas are not running")
        self.engine.check_request(prompt_token_ids, params)
        request_id = request_id or f"rreq-{next(self._ids)}"
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        waiting = self.num_waiting
        if self.max_waiting_requests is not None and waiting + params.n > self.max_waiting_requests:
            raise EngineOverloadedError(f"the replicas' waiting queues are full ({waiting} sequences waiting, "
                                        f"limit {self.max_waiting_requests}); retry shortly")
        ids = list(prompt_token_ids)
        call = GenerateCall(request_id, ids, params,
                            prompt_block_hashes(self._root, ids, self._block_size) if self._hash_blocks else [],
                            self.engine.tokenizer.decode(ids) if self.send_text else "")
        loop = asyncio.get_running_loop()
        stream = RequestStream(self, request_id, None if timeout is None else loop.time() + timeout)
        self._streams[request_id] = stream
        self._tasks[request_id] = loop.create_task(self._relay(call, stream))
        return stream

    def abort(self, request_id: str) -> None:
        self._streams.pop(request_id, None)
        task = self._tasks.pop(request_id, None)
        if task is not None:
            task.cancel()  # cancels the call: the replica's generator closes and aborts the request

    async def call(self, fn) -> object:
        raise NotImplementedError("engine calls (the output guard's scoring) do not cross replicas yet")

    async def shutdown(self, timeout: float = 30.0) -> None:
        self._alive = False
        if self._poller is not None:
            self._poller.cancel()
        for task in list(self._tasks.values()):
            task.cancel()

    async def _relay(self, call: GenerateCall, stream: RequestStream) -> None:
        from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError

        attempt = 0
        try:
            while True:
                answered = False
                response = self._handle.generate.remote(call)
                decoder = OutputDecoder(call.prompt_token_ids)
                try:
                    async for delta in response:
                        answered = True
                        stream._put(decoder.decode(delta))
                    return
                except asyncio.CancelledError:
                    response.cancel()
                    raise
                except (ActorDiedError, ActorUnavailableError, RayActorError) as exc:
                    if answered and stream.taken == 0:  # its outputs are still queued, unread: start over
                        stream._discard_untaken()
                        answered = False
                    if answered:
                        logger.warning("request %s: its replica stopped mid-answer (%s)", call.request_id, exc)
                        stream._put(ReplicaLostError(call.request_id))
                        return
                    if attempt >= self.max_retries:
                        logger.error("request %s: %d replicas stopped before answering it", call.request_id,
                                     attempt + 1)
                        stream._put(EngineDeadError(f"the replicas stopped before answering request "
                                                    f"{call.request_id} ({attempt + 1} tries)"))
                        return
                    attempt += 1
                    with routing.ROUTER_STATS.lock:
                        routing.ROUTER_STATS.retries += 1
                    logger.warning("request %s: its replica stopped before answering; sending it again (try %d)",
                                   call.request_id, attempt + 1)
                    await asyncio.sleep(0.2 * attempt)
                except Exception as exc:  # raised inside the replica: the engine's own error, unwrapped
                    cause = getattr(exc, "cause", None)
                    stream._put(cause if isinstance(cause, Exception) else exc)
                    return
        finally:
            self._tasks.pop(call.request_id, None)

    async def _poll_once(self) -> None:
        self.replica_stats = await self._state.stats.remote()

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(STATS_INTERVAL_S)
            started = time.monotonic()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._poll_once(), timeout=5.0)
            if time.monotonic() - started > 2.0:
                logger.warning("the cluster state actor took %.1f s to answer", time.monotonic() - started)
