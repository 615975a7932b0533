"""The verification rule: which drafted tokens the target keeps, so its output is its own.

The target scores the last token and the K drafts in one pass (K + 1 rows). Drafts here are
deterministic proposals (a draft model's argmax, or copied n-grams), so the rule is the standard
rejection sampling (Leviathan et al. 2023; Chen et al. 2023) with a point-mass draft distribution:
- greedy rows keep drafts while each equals the target's argmax, then add the target's own token;
- sampled rows keep draft d at row j with probability p_j(d); at the first rejection they draw from
  p_j with d removed (renormalised); when all K are kept, the last row's draw is the bonus token.
Either way each output token is distributed exactly as the target alone would sample it: for a
point mass at d, P(x) = p(d)[x = d] + (1 - p(d)) p(x)[x != d] / (1 - p(d)) = p(x).
"""

from __future__ import annotations

import torch

from llmaccel.sampler import draw_reference


def accepted_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """The target's argmax tokens (K + 1 rows) kept: up to and including the first that differs from
    its draft, or all K + 1 when every draft matched."""
    kept = 0
    while kept < len(drafts) and drafts[kept] == targets[kept]:
        kept += 1
    return targets[:kept + 1]


def accepted_sampled(probs: torch.Tensor, drafts: list[int], bonus: int,
                     generator: torch.Generator | None) -> list[int]:
    """probs: [K + 1, V], the target's sampling distribution at each row (penalties, temperature and
    truncation applied, as the sampler draws from it); `bonus`: a token already drawn from the last row.
    Returns the kept drafts and one token more."""
    out, device = [], generator.device if generator is not None else None
    for j, draft in enumerate(drafts):
        p = probs[j]
        u = torch.rand((), dtype=torch.float64, generator=generator, device=device).item()
        if u < float(p[draft]) / float(p.sum()):
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0
        if float(residual.sum()) <= 0:  # unreachable when u < 1, kept as a guard against rounding
            out.append(draft)
            continue
        v = torch.rand(1, dtype=torch.float64, generator=generator, device=device)
        token, _ = draw_reference(residual[None], v)
        out.append(int(token[0]))
        return out
    out.append(bonus)
    return out
