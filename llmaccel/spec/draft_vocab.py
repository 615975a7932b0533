"""A draft model's LM head cut to the tokens it is likely to propose.

A draft that shares the default model's 49,152-token head pays 28M of its parameters at every drafted
token: a 4-layer student's head outweighs its layers. The draft only has to name the target's next
token, and a few thousand frequent tokens cover almost all of what a chat model writes, so the draft's
head keeps only those rows (FR-Spec, Zhao et al. 2025, ranks a draft vocabulary by token frequency in a
corpus; EAGLE-3 drafts over 32k of LLaMA-3's 128k tokens). A target token outside the cut is a draft
missed, never a wrong output: the target decides every token.

The ranking comes from `token_counts.json` in the draft's directory (`llmaccel distill` writes the
counts of its training text there), else from the built-in corpora, counted at start.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from llmaccel.model.layers import Linear

logger = logging.getLogger(__name__)

TOKEN_COUNTS_FILE = "token_counts.json"
FALLBACK_CORPORA = ("enwiki", "sanguo")


@dataclass(frozen=True)
class DraftVocabulary:
    token_ids: torch.Tensor  # int64 [N]: the draft head's row i proposes token token_ids[i]
    head: Linear  # the draft's LM head rows for those tokens, in its layout and kernels

    def argmax(self, hidden: torch.Tensor) -> list[int]:
        """The most likely kept token after each row of normed hidden states."""
        return self.token_ids[self.head(hidden).argmax(dim=-1).cpu()].tolist()

    @property
    def weight_bytes(self) -> int:
        return self.head.weight_bytes


def write_token_counts(directory: Path, token_ids: list[torch.Tensor], sources: list[str]) -> Path:
    """Counts of each token in `token_ids` (a corpus each), written where `frequent_tokens` reads them."""
    counts: Counter[int] = Counter()
    for ids in token_ids:
        counts.update(ids.tolist())
    path = Path(directory) / TOKEN_COUNTS_FILE
    path.write_text(json.dumps({"sources": sources, "counts": {str(t): c for t, c in counts.most_common()}}),
                    encoding="utf-8")
    return path


def _counts(model_dir: Path | None, tokenizer) -> Counter[int]:
    path = None if model_dir is None else Path(model_dir) / TOKEN_COUNTS_FILE
    if path is not None and path.is_file():
        data = json.loads(path.read_text(encoding="utf-8"))
        logger.info("draft vocabulary ranked by %s (%s)", path, ", ".join(data.get("sources", [])))
        return Counter({int(t): c for t, c in data["counts"].items()})
    from llmaccel.data.corpora import load_corpus

    logger.info("draft vocabulary ranked by the built-in corpora %s (the draft has no %s)",
                ", ".join(FALLBACK_CORPORA), TOKEN_COUNTS_FILE)
    counts: Counter[int] = Counter()
    for name in FALLBACK_CORPORA:
        counts.update(tokenizer(load_corpus(name), add_special_tokens=False)["input_ids"])
    return counts


def check_draft_vocab_size(size: int, vocab_size: int) -> None:
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--speculative-draft-vocab must be between 1 and the vocabulary's {vocab_size} "
                         f"tokens, got {size}")


def frequent_tokens(model_dir: Path | None, tokenizer, size: int, vocab_size: int) -> torch.Tensor:
    """The `size` most frequent token ids, sorted by id; the tokenizer's special tokens always among them
    (an end-of-sequence the draft cannot propose would cost a verification at every answer's end).
    Fewer than `size` tokens were ever counted: the rest in id order."""
    check_draft_vocab_size(size, vocab_size)
    chosen = [t for t in tokenizer.all_special_ids if 0 <= t < vocab_size][:size]
    seen = set(chosen)
    for token, _ in _counts(model_dir, tokenizer).most_common():
        if len(chosen) == size:
            break
        if 0 <= token < vocab_size and token not in seen:
            chosen.append(token)
            seen.add(token)
    for token in range(vocab_size):
        if len(chosen) == size:
            break
        if token not in seen:
            chosen.append(token)
    return torch.tensor(sorted(chosen), dtype=torch.int64)


def cut_head(lm_head: torch.nn.Module, token_ids: torch.Tensor) -> Linear:
    """A Linear of `lm_head`'s rows for `token_ids`, run by the kernels the full head was given."""
    if not isinstance(lm_head, Linear) or not lm_head.has_rows:
        raise ValueError("--speculative-draft-vocab cuts the draft model's LM head, which must be a plain "
                         f"(not quantized) weight; this draft's head is a {type(lm_head).__name__}")
    rows = lm_head.rows(token_ids.to(device=_device(lm_head)))
    head = Linear(rows.contiguous(), None if lm_head.bias is None else lm_head.bias[token_ids])
    if lm_head.is_bf16:
        head.set_bf16_choice(lm_head.bf16_choice)
    return head


def _device(module: Linear) -> torch.device:
    for tensor in (module.weight, module.vnni, module.compact, module.panels):
        if tensor is not None:
            return tensor.device
    return torch.device("cpu")
