"""ModelRunner: turns a SchedulerOutput into batch tensors, runs the model, samples.

It owns the KV pool (one K and one V tensor per layer, `[num_blocks * block_size, kv_heads,
head_dim]`) and each seeded request's generator. It knows requests only as token spans.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from llmaccel.engine.guard_stage import GuardStage, Judgement, TappedPiece, Verdict
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import SchedulerOutput
from llmaccel.model.causal_lm import CausalLM
from llmaccel.model.layer_taps import LayerTaps
from llmaccel.ops.attention import AttentionMetadata, PrefillSpan
from llmaccel.outputs import Logprob
from llmaccel.sampler import Sampler, SamplingRow, sampling_row
from llmaccel.spec.verify import accepted_greedy, accepted_sampled
from llmaccel.structured.compiler import GrammarCompiler

PROMPT_LOGPROB_ROWS = 256  # prompt rows whose logits are taken at once: a long prompt's [rows, vocab] stays small

Sampled = tuple[int, Logprob | None, float | None]  # token, its logprobs (if asked), top probability (if asked)


@dataclass(frozen=True)
class StepResult:
    sampled: dict[str, list[Sampled]]  # request id -> the tokens it took this step, in order
    failed: dict[str, BaseException]  # request id -> why it could not sample
    # with `features`: request id -> (first position, the final hidden states of the rows it ran)
    features: dict[str, tuple[int, torch.Tensor]] = field(default_factory=dict)
    # requests with prompt_logprobs: request id -> (first prompt position, the logprobs of its tokens there on)
    prompt_logprobs: dict[str, tuple[int, list[Logprob]]] = field(default_factory=dict)
    # with a semantic guard: request id -> its judgement, for each request whose prompt ended this step
    judged: dict[str, Judgement] = field(default_factory=dict)


@dataclass
class Span:
    """Tokens of one sequence to run at positions start.. (its blocks allocated). `as_rows`: each token is
    a decode query of its own (the decode kernels; successive rows see each other), else one causal chunk."""

    request: Request
    start: int
    token_ids: list[int]
    as_rows: bool = False


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, dtype: torch.dtype,
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
        self.grammars: GrammarCompiler | None = None  # the engine's, for requests with structured outputs
        self._mask_worker: ThreadPoolExecutor | None = None
        # fill grammar masks on a worker thread during the forward pass, else just before it: on a CPU the
        # forward pass has every core already (bench structured: no gain from overlap on 2 cores)
        self.overlap_masks = device.type != "cpu"
        self.guard: GuardStage | None = None  # the semantic input guard (engine/guard_stage.py), when on

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
        if self.guard is not None:
            self.guard.forget(request_id)

    def execute(self, output: SchedulerOutput, confidence: bool = False,
                drafts: Mapping[str, list[int]] | None = None, features: bool = False) -> StepResult:
        """Run one step; returns, for every request that samples, its new tokens (one, or with `drafts`
        the kept drafts and one more, spec/verify.py), each with its logprobs (if asked) and, with
        `confidence`, the top probability of its sampling distribution; and the error of each request
        whose sampling failed (the others are not affected). An error of the forward pass, which no
        request can be blamed for, is raised. `drafts`: request id -> tokens proposed after its last
        token, verified in this pass as rows of their own (the scheduler gave them slots). `features`: also
        return every row's final hidden state by request (a draft head reads them, spec/draft_head.py)."""
        drafts = drafts or {}
        spans = []
        for item in output.scheduled:
            request, start = item.request, item.request.num_computed_tokens
            if item.num_new_tokens == 1:
                spans.append(Span(request, start, [request.all_token_ids[start], *drafts.get(request.request_id, ())],
                                  as_rows=True))
            else:
                spans.append(Span(request, start, request.all_token_ids[start:start + item.num_new_tokens]))
        by_request = {item.request.request_id: item for item in output.scheduled}
        masks = self._start_masks(output, drafts)
        spans = _in_row_order(spans)
        pieces = self._guard_pieces(spans) if self.guard is not None else []
        taps = self.guard.taps(pieces) if pieces else None
        hidden, spans = self.forward_spans(spans, taps=taps)
        judged = self.guard.observe(pieces, taps) if taps is not None else {}
        kept_features = self._features(hidden, spans) if features else {}
        prompt_logprobs = self._prompt_logprobs(hidden, spans)
        # rows to sample, of the spans that reach their request's last token: every row of a rows span
        # (a draft's verdict needs the target's token there), the last row of a chunk
        sample_rows: list[int] = []
        sampled_spans: list[tuple[Span, int]] = []
        offset = 0
        for span in spans:
            judgement = judged.get(span.request.request_id)
            if judgement is not None and judgement.verdict is Verdict.BLOCK:
                continue  # judged before its first token: never sampled
            if by_request[span.request.request_id].samples:
                count = len(span.token_ids) if span.as_rows else 1
                sampled_spans.append((span, len(sample_rows)))
                sample_rows.extend(range(offset + len(span.token_ids) - count, offset + len(span.token_ids)))
            offset += len(span.token_ids)
        if not sampled_spans:
            return StepResult({}, {}, kept_features, prompt_logprobs, judged)
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
            proposal = span.token_ids[1:] if span.as_rows else []
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
        row_results, row_failures = self._sample(logits, rows, confidence)
        sampled: dict[str, list[Sampled]] = {}
        for span, first in owners:
            request = span.request
            count = len(span.token_ids) if span.as_rows else 1
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
                sampled[request.request_id] = self._verify(span, logits[first:first + count], rows[first:first + count],
                                                           results)
            except Exception as exc:
                failed[request.request_id] = exc
        return StepResult(sampled, failed, kept_features, prompt_logprobs, judged)

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

    def _prompt_logprobs(self, hidden: torch.Tensor, spans: list[Span]) -> dict[str, tuple[int, list[Logprob]]]:
        """For the requests that asked: the logprob of each prompt token these spans' rows predict (the row
        at position p predicts the token at p + 1), with the top N and its rank there."""
        out, offset = {}, 0
        for span in spans:
            request, count = span.request, len(span.token_ids)
            top_n = request.params.prompt_logprobs
            end = min(span.start + count, request.num_prompt_tokens - 1)  # rows that predict a prompt token
            if top_n is not None and span.start < end:
                items = []
                for lo in range(0, end - span.start, PROMPT_LOGPROB_ROWS):
                    rows = hidden[offset + lo:offset + min(lo + PROMPT_LOGPROB_ROWS, end - span.start)]
                    logits = self.model.compute_logits(rows)[:, :self.sampler.vocab_size].float()
                    for j, row in enumerate(torch.log_softmax(logits, dim=-1)):
                        token = request.all_token_ids[span.start + lo + j + 1]
                        items.append(self.sampler.logprob_of(row, token, top_n, rank=True))
                out[request.request_id] = (span.start + 1, items)
            offset += count
        return out

    @staticmethod
    def _features(hidden: torch.Tensor, spans: list[Span]) -> dict[str, tuple[int, torch.Tensor]]:
        """Each span's rows of `hidden`, views of one copy (the decode stack reuses its output buffer)."""
        out, offset, hidden = {}, 0, hidden.clone()
        for span in spans:
            count = len(span.token_ids)
            out[span.request.request_id] = (span.start, hidden[offset:offset + count])
            offset += count
        return out

    def _verify(self, span: Span, logits: torch.Tensor, rows: list[SamplingRow], results: list[Sampled]
                ) -> list[Sampled]:
        """The tokens a decode span keeps of its drafts, and one more (spec/verify.py), with their
        logprobs and confidence from the row each was chosen at."""
        proposal = span.token_ids[1:]
        targets = [token for token, _, _ in results]
        if rows[0].params.greedy:
            return results[:len(accepted_greedy(targets, proposal))]
        probs = self.sampler.distribution(logits, rows)
        tokens = accepted_sampled(probs, proposal, targets[-1], rows[0].generator)
        kept = []
        for j, token in enumerate(tokens):
            sampled_token, logprob, top = results[j]
            if token != sampled_token and logprob is not None:  # the row drew another token: its own logprobs
                logprob = self.sampler.logprob(logits[j], token, rows[j].params.logprobs or 0)
            kept.append((token, logprob, top))
        return kept

    @torch.inference_mode()
    def forward_spans(self, spans: list[Span], features: torch.Tensor | None = None, taps: LayerTaps | None = None
                      ) -> tuple[torch.Tensor | None, list[Span]]:
        """Run spans of tokens (their blocks allocated) through the model, writing their K/V. Returns the
        final hidden states, [rows, hidden], and the spans in the order of those rows: rows spans first
        (every token a decode query of its own), then chunks (causal within, over their cached context).
        `features`: a draft head's second input, a row per token in that order (spec/draft_head.py).
        `taps`: read the residual stream after chosen layers (model/layer_taps.py), at rows in that order."""
        ordered = _in_row_order(spans)
        input_ids, positions, slots = [], [], []
        for span in ordered:
            count = len(span.token_ids)
            input_ids.extend(span.token_ids)
            positions.extend(range(span.start, span.start + count))  # absolute: RoPE sees the true position
            table_start = span.start - self._skipped(span.request)  # where it lands in the (windowed) block table
            slots.extend(self._slots(span.request.block_ids, table_start, table_start + count))
        meta = self._metadata(ordered, slots)
        device = self.device
        extra = {} if features is None else {"features": features}
        if taps is not None:
            extra["taps"] = taps
        hidden = self.model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), meta,
                            self.kv_caches, **extra)
        return hidden, ordered

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], confidence: bool
                ) -> tuple[dict[int, Sampled], dict[int, BaseException]]:
        """One batched call, results by row; if it raises, each row alone from the same generator states,
        so the rows that do not raise get exactly the tokens the batch would have given them."""
        if not rows:
            return {}, {}
        states = [(r.generator, r.generator.get_state()) for r in rows if r.generator is not None]
        try:
            tokens, logprobs, top = self.sampler.sample(logits, rows, confidence)
            return {i: (tokens[i], logprobs[i], top[i] if top else None) for i in range(len(rows))}, {}
        except Exception:
            for generator, state in states:
                generator.set_state(state)
        sampled, failed = {}, {}
        for i, row in enumerate(rows):
            try:
                tokens, logprobs, top = self.sampler.sample(logits[i:i + 1], [row], confidence)
                sampled[i] = (tokens[0], logprobs[0], top[0] if top else None)
            except Exception as exc:
                failed[i] = exc
        return sampled, failed

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
            table_start = span.start - self._skipped(request)
            if count:
                blocks = [slot // bs for slot in self._slots(request.block_ids, table_start, table_start + count)]
                pieces.append(TappedPiece(request, span.start, count, blocks, offset))
            # a block begun by rows not tapped (a decode's) holds no sum: a later prefix-cache hit must not read one
            untapped += [request.block_ids[(table_start + k) // bs] for k in range(count, len(span.token_ids))
                         if (table_start + k) % bs == 0]
            offset += len(span.token_ids)
        self.guard.forget_blocks(untapped)
        return pieces

    def _skipped(self, request: Request) -> int:
        """Positions a KV window freed from the middle of the request's block table."""
        return request.num_skipped_blocks * self.block_size

    def _slots(self, block_ids: list[int], start: int, end: int) -> list[int]:
        """KV-pool slots of positions start..end-1 of a sequence whose block table is `block_ids`."""
        bs = self.block_size
        return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]

    def _metadata(self, spans: list[Span], slots: list[int]) -> AttentionMetadata:
        """Rows spans (first in `spans`) become decode queries, one per token, each seeing its sequence up
        to itself; chunks become prefill spans."""
        device = self.device
        tables = lens = None
        max_len = 0
        row_spans = [s for s in spans if s.as_rows]
        kv_first = any(len(s.token_ids) > 1 for s in row_spans)
        if row_spans:
            width = max(len(s.request.block_ids) for s in row_spans)
            table_rows, context = [], []
            for span in row_spans:
                table = span.request.block_ids + [0] * (width - len(span.request.block_ids))
                end = span.start - self._skipped(span.request)
                for j in range(len(span.token_ids)):
                    table_rows.append(table)
                    context.append(end + j + 1)
            tables = torch.tensor(table_rows, dtype=torch.int32, device=device)
            lens = torch.tensor(context, dtype=torch.int32, device=device)
            max_len = max(context)
        prefills = []
        offset = len(lens) if lens is not None else 0
        for span in spans:
            if span.as_rows:
                continue
            start = span.start - self._skipped(span.request)
            count = len(span.token_ids)
            context_len = start + count
            context_slots = None
            if start > 0:
                context_slots = torch.tensor(self._slots(span.request.block_ids, 0, context_len), device=device)
            prefills.append(PrefillSpan(offset, count, context_len, context_slots))
            offset += count
        return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                                 num_decode_tokens=len(lens) if lens is not None else 0, decode_block_tables=tables,
                                 decode_context_lens=lens, prefills=prefills, block_size=self.block_size,
                                 decode_max_len=max_len, decode_kv_first=kv_first)

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


def _in_row_order(spans: list[Span]) -> list[Span]:
    """Rows spans first (every token a decode query of its own), then chunks: the batch's row order."""
    return [s for s in spans if s.as_rows] + [s for s in spans if not s.as_rows]
