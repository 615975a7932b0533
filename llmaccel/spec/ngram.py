"""Prompt lookup (n-gram) drafting: no second model.

The context's last n tokens are searched for earlier in the context (prompt and output), the
longest n first (`max_n` down to `min_n`); the tokens that followed the latest earlier match are the
draft. Strong where the answer copies its input: summaries, edits, code, quoted text.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: list[int], num_tokens: int, min_n: int, max_n: int) -> list[int]:
    """Up to `num_tokens` tokens that followed the latest earlier occurrence of the context's longest
    suffix n-gram (min_n <= n <= max_n); [] when no suffix of those lengths occurred before."""
    length = len(token_ids)
    if num_tokens < 1 or length < min_n + 1:
        return []
    context = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        # windows starting at 0 .. length - n - 1: every earlier n-gram, not the suffix itself
        windows = sliding_window_view(context[:-1], n)
        hits = np.flatnonzero((windows == context[-n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return context[start:start + num_tokens].tolist()
    return []
