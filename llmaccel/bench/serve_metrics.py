"""The serving benchmark's numbers, defined as vLLM's `bench serve` defines them.

TTFT: request sent -> first non-empty content chunk. E2EL: request sent -> last chunk. ITL: gaps
between successive content chunks. TPOT per request: (E2EL - TTFT) / (output tokens - 1), for
requests with more than one token. Goodput: requests per second that met every SLO given.
Latencies are reported in milliseconds, throughputs per second of the whole run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

SLO_METRICS = ("ttft", "tpot", "e2el")
LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0  # seconds
    latency: float = 0.0  # seconds, end to end
    itl: list[float] = field(default_factory=list)  # seconds
    start_time: float = 0.0
    error: str = ""
    generated_text: str = ""
    cached_tokens: int = 0  # prompt tokens the server found in its prefix cache (usage.prompt_tokens_details)

    @property
    def tpot(self) -> float | None:
        return (self.latency - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or []:
        name, sep, value = item.partition(":")
        if not sep or name not in SLO_METRICS:
            raise ValueError(f"--goodput {item!r}: write NAME:MILLISECONDS with NAME one of {', '.join(SLO_METRICS)}")
        try:
            slos[name] = float(value)
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if slos[name] <= 0:
            raise ValueError(f"--goodput {item!r}: the limit must be positive")
    return slos


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"--percentiles {text!r}: write numbers such as 50,90,99") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"--percentiles {text!r}: each must be in (0, 100]")
    return values


def meets_slos(result: RequestResult, slos: dict[str, float]) -> bool:
    values_ms = {"ttft": result.ttft * 1000, "tpot": (result.tpot or 0.0) * 1000, "e2el": result.latency * 1000}
    return all(values_ms[name] <= limit for name, limit in slos.items())


def compute_metrics(results: list[RequestResult], duration_s: float, percentiles: list[float],
                    slos: dict[str, float] | None = None) -> dict[str, float | int]:
    """Summary figures of one run, JSON-ready."""
    ok = [r for r in results if r.success]
    samples_ms = {
        "ttft": [r.ttft * 1000 for r in ok],
        "tpot": [r.tpot * 1000 for r in ok if r.tpot is not None],
        "itl": [gap * 1000 for r in ok for gap in r.itl],
        "e2el": [r.latency * 1000 for r in ok],
    }
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    out: dict[str, float | int] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (input_tokens + output_tokens) / duration_s,
    }
    if slos:
        out["request_goodput"] = sum(meets_slos(r, slos) for r in ok) / duration_s
    for name in LATENCY_METRICS:
        values = np.asarray(samples_ms[name] or [0.0], dtype=np.float64)
        out[f"mean_{name}_ms"] = float(values.mean())
        out[f"median_{name}_ms"] = float(np.median(values))
        out[f"std_{name}_ms"] = float(values.std())
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(values, p))
    return out


def percentile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank percentile of already sorted values."""
    index = min(len(sorted_values) - 1, max(0, round(q / 100 * len(sorted_values) + 0.5) - 1))
    return sorted_values[index]
