"""Service-level objectives: "ttft_p99<=1s,tpot_p99<=100ms" parsed, and checked against a bench serve run.

An objective bounds a percentile of one latency over a run's requests (TTFT, TPOT, ITL or end-to-end
latency, as bench serve defines them; p50..p100 or the mean). A run meets the SLO when every objective
holds. Goodput is then counted as `vllm bench serve --goodput` counts it: the requests per second that met
every limit themselves.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import numpy as np

METRICS = ("ttft", "tpot", "itl", "e2el")
_UNITS_MS = {"ms": 1.0, "s": 1000.0, "us": 0.001}
_TERM = re.compile(r"^(?P<metric>[a-z0-9]+)_(?P<stat>p\d+(?:\.\d+)?|mean)\s*<=\s*(?P<value>[0-9.eE+-]+)\s*"
                   r"(?P<unit>ms|s|us)?$")


@dataclass(frozen=True)
class Objective:
    metric: str  # one of METRICS
    stat: str  # "p99", "p50", ..., or "mean"
    limit_ms: float

    def __str__(self) -> str:
        return f"{self.metric}_{self.stat}<={self.limit_ms:g}ms"


@dataclass(frozen=True)
class SLOCheck:
    """One run against the SLO: each objective's measured value, and the worst value/limit ratio (how close
    it came: <= 1 met)."""

    met: bool
    values_ms: dict[str, float]
    worst_ratio: float
    goodput: float  # requests per second that met every limit (vLLM's definition)


def parse_slo(text: str) -> tuple[Objective, ...]:
    """"ttft_p99<=1s,tpot_p99<=100ms" -> the objectives; a ValueError that names the bad term otherwise.

    A limit without a unit is in milliseconds (as `bench serve --goodput` reads them)."""
    terms = [t.strip() for t in str(text).split(",") if t.strip()]
    if not terms:
        raise ValueError("--slo is empty: write e.g. \"ttft_p99<=1s,tpot_p99<=100ms\"")
    objectives: list[Objective] = []
    for term in terms:
        match = _TERM.match(term.replace(" ", ""))
        if match is None:
            raise ValueError(f"--slo term {term!r}: write METRIC_STAT<=LIMIT, e.g. ttft_p99<=1s "
                             f"(METRIC one of {', '.join(METRICS)}; STAT p50..p100 or mean; LIMIT in s, ms or us)")
        metric, stat = match["metric"], match["stat"]
        if metric not in METRICS:
            raise ValueError(f"--slo term {term!r}: unknown metric {metric!r}; choose one of {', '.join(METRICS)}")
        if stat != "mean" and not 0 < float(stat[1:]) <= 100:
            raise ValueError(f"--slo term {term!r}: the percentile must be in (0, 100]")
        try:
            limit = float(match["value"]) * _UNITS_MS[match["unit"] or "ms"]
        except ValueError:
            raise ValueError(f"--slo term {term!r}: {match['value']!r} is not a number") from None
        if not math.isfinite(limit) or limit <= 0:
            raise ValueError(f"--slo term {term!r}: the limit must be a positive number")
        if any(o.metric == metric and o.stat == stat for o in objectives):
            raise ValueError(f"--slo names {metric}_{stat} twice")
        objectives.append(Objective(metric, stat, limit))
    return tuple(objectives)


def request_values_ms(result: dict) -> dict[str, list[float]]:
    """Per-request samples of each metric from a bench serve result (successful requests only)."""
    ok = [i for i, error in enumerate(result["errors"]) if not error]
    tpot = [(result["e2els"][i] - result["ttfts"][i]) / (result["output_lens"][i] - 1) * 1000
            for i in ok if result["output_lens"][i] > 1]
    return {"ttft": [result["ttfts"][i] * 1000 for i in ok], "tpot": tpot,
            "itl": [gap * 1000 for i in ok for gap in result["itls"][i]],
            "e2el": [result["e2els"][i] * 1000 for i in ok]}


def check(result: dict, objectives: tuple[Objective, ...]) -> SLOCheck:
    """Whether a bench serve run met the SLO. A failed request counts against it: any failure fails the run."""
    samples = request_values_ms(result)
    values: dict[str, float] = {}
    worst = 0.0
    for objective in objectives:
        data = np.asarray(samples[objective.metric] or [math.inf], dtype=np.float64)
        value = float(data.mean() if objective.stat == "mean" else np.percentile(data, float(objective.stat[1:])))
        values[f"{objective.metric}_{objective.stat}"] = value
        worst = max(worst, value / objective.limit_ms)
    failed = sum(1 for error in result["errors"] if error)
    met_each = _requests_meeting_limits(result, objectives)
    return SLOCheck(met=worst <= 1.0 and failed == 0, values_ms=values, worst_ratio=worst,
                    goodput=met_each / result["duration_s"])


def _requests_meeting_limits(result: dict, objectives: tuple[Objective, ...]) -> int:
    """Requests whose own TTFT, TPOT, ITLs and latency are within every objective's limit."""
    count = 0
    for i, error in enumerate(result["errors"]):
        if error:
            continue
        n = result["output_lens"][i]
        own = {"ttft": [result["ttfts"][i]], "e2el": [result["e2els"][i]], "itl": result["itls"][i],
               "tpot": [(result["e2els"][i] - result["ttfts"][i]) / (n - 1)] if n > 1 else []}
        if all(v * 1000 <= o.limit_ms for o in objectives for v in own[o.metric]):
            count += 1
    return count
