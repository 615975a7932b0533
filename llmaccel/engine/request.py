"""Request: one sequence being generated, as the scheduler and KV cache manager see it."""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING

from llmaccel.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"
    FINISHED_ERROR = "error"  # the engine failed on this request (a bug); the others went on
    FINISHED_FILTERED = "content_filter"  # the semantic input guard blocked its prompt before its first token

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_ERROR,
                        RequestStatus.FINISHED_FILTERED)


class Request:
    """A prompt and its growing output.

    `num_computed_tokens` counts tokens whose KV is in the cache; `num_tokens` counts all tokens
    (prompt + output). The scheduler's only job is to close that gap. With a KV window, `block_ids`
    holds the sink blocks and then the window's: the `num_skipped_blocks` between them were freed.
    """

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 eos_token_ids: tuple[int, ...] = (), max_tokens: int | None = None,
                 arrival_time: float | None = None, priority: int = 0, owner: str = "") -> None:
        self.request_id = request_id
        self.priority = priority  # with the priority policy: lower first
        self.owner = owner  # who sent it (an API key's client id): the priority policy shares the budget by owner
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(prompt_token_ids)
        self.params = params
        self.eos_token_ids = eos_token_ids
        self.max_tokens = max_tokens if max_tokens is not None else params.max_tokens
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained prefix hashes of its full blocks (KVCacheManager)
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at its first admission
        self.num_skipped_blocks = 0  # with a KV window: blocks freed between the sinks and the window
        self.pooled: torch.Tensor | None = None  # an embedding request: the sum (mean) or last row so far
        self.embedding: list[float] | None = None  # ... and its vector, once its prompt has run
        self.sink_block_ids: list[int] = []  # re-indexed sinks: the originals (block_ids holds turned copies)
        self.lora_slot = -1  # the slot of its LoRA adapter (lora/manager.py), -1: the base model
        self.cache_salt = ""  # starts its prefix-cache hash chain (its LoRA adapter's digest; "": the model's own)
        self.num_preemptions = 0
        self.confidence_sum = 0.0  # top probabilities of its sampling distributions (when the engine records them)
        self.stop_reason: str | int | None = None
        # with params.prompt_logprobs: filled by prefill, position by position (a recompute rewrites the same)
        self.prompt_logprobs: list | None = [None] * len(prompt_token_ids) if params.prompt_logprobs is not None \
            else None
        self.guard_judgement = None  # with a semantic guard: its prompt's Judgement (engine/guard_stage.py)
        self.grammar = None  # with structured outputs: its GrammarMatcher (structured/compiler.py)
        self.arrival_time = arrival_time if arrival_time is not None else time.time()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def truncate_output(self, num_output_tokens: int) -> None:
        """Keep only the first `num_output_tokens` output tokens (a stop string ended it inside a step's
        kept drafts)."""
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens:]

    def check_stop_token(self) -> bool:
        """Finish on EOS / stop_token_ids / max_tokens after a token was appended. Stop strings
        are the detokenizer's job, since they need text."""
        token = self.output_token_ids[-1]
        params = self.params
        if self.num_output_tokens >= params.min_tokens:
            if (not params.ignore_eos and token in self.eos_token_ids) or token in params.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = token
                return True
        if self.max_tokens is not None and self.num_output_tokens >= self.max_tokens:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, status={self.status.value}, blocks={self.block_ids})")
