"""GuardStage: the semantic input guard inside the engine. It pools each prompt's hidden states while its
prefill runs and judges the prompt before its first token is sampled (safety/semantic_guard.py).

The features are the mean of the residual stream after the classifier's layers over every prompt token
(and the last token's stream). A chunked prefill adds its rows chunk by chunk. A prompt whose leading
blocks came from the prefix cache was not computed here: each block's row sum is kept beside the KV
pool (`block_sums`, `[num_blocks, features]`, written when the block's rows run), so a cached block
adds the sum it had when it was computed. A cached block only partly computed under the guard (the
model's own earlier reply, decoded without taps, fills the blocks of a multi-turn history) adds
nothing: those tokens are the model's text, not the client's, and the mean is taken over the rest.
Decode steps are never tapped, so decoding keeps its fast path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from enum import StrEnum

import torch

from llmaccel.engine.request import Request
from llmaccel.model.layer_taps import LayerTaps
from llmaccel.safety.semantic_guard import GuardClassifier

logger = logging.getLogger(__name__)


class Verdict(StrEnum):
    PASS = "pass"
    FLAG = "flag"  # over the threshold with the action flag (or count): served
    BLOCK = "block"  # over the threshold with the action block: ended before its first token


@dataclass(frozen=True)
class Judgement:
    verdict: Verdict
    score: float
    threshold: float
    num_pooled: int  # prompt tokens in the mean

    def describe(self) -> str:
        return (f"the semantic guard judged it an injection or jailbreak (score {self.score:.3f} >= threshold "
                f"{self.threshold:.3f})")


@dataclass
class _Pool:
    next_position: int  # the prompt position the next tapped row must be
    total: torch.Tensor  # [features] sum of the pooled rows
    count: int


@dataclass(frozen=True)
class TappedPiece:
    request: Request
    start: int  # first prompt position of these rows
    count: int
    block_ids: list[int]  # the block of each row
    first_row: int  # its first row in the taps


class GuardStage:
    def __init__(self, classifier: GuardClassifier, action: str, threshold: float | None, num_blocks: int,
                 block_size: int, device: torch.device) -> None:
        self.classifier = classifier
        self.action = action
        self.threshold = threshold if threshold is not None else classifier.threshold
        self.block_size = block_size
        width = len(classifier.layers) * classifier.hidden_size
        self.block_sums = torch.zeros(num_blocks, width, dtype=torch.float32, device=device)
        self.block_rows = torch.zeros(num_blocks, dtype=torch.int32, device=device)
        self._pools: dict[str, _Pool] = {}
        self.counts = {verdict.value: 0 for verdict in Verdict}

    def wants(self, request: Request, start: int) -> bool:
        """Whether rows of `request` from `start` on are prompt rows it still has to judge."""
        return request.guard_judgement is None and start < request.num_prompt_tokens

    def taps(self, pieces: list[TappedPiece]) -> LayerTaps | None:
        if not pieces:
            return None
        rows = [piece.first_row + k for piece in pieces for k in range(piece.count)]
        device = self.block_sums.device
        return LayerTaps(self.classifier.layers, rows=torch.tensor(rows, dtype=torch.long, device=device))

    def observe(self, pieces: list[TappedPiece], taps: LayerTaps) -> dict[str, Judgement]:
        """Pool the tapped rows; the judgement of each request whose prompt ended in them."""
        if not pieces:
            return {}
        rows = taps.features()
        judged, offset = {}, 0
        for piece in pieces:
            features = rows[offset:offset + piece.count]
            offset += piece.count
            self._keep_block_sums(piece, features)
            request = piece.request
            pool = self._pools.get(request.request_id)
            if pool is None or pool.next_position != piece.start:  # first rows, or computed again after preemption
                pool = self._pools[request.request_id] = self._from_cache(request, piece.start)
            pool.total += features.sum(0)
            pool.count += piece.count
            pool.next_position = piece.start + piece.count
            if pool.next_position == request.num_prompt_tokens:
                del self._pools[request.request_id]
                judged[request.request_id] = self._judge(pool, features[-1])
                request.guard_judgement = judged[request.request_id]
        return judged

    def forget(self, request_id: str) -> None:
        self._pools.pop(request_id, None)

    def forget_blocks(self, block_ids: list[int]) -> None:
        """These blocks are being written without taps from their first slot: they hold no row sum."""
        if block_ids:
            self.block_rows.index_fill_(0, torch.tensor(block_ids, dtype=torch.long, device=self.block_rows.device), 0)

    def _keep_block_sums(self, piece: TappedPiece, features: torch.Tensor) -> None:
        """Each row's sum into its block; a block's first slot clears what the block held before."""
        device = self.block_sums.device
        blocks = torch.tensor(piece.block_ids, dtype=torch.long, device=device)
        firsts = [b for k, b in enumerate(piece.block_ids) if (piece.start + k) % self.block_size == 0]
        if firsts:
            index = torch.tensor(firsts, dtype=torch.long, device=device)
            self.block_sums.index_fill_(0, index, 0.0)
            self.block_rows.index_fill_(0, index, 0)
        self.block_sums.index_add_(0, blocks, features)
        self.block_rows.index_add_(0, blocks, torch.ones(len(blocks), dtype=torch.int32, device=device))

    def _from_cache(self, request: Request, start: int) -> _Pool:
        """The pool of the prompt's first `start` tokens, read from their blocks (the prefix cache's)."""
        total = torch.zeros(self.block_sums.shape[1], dtype=torch.float32, device=self.block_sums.device)
        if start == 0:
            return _Pool(0, total, 0)
        cached = request.block_ids[:start // self.block_size]
        index = torch.tensor(cached, dtype=torch.long, device=self.block_sums.device)
        full = self.block_rows.index_select(0, index) == self.block_size
        total += self.block_sums.index_select(0, index[full]).sum(0)
        return _Pool(start, total, int(full.sum()) * self.block_size)

    def _judge(self, pool: _Pool, last: torch.Tensor) -> Judgement:
        mean = pool.total / max(pool.count, 1)
        score = float(self.classifier.score(self.classifier.features(mean, last)))
        if score < self.threshold:
            verdict = Verdict.PASS
        else:
            verdict = Verdict.BLOCK if self.action == "block" else Verdict.FLAG
        self.counts[verdict.value] += 1
        return Judgement(verdict, score, self.threshold, pool.count)


def build_guard_stage(engine, num_blocks: int) -> GuardStage | None:
    """The stage `engine.config.guard` asks for, its classifier checked against the served model; None
    when it is off, or "default" finds no classifier for this model (logged: the rules run alone)."""
    from llmaccel.safety.semantic_guard import probe_features, resolve_guard

    config, model = engine.config.guard, engine.config.model.model
    if config.semantic_guard is None:
        return None
    path = resolve_guard(config.semantic_guard, model)
    if path is None:
        logger.info("semantic guard: none trained for %s; the input filter's rules run alone (train one: "
                    "llmaccel safety train-guard --model %s)", model, model)
        return None
    classifier = GuardClassifier.load(path)
    spec = engine.spec
    classifier.check_model(path, model, spec.architecture, spec.hidden_size, spec.num_layers)
    probe = probe_features(engine.scorer, engine.tokenizer, classifier.layers, classifier.pooling)
    cosine = classifier.check_probe(path, model, probe)
    stage = GuardStage(classifier, config.semantic_guard_action, config.semantic_guard_threshold,
                       num_blocks, engine.config.cache.block_size, engine.device)
    logger.info("semantic guard: %s (layers %s, %s pooling, probe cosine %.4f), action %s at threshold %.3f",
                path, ",".join(map(str, classifier.layers)), classifier.pooling, cosine,
                config.semantic_guard_action, stage.threshold)
    return stage
