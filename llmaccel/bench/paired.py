"""Arms measured in rounds, the order rotated each round, each against a base arm: the ratio of medians,
the median of each round's own ratio, and a seeded bootstrap 95% interval of that median. A null arm
(the base measured again) shows what noise alone gives on the machine."""

from __future__ import annotations

import random
import statistics


def rotated(arms: tuple[str, ...], round_index: int) -> tuple[str, ...]:
    """The arms in this round's order: each round starts one further, so no arm always follows another."""
    shift = round_index % len(arms)
    return arms[shift:] + arms[:shift]


def paired_summary(runs: dict[str, list[float]], base: str, resamples: int = 5000) -> dict[str, dict]:
    """Every arm but `base` against it (the same runs give the same figures: the bootstrap is seeded)."""
    rng = random.Random(0)
    reference = runs[base]
    out = {}
    for arm, values in runs.items():
        if arm == base:
            continue
        ratios = [a / b for a, b in zip(values, reference, strict=True)]
        boots = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples))
        out[arm] = {"ratio": statistics.median(values) / statistics.median(reference),
                    "paired": statistics.median(ratios),
                    "ci95": [boots[int(0.025 * resamples)], boots[int(0.975 * resamples) - 1]],
                    "per_round": [min(ratios), max(ratios)]}
    return out


def markdown_table(runs: dict[str, list[float]], summary: dict[str, dict], base: str, what: str) -> str:
    lines = [f"| arm | {what} (median) | against {base} | paired by round [95% CI] | runs |", "|---|---|---|---|---|"]
    for arm, values in runs.items():
        row = summary.get(arm)
        against = " | " if row is None else (f"{row['ratio']:.3f}x | {row['paired']:.3f}x "
                                             f"[{row['ci95'][0]:.3f}, {row['ci95'][1]:.3f}]")
        shown = ", ".join(f"{v:.0f}" for v in values)
        lines.append(f"| {arm} | {statistics.median(values):.1f} | {against} | {shown} |")
    return "\n".join(lines)
