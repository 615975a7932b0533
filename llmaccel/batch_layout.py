"""How a step's spans of tokens are laid out as one batch: Span (tokens of one sequence to run), the row
order (rows spans first, then chunks), the KV-pool slot of each position, and the attention metadata.

ModelRunner.forward_spans (runner.py) builds its model inputs with these; a drafter builds Spans of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llmaccel.engine.request import Request
from llmaccel.ops.attention import AttentionMetadata, PrefillSpan


@dataclass
class Span:
    """Tokens of one sequence to run at positions start.. (its blocks allocated). `as_rows`: each token is
    a decode query of its own (the decode kernels; successive rows see each other), else one causal chunk.
    `drafted`: the tokens after the first are drafts to verify (every row is sampled), else only the last row of a
    span that reaches its request's last token is."""

    request: Request
    start: int
    token_ids: list[int]
    as_rows: bool = False
    drafted: bool = False


def in_row_order(spans: list[Span]) -> list[Span]:
    """Rows spans first (every token a decode query of its own), then chunks: the batch's row order."""
    return [s for s in spans if s.as_rows] + [s for s in spans if not s.as_rows]


def skipped_positions(request: Request, block_size: int) -> int:
    """Positions a KV window freed from the middle of the request's block table."""
    return request.num_skipped_blocks * block_size


def kv_slots(block_ids: list[int], start: int, end: int, block_size: int) -> list[int]:
    """KV-pool slots of positions start..end-1 of a sequence whose block table is `block_ids`."""
    bs = block_size
    return [block_ids[p // bs] * bs + p % bs for p in range(start, end)]


def attention_metadata(spans: list[Span], slots: list[int], block_size: int, device: torch.device
                       ) -> AttentionMetadata:
    """Rows spans (first in `spans`) become decode queries, one per token, each seeing its sequence up
    to itself; chunks become prefill spans."""
    tables = lens = None
    max_len = 0
    row_spans = [s for s in spans if s.as_rows]
    kv_first = any(len(s.token_ids) > 1 for s in row_spans)
    if row_spans:
        width = max(len(s.request.block_ids) for s in row_spans)
        table_rows, context = [], []
        for span in row_spans:
            table = span.request.block_ids + [0] * (width - len(span.request.block_ids))
            end = span.start - skipped_positions(span.request, block_size)
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
        start = span.start - skipped_positions(span.request, block_size)
        count = len(span.token_ids)
        context_len = start + count
        context_slots = None
        if start > 0:
            context_slots = torch.tensor(kv_slots(span.request.block_ids, 0, context_len, block_size), device=device)
        prefills.append(PrefillSpan(offset, count, context_len, context_slots))
        offset += count
    return AttentionMetadata(slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                             num_decode_tokens=len(lens) if lens is not None else 0, decode_block_tables=tables,
                             decode_context_lens=lens, prefills=prefills, block_size=block_size,
                             decode_max_len=max_len, decode_kv_first=kv_first)
