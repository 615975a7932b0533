"""ModelRunner: turns a SchedulerOutput into batch tensors, runs the model, samples.

It owns the KV pool (one K and one V tensor per layer, `[num_blocks * block_size, kv_heads,
head_dim]`, INT8 rows `head_dim + 2` wide: ops/kv_int8.py) and each seeded request's generator. It knows
requests only as token spans: how spans are laid out as a batch is batch_layout.py; what a step returns,
and how its rows are sampled, step_result.py.
"""

from __future__ import annotations

import functools
import math
import mmap
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from llmaccel.batch_layout import Span, attention_metadata, in_row_order, kv_slots, skipped_positions
from llmaccel.engine.guard_stage import GuardStage, TappedPiece, Verdict
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.lora.manager import LoRAManager
from llmaccel.model.causal_lm import CausalLM
from llmaccel.model.layer_taps import LayerTaps
from llmaccel.model.rope import rope_inverse_frequencies, turn_keys
from llmaccel.model.step_interrupt import StepInterrupt, StepInterrupted
from llmaccel.ops.kv_int8 import loaded, row_width, stored
from llmaccel.sampler import Sampler, SamplingRow, sampling_row
from llmaccel.step_result import (
    Sampled,
    StepResult,
    pool_embeddings,
    prompt_token_logprobs,
    sample_tokens,
    span_features,
    verify_drafts,
)
from llmaccel.structured.compiler import GrammarCompiler


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        spec = model.spec
        self.model = model
        self.block_size = block_size
        self.device = device
        num_slots = num_blocks * block_size
        shape = (num_slots, spec.num_kv_heads, row_width(spec.head_dim, dtype))
        self._buffer: mmap.mmap | None = None
        slab = self.kv_slab = self._allocate((spec.num_layers, 2, *shape), dtype)
        self.kv_caches = [(slab[i, 0], slab[i, 1]) for i in range(spec.num_layers)]
        self.sampler = Sampler(spec.vocab_size, device)
        self._generators: dict[str, torch.Generator] = {}
        self.grammars: GrammarCompiler | None = None  # the engine's, for requests with structured outputs
        self._mask_worker: ThreadPoolExecutor | None = None
        # fill grammar masks on a worker thread during the forward pass, else just before it: on a CPU the
        # forward pass has every core already (bench structured: no gain from overlap on 2 cores)
        self.overlap_masks = device.type != "cpu"
        self.guard: GuardStage | None = None  # the semantic input guard (engine/guard_stage.py), when on
        self.loras: LoRAManager | None = None  # the LoRA adapters beside the model (set by the engine), when on
        # --batch-invariant: prompt chunks run as decode rows too (the decode attention kernel, every row over its
        # whole context in one order), so a token's KV and logits do not depend on how its prompt was chunked or
        # how much of it the prefix cache held
        self.chunks_as_rows = False

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

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        """Copy the first `num_tokens` slots of block `source` into block `target`, every layer's K and V
        (a partial prefix-cache hit, engine/kv_cache_manager.py)."""
        src, dst = source * self.block_size, target * self.block_size
        self.kv_slab[:, :, dst:dst + num_tokens].copy_(self.kv_slab[:, :, src:src + num_tokens])

    def turn_sink_keys(self, sources: list[int], targets: list[int], delta: int) -> None:
        """Copy blocks `sources` into `targets`, every layer's keys turned by `delta` positions and values as they
        are (re-indexed attention sinks, engine/kv_cache_manager.py)."""
        block_size = self.block_size
        offsets = torch.arange(block_size, device=self.device)
        src = (torch.tensor(sources, device=self.device)[:, None] * block_size + offsets).flatten()
        dst = (torch.tensor(targets, device=self.device)[:, None] * block_size + offsets).flatten()
        keys = turn_keys(loaded(self.kv_slab[:, 0, src], torch.float32), delta, self._inverse_frequencies)
        self.kv_slab[:, 0, dst] = stored(keys, self.kv_slab.dtype)
        self.kv_slab[:, 1, dst] = self.kv_slab[:, 1, src]

    @functools.cached_property
    def _inverse_frequencies(self) -> torch.Tensor:
        """RoPE's, for turning sink keys (computed at the first turn, not at every one)."""
        spec = self.model.spec
        return rope_inverse_frequencies(spec.head_dim, spec.rope_theta, spec.rope_scaling,
                                        spec.max_position_embeddings).to(self.device)

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)
        if self.guard is not None:
            self.guard.forget(request_id)

    def execute(self, output: SchedulerOutput, confidence: bool = False,
                drafts: Mapping[str, list[int]] | None = None, features: bool = False,
                interrupt: StepInterrupt | None = None) -> StepResult:
        """Run one step; returns, for every request that samples, its new tokens (one, or with `drafts`
        the kept drafts and one more, spec/verify.py), each with its logprobs (if asked) and, with
        `confidence`, the top probability of its sampling distribution; and the error of each request
        whose sampling failed (the others are not affected). An error of the forward pass, which no
        request can be blamed for, is raised. `drafts`: request id -> tokens proposed after its last
        token, verified in this pass as rows of their own (the scheduler gave them slots). `features`: also
        return every row's final hidden state by request (a draft head reads them, spec/draft_head.py).
        `interrupt`: raised by another thread, the forward pass stops at a layer boundary with StepInterrupted, and
        nothing of the step is kept (model/step_interrupt.py)."""
        drafts = drafts or {}
        spans = []
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            if item.num_new_tokens == 1:
                spans.append(Span(request, start, [request.all_token_ids[start], *drafts.get(request.request_id, ())],
                                  as_rows=True, drafted=True))
            else:  # with chunks_as_rows, every prompt token is a decode query of its own as well
                spans.append(Span(request, start, request.all_token_ids[start:start + item.num_new_tokens],
                                  as_rows=self.chunks_as_rows))
        by_request = {item.request.request_id: item for item in output.scheduled}
        masks = self._start_masks(output, drafts)
        spans = in_row_order(spans)
        pieces = self._guard_pieces(spans) if self.guard is not None else []
        taps = self.guard.taps(pieces) if pieces else None
        try:
            hidden, spans = self.forward_spans(spans, taps=taps, interrupt=interrupt)
        except StepInterrupted:
            if masks is not None:  # the worker must be done with the grammars before the next step fills them
                masks[1].exception()
            raise
        judged = self.guard.observe(pieces, taps) if taps is not None else {}
        kept_features = span_features(hidden, spans) if features else {}
        prompt_logprobs = prompt_token_logprobs(self.model, self.sampler, hidden, spans)
        embeddings = pool_embeddings(hidden, spans, {rid for rid, item in by_request.items() if item.samples}) \
            if any(span.request.params.pooling for span in spans) else {}
        # rows to sample, of the spans that reach their request's last token: every row of a rows span
        # (a draft's verdict needs the target's token there), the last row of a chunk
        sample_rows: list[int] = []
        sampled_spans: list[tuple[Span, int]] = []
        end = 0  # the row after the span's last
        for span in spans:
            end += len(span.token_ids)
            judgement = judged.get(span.request.request_id)
            if judgement is not None and judgement.verdict is Verdict.BLOCK:
                continue  # judged before its first token: never sampled
            if span.request.params.pooling is not None:
                continue  # an embedding request: pooled, never sampled
            if by_request[span.request.request_id].samples:
                count = len(span.token_ids) if span.drafted else 1
                sampled_spans.append((span, len(sample_rows)))
                sample_rows.extend(range(end - count, end))
        if not sampled_spans:
            return StepResult({}, {}, kept_features, prompt_logprobs, judged, embeddings)
        device = self.device
        if len(sample_rows) < hidden.shape[0]:
            hidden = hidden[torch.tensor(sample_rows, dtype=torch.long, device=device)]
        logits = self.model.compute_logits(hidden)
        rows, keep, owners, failed = [], [], [], {}
        mask_rows, mask = masks if masks is not None else ({}, None)
        try:
            mask = mask.result() if mask is not None else None
        except Exception as exc:  # a grammar's fault fails the constrained requests, not the step
            failed.update(dict.fromkeys(mask_rows, exc))
        for span, first in sampled_spans:  # a row that cannot be built fails its request alone
            request = span.request
            proposal = span.token_ids[1:] if span.drafted else []
            if request.request_id in failed:
                continue
            try:
                built = [self.sampling_row(request, proposal[:j]) for j in range(len(proposal) + 1)]
                if request.request_id in mask_rows:
                    for j, row in enumerate(built):
                        row.allowed = mask[mask_rows[request.request_id] + j]
            except Exception as exc:
                failed[request.request_id] = exc
                continue
            rows.extend(built)
            keep.extend(range(first, first + len(built)))
            owners.append((span, len(keep) - len(built)))
        if len(keep) < len(sample_rows):
            logits = logits[torch.tensor(keep, dtype=torch.long, device=device)]
        row_results, row_failures = sample_tokens(self.sampler, logits, rows, confidence)
        sampled: dict[str, list[Sampled]] = {}
        for span, first in owners:
            request = span.request
            count = len(span.token_ids) if span.drafted else 1
            indices = range(first, first + count)
            errors = [row_failures[i] for i in indices if i in row_failures]
            if errors:
                failed[request.request_id] = errors[0]
                continue
            results = [row_results[i] for i in indices]
            if count == 1:
                sampled[request.request_id] = results
                continue
            try:
                sampled[request.request_id] = verify_drafts(self.sampler, span, logits[first:first + count],
                                                            rows[first:first + count], results)
            except Exception as exc:
                failed[request.request_id] = exc
        return StepResult(sampled, failed, kept_features, prompt_logprobs, judged, embeddings)

    def _start_masks(self, output: SchedulerOutput, drafts: Mapping[str, list[int]]
                     ) -> tuple[dict[str, int], Future] | None:
        """For the requests with a grammar that sample this step: their first mask row (one row per
        token they sample: the next one and one after each draft), and the masks: with `overlap_masks`
        filled on a worker thread while the forward pass runs, else here and now. None when no such
        request runs."""
        places, requests, num_rows = {}, [], 0
        for item in output.scheduled:
            request = item.request
            if item.samples and request.grammar is not None:
                proposal = drafts.get(request.request_id, []) if item.num_new_tokens == 1 else []
                places[request.request_id] = num_rows
                requests.append((request.grammar, num_rows, proposal))
                num_rows += 1 + len(proposal)
        if not requests:
            return None
        if not self.overlap_masks:
            done: Future = Future()
            try:
                done.set_result(self.grammars.fill(requests, num_rows))
            except Exception as exc:
                done.set_exception(exc)
            return places, done
        if self._mask_worker is None:
            self._mask_worker = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        return places, self._mask_worker.submit(self.grammars.fill, requests, num_rows)

    @torch.inference_mode()
    def forward_spans(self, spans: list[Span], features: torch.Tensor | None = None, taps: LayerTaps | None = None,
                      interrupt: StepInterrupt | None = None) -> tuple[torch.Tensor | None, list[Span]]:
        """Run spans of tokens (their blocks allocated) through the model, writing their K/V. Returns the
        final hidden states, [rows, hidden], and the spans in the order of those rows: rows spans first
        (every token a decode query of its own), then chunks (causal within, over their cached context).
        `features`: a draft head's second input, a row per token in that order (spec/draft_head.py).
        `taps`: read the residual stream after chosen layers (model/layer_taps.py), at rows in that order."""
        ordered = in_row_order(spans)
        input_ids, positions, slots = [], [], []
        for span in ordered:
            count = len(span.token_ids)
            input_ids.extend(span.token_ids)
            positions.extend(range(span.start, span.start + count))  # absolute: RoPE sees the true position
            # where it lands in the (windowed) block table
            table_start = span.start - skipped_positions(span.request, self.block_size)
            slots.extend(kv_slots(span.request.block_ids, table_start, table_start + count, self.block_size))
        device = self.device
        meta = attention_metadata(ordered, slots, self.block_size, device)
        if self.loras is not None:  # each row's LoRA adapter (lora/layers.py)
            self.loras.set_rows([span.request.lora_slot for span in ordered for _ in span.token_ids])
        extra = {} if features is None else {"features": features}
        if taps is not None:
            extra["taps"] = taps
        if interrupt is not None:
            extra["interrupt"] = interrupt
        hidden = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), meta,
                            self.kv_caches, **extra)
        return hidden, ordered

    @torch.inference_mode()
    def chunk_hidden(self, request: Request, count: int) -> torch.Tensor:
        """Compute the next `count` tokens of `request` (its blocks allocated) as one prefill chunk,
        writing their KV; returns the final hidden states, [count, hidden]."""
        start = request.num_computed_tokens
        return self.forward_spans([Span(request, start, request.all_token_ids[start:start + count])])[0]

    @torch.inference_mode()
    def chunk_taps(self, request: Request, count: int, layers: tuple[int, ...]) -> torch.Tensor:
        """As chunk_hidden, but the pass ends after the last of `layers`: the stream there, [count, layers * hidden]."""
        start = request.num_computed_tokens
        taps = LayerTaps(layers, stop=True)
        self.forward_spans([Span(request, start, request.all_token_ids[start:start + count])], taps=taps)
        return taps.features()

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

    def _guard_pieces(self, spans: list[Span]) -> list[TappedPiece]:
        """The prompt rows of these spans (in row order) the semantic guard still has to pool."""
        pieces, offset, untapped = [], 0, []
        bs = self.block_size
        for span in spans:
            request = span.request
            count = min(len(span.token_ids), request.num_prompt_tokens - span.start) \
                if self.guard.wants(request, span.start) else 0
            table_start = span.start - skipped_positions(request, bs)
            if count:
                blocks = [slot // bs for slot in kv_slots(request.block_ids, table_start, table_start + count, bs)]
                pieces.append(TappedPiece(request, span.start, count, blocks, offset))
            # a block begun by rows not tapped (a decode's) holds no sum: a later prefix-cache hit must not read one
            untapped += [request.block_ids[(table_start + k) // bs] for k in range(count, len(span.token_ids))
                         if (table_start + k) % bs == 0]
            offset += len(span.token_ids)
        self.guard.forget_blocks(untapped)
        return pieces

    def sampling_row(self, request: Request, drafts: list[int] | None = None) -> SamplingRow:
        """The request's sampling row; with `drafts`, for the token after its output and those drafts."""
        params = request.params
        generator = None
        if params.seed is not None and not params.greedy:
            generator = self._generators.get(request.request_id)
            if generator is None:
                generator = torch.Generator(device=self.device)
                generator.manual_seed(params.seed)
                self._generators[request.request_id] = generator
        output = request.output_token_ids + drafts if drafts else request.output_token_ids
        return sampling_row(params, request.prompt_token_ids, output, request.eos_token_ids, generator)
