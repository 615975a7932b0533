"""An EAGLE-style draft head in the engine (trained by `llmaccel distill-head`, distill/head_model.py).

The head is one decoder layer of the target's shape over the paged KV cache. At position p it reads
fc(cat(embed(x_p), f_{p-1})), where f is the target's final normed hidden state, and predicts f_p;
the target's LM head (or its rows for the draft vocabulary) names the draft. The first draft pass
catches the head up on the tokens committed since it last drafted, each read with the target's own
feature at the position before it (the verification pass computed them); later passes read the
head's own prediction. Its KV pool is laid out like the target's, as a draft model's is
(spec/drafters.py), and only positions read with the target's features are kept: drafted positions
are computed again, with true features, once the target has kept them.

The target's features reach the drafter through `observe` after each step. Positions whose features
never came (a cached prefix, a stretch beyond `MAX_PENDING` while drafting was off) are read as zeros:
that costs acceptance, never output.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from llmaccel.batch_layout import Span
from llmaccel.engine.scheduler import ScheduledRequest
from llmaccel.model.causal_lm import CausalLM, WeightLoader
from llmaccel.model.layers import Linear, RMSNorm
from llmaccel.model.llama import decoder_layer
from llmaccel.ops.attention import AttentionMetadata
from llmaccel.runner import ModelRunner
from llmaccel.spec.draft_vocab import DraftVocabulary
from llmaccel.spec.drafters import MAX_ROWS_SPAN, last_row_drafts
from llmaccel.spec.head_dir import read_head_section

MAX_PENDING = 4096  # target features kept a request while it does not draft (positions)


class DraftHead(nn.Module):
    """The head's layer and norm; the target's embedding, RoPE tables, attention and LM head."""

    def __init__(self, directory: Path, target: CausalLM, dtype: torch.dtype, device: torch.device) -> None:
        from safetensors.torch import load_file

        super().__init__()
        directory = Path(directory).expanduser()
        self.section = read_head_section(directory)
        self.spec = replace(target.spec, num_layers=1, sliding_window=None, sliding_layers=())
        take = WeightLoader(load_file(str(directory / "model.safetensors")), dtype, device)
        hidden = target.spec.hidden_size
        fc = take("fc.weight")
        if tuple(fc.shape) != (hidden, 2 * hidden):
            raise ValueError(f"the draft head {directory} was trained for a model {fc.shape[0]} wide, not this "
                             f"model's {hidden}: train one for it with `llmaccel distill-head --model ...`")
        self.fc = Linear(fc)
        self.layers = nn.ModuleList([decoder_layer(self.spec, 0, take)])
        self.norm = RMSNorm(hidden, self.spec.rms_norm_eps)
        self.norm.weight.data = take("model.norm.weight")
        self.embedding, self.lm_head = target.embedding, target.lm_head
        self.rotary, self.attention = target.rotary, target.attention
        self.compute_logits = target.compute_logits
        self.dtype = dtype
        layer, source = self.layers[0], target.layers[0]
        pairs = [(layer.qkv, source.qkv), (layer.o, source.o), (layer.mlp.gate_up, source.mlp.gate_up),
                 (layer.mlp.down, source.mlp.down), (self.fc, source.o)]
        for module, like in pairs:  # the target's tuned kernels, where its projections are plain bf16
            if module.is_bf16 and isinstance(like, Linear) and like.is_bf16:
                module.set_bf16_choice(like.bf16_choice)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], features: torch.Tensor) -> torch.Tensor:
        """features: [rows, hidden], the feature each row reads (the target's at the position before it,
        or the head's own prediction). Returns the predicted features, [rows, hidden]."""
        embeds = self.embedding.rows(input_ids).to(self.dtype)
        hidden = self.fc(torch.cat([embeds, features.to(self.dtype)], dim=-1))
        hidden, residual = self.layers[0](hidden, None, positions, self.rotary, self.attention, kv_caches[0], meta)
        return self.norm.add_forward(hidden, residual)[0]


class PendingFeatures:
    """A request's target features from `start` on, as the steps delivered them: a list of chunks joined
    only when the head reads them (joining at every step copied the whole stretch each time: 3% of a
    64-request batch that did not draft)."""

    def __init__(self, start: int) -> None:
        self.start, self.end = start, start
        self.chunks: list[torch.Tensor] = []

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Rows from position `start` (start..end): rows kept from `start` on are replaced."""
        while self.chunks and self.end - len(self.chunks[-1]) >= start:
            self.end -= len(self.chunks.pop())
        if self.end > start:
            self.chunks[-1] = self.chunks[-1][:len(self.chunks[-1]) - (self.end - start)]
            self.end = start
        self.chunks.append(rows)
        self.end += len(rows)
        while self.chunks and self.end - self.start - len(self.chunks[0]) >= MAX_PENDING:
            self.start += len(self.chunks.pop(0))

    def rows(self) -> torch.Tensor:
        if len(self.chunks) != 1:
            self.chunks = [torch.cat(self.chunks)] if self.chunks else [torch.empty(0)]
        return self.chunks[0]


class HeadDrafter:
    """Drafts with a DraftHead: K passes a step, the first one the catch-up."""

    def __init__(self, runner: ModelRunner, vocabulary: DraftVocabulary | None = None) -> None:
        self.runner = runner
        self.vocabulary = vocabulary
        self.hidden_size = runner.model.spec.hidden_size
        self._computed: dict[str, int] = {}  # request id -> positions whose head KV read the target's features
        self._features: dict[str, PendingFeatures] = {}  # request id -> the target's features not yet read
        self.steady = True
        self.wants_features = True

    def observe(self, features: dict[str, tuple[int, torch.Tensor]]) -> None:
        """The target's features of a step: request id -> (first position, [rows, hidden]), rows at
        consecutive positions; those past what the target kept are replaced by the next step's."""
        for request_id, (start, rows) in features.items():
            kept = self._features.get(request_id)
            if kept is None or not kept.start <= start <= kept.end:
                kept = self._features[request_id] = PendingFeatures(start)
            kept.add(start, rows)

    def _inputs(self, request_id: str, first: int, count: int) -> torch.Tensor:
        """The target's features at positions first..first + count - 1, zeros where none came."""
        out = torch.zeros(count, self.hidden_size, dtype=self.runner.model.dtype, device=self.runner.device)
        kept = self._features.get(request_id)
        if kept is not None:
            start, rows = kept.start, kept.rows()
            lo, hi = max(first, start), min(first + count, start + len(rows))
            if lo < hi:
                out[lo - first:hi - first] = rows[lo - start:hi - start]
        return out

    def propose(self, items: list[ScheduledRequest]) -> dict[str, list[int]]:
        if not items:
            return {}
        spans, inputs = [], []
        for item in sorted(items, key=lambda i: i.request.num_tokens - self._start(i.request) > MAX_ROWS_SPAN):
            request = item.request
            start = self._start(request)
            tokens = request.all_token_ids[start:]
            spans.append(Span(request, start, tokens, as_rows=len(tokens) <= MAX_ROWS_SPAN))
            inputs.append(self._inputs(request.request_id, start - 1, len(tokens)))
        wanted = {item.request.request_id: item.num_draft_slots for item in items}
        self.steady = all(len(s.token_ids) <= wanted[s.request.request_id] + 1 for s in spans)
        drafts: dict[str, list[int]] = {rid: [] for rid in wanted}
        features = torch.cat(inputs)
        for _ in range(max(wanted.values())):
            predicted, tokens = self._next(spans, features)
            for span, token in zip(spans, tokens, strict=True):
                drafts[span.request.request_id].append(token)
            going = [i for i, s in enumerate(spans) if len(drafts[s.request.request_id]) < wanted[s.request.request_id]]
            spans = [Span(spans[i].request, spans[i].start + len(spans[i].token_ids),
                          [drafts[spans[i].request.request_id][-1]], as_rows=True) for i in going]
            if not spans:
                break
            features = predicted[torch.tensor(going, device=predicted.device)]
        for item in items:  # the head's KV read true features up to the last token; drafts are redone
            self._computed[item.request.request_id] = item.request.num_tokens
            self._features.pop(item.request.request_id, None)
        return drafts

    def copy_kv_prefix(self, source: int, target: int, num_tokens: int) -> None:
        self.runner.copy_kv_prefix(source, target, num_tokens)

    @property
    def kv_slab(self) -> torch.Tensor:
        return self.runner.kv_slab

    def _start(self, request) -> int:
        known = self._computed.get(request.request_id)
        if known is None:  # first draft since admission: the prefix cache's blocks hold head KV too
            known = request.num_cached_tokens if request.num_preemptions == 0 else 0
        return min(known, request.num_tokens - 1)

    @torch.inference_mode()
    def _next(self, spans: list[Span], features: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
        """Run the spans (rows spans first, as forward_spans orders them); each one's predicted feature at
        its last token, [spans, hidden], and the draft token there."""
        hidden, ordered = self.runner.forward_spans(spans, features=features)
        assert [s.request.request_id for s in ordered] == [s.request.request_id for s in spans]
        return last_row_drafts(self.runner, self.vocabulary, hidden, ordered)

    def forget(self, request_id: str) -> None:
        self._computed.pop(request_id, None)
        self._features.pop(request_id, None)
