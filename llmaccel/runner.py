"""ModelRunner: turns a SchedulerOutput into batch tensors, runs the model, samples.

It owns the KV pool (one K and one V tensor per layer, `[num_blocks * block_size, kv_heads,
head_dim]`) and each seeded request's generator. It knows requests only as token spans.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import ScheduledRequest, SchedulerOutput
from llmaccel.model.llama import LlamaForCausalLM
from llmaccel.ops.attention import AttentionMetadata, PrefillSpan
from llmaccel.outputs import Logprob
from llmaccel.sampler import Sampler, SamplingRow, sampling_row

Sampled = tuple[int, Logprob | None, float | None]  # token, its logprobs (if asked), top probability (if asked)


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, Sampled]  # request id -> what it sampled
    failed: dict[str, BaseException]  # request id -> why it could not sample


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        shape = (num_slots, spec.num_kv_heads, spec.head_dim)
        self._buffer: mmap.mmap | None = None
        slab = self._allocate((spec.num_layers, 2, *shape), dtype)
        self.kv_caches = [(slab[i, 0], slab[i, 1]) for i in range(spec.num_layers)]
        self.sampler = Sampler(spec.vocab_size, device)
        self._generators: dict[str, torch.Generator] = {}

    def _allocate(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The zeroed KV pool. On the CPU it is one anonymous mmap: the OS zero-fills its pages on first
        touch, so RSS grows only as blocks are used. (Transparent huge pages were measured and lost:
        their first-touch faults stalled decode steps by milliseconds, ~4% of a 64 x 128 run.)"""
        if self.device.type != "cpu":
            return torch.zeros(shape, dtype=dtype, device=self.device)
        numel = math.prod(shape)
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        self._buffer = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(self._buffer, dtype=dtype, count=numel).view(shape)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def execute(self, output: SchedulerOutput, confidence: bool = False) -> StepResult:
        """Run one step; returns the sampled token, its logprobs (if asked) and, with `confidence`, the
        top probability of its sampling distribution, for every request that samples, and the error
        of each request whose sampling failed (the others are not affected). An error of the forward
        pass, which no request can be blamed for, is raised."""
        decodes = [s for s in output.scheduled if s.num_new_tokens == 1]
        prefills = [s for s in output.scheduled if s.num_new_tokens > 1]
        ordered = decodes + prefills
        input_ids, positions, slots = [], [], []
        sample_rows: list[int] = []
        sampled_items: list[ScheduledRequest] = []
        for item in ordered:
            request, start, count = item.request, item.request.num_computed_tokens, item.num_new_tokens
            input_ids.extend(request.all_token_ids[start:start + count])
            positions.extend(range(start, start + count))  # absolute: RoPE sees the true position
            table_start = start - self._skipped(request)  # where it lands in the (windowed) block table
            slots.extend(self._slots(request.block_ids, table_start, table_start + count))
            if item.samples:
                sample_rows.append(len(input_ids) - 1)
                sampled_items.append(item)
        meta = self._metadata(decodes, prefills, slots)
        device = self.device
        hidden = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                            meta, self.kv_caches)
        if not sampled_items:
            return StepResult({}, {})
        if len(sample_rows) < hidden.shape[0]:  # prefill rows before their last: no logits wanted
            hidden = hidden[torch.tensor(sample_rows, device=device)]
        logits = self.model.compute_logits(hidden)
        rows, keep, failed = [], [], {}
        for i, item in enumerate(sampled_items):  # a row that cannot be built fails its request alone
            try:
                rows.append(self.sampling_row(item.request))
                keep.append(i)
            except Exception as exc:
                failed[item.request.request_id] = exc
        if len(keep) < len(sampled_items):
            logits = logits[torch.tensor(keep, device=device)]
        ids = [sampled_items[i].request.request_id for i in keep]
        sampled, sample_failures = self._sample(logits, rows, ids, confidence)
        failed.update(sample_failures)
        return StepResult(sampled, failed)

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], ids: list[str], confidence: bool
                ) -> tuple[dict[str, Sampled], dict[str, BaseException]]:
        """One batched call; if it raises, each row alone from the same generator states, so the
        rows that do not raise get exactly the tokens the batch would have given them."""
        if not rows:
            return {}, {}
        states = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
        try:
            tokens, logprobs, top = self.sampler.sample(logits, rows, confidence)
            return {rid: (tokens[i], logprobs[i], top[i] if top else None) for i, rid in enumerate(ids)}, {}
        except Exception:
            for generator, state in states:
                generator.set_state(state)
        sampled, failed = {}, {}
        for i, (row, rid) in enumerate(zip(rows, ids, strict=True)):
            try:
                tokens, logprobs, top = self.sampler.sample(logits[i:i + 1], [row], confidence)
                sampled[rid] = (tokens[0], logprobs[0], top[0] if top else None)
            except Exception as exc:
                failed[rid] = exc
        return sampled, failed

    @torch.inference_mode()
    def chunk_hidden(self, request: Request, count: int) -> torch.Tensor:
        """Compute the next `count` tokens of `request` (its blocks allocated) as one prefill chunk,
        writing their KV; returns the final hidden states, [count, hidden]."""
        start, device = request.num_computed_tokens, self.device
        item = ScheduledRequest(request, count)
        table_start = start - self._skipped(request)
        slots = self._slots(request.block_ids, table_start, table_start + count)
        return self.model(torch.tensor(request.all_token_ids[start:start + count], device=device),
                          torch.arange(start, start + count, device=device),
                          self._metadata([], [item], slots), self.kv_caches)

    @torch.inference_mode()
    def chunk_logprobs(self, request: Request, count: int, rows: int = 256) -> torch.Tensor:
        """As chunk_hidden; returns log p(token[i + 1] | ...) for each position i of the chunk that has
        a next token. Logits are taken `rows` rows at a time, so a long chunk never holds [count, vocab]."""
        start = request.num_computed_tokens
        hidden = self.chunk_hidden(request, count)
        targets = torch.tensor(request.all_token_ids[start + 1:start + count + 1], device=self.device)
        pieces = []
        for first in range(0, len(targets), rows):
            logits = self.model.compute_logits(hidden[first:min(first + rows, len(targets))])
            pieces.append(torch.log_softmax(logits, dim=-1).gather(1, targets[first:first + len(logits), None])
                          .squeeze(1))
        return torch.cat(pieces) if pieces else torch.empty(0, device=self.device)

    def _skipped(self, request: Request) -> int:
        """Positions a KV window freed from the middle of the request's block table."""
        return request.num_skipped_blocks * self.block_size

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """KV-pool slots of positions start..end-1 of a sequence whose block table is `block_ids`."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, decodes: list[ScheduledRequest], prefills: list[ScheduledRequest],
                  slots: list[int]) -> AttentionMetadata:
        device = self.device
        tables = lens = None
        max_len = 0
        if decodes:
            width = max(len(s.request.block_ids) for s in decodes)
            tables = torch.tensor([s.request.block_ids + [0] * (width - len(s.request.block_ids)) for s in decodes],
                                  dtype=torch.int32, device=device)
            context = [s.request.num_computed_tokens + 1 - self._skipped(s.request) for s in decodes]
            lens = torch.tensor(context, dtype=torch.int32, device=device)
            max_len = max(context)
        spans = []
        offset = len(decodes)
        for item in prefills:
            start = item.request.num_computed_tokens - self._skipped(item.request)
            context_len = start + item.num_new_tokens
            context_slots = None
            if start > 0:
                context_slots = torch.tensor(self._slots(item.request.block_ids, 0, context_len), device=device)
            spans.append(PrefillSpan(offset, item.num_new_tokens, context_len, context_slots))
            offset += item.num_new_tokens
        return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                                 num_decode_tokens=len(decodes), decode_block_tables=tables,
                                 decode_context_lens=lens, prefills=spans, block_size=self.block_size,
                                 decode_max_len=max_len)

    def sampling_row(self, request: Request) -> SamplingRow:
        params = request.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
                self._generators[request.request_id] = generator
        return sampling_row(params, request.prompt_token_ids, request.output_token_ids, request.eos_token_ids,
                            generator)
