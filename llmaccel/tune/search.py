"""The tuner's search, apart from any server: which configurations to try, at which arrival rates.

A configuration's goodput at the SLO is its best run's goodput as `vllm bench serve --goodput` counts it: the
requests that met every limit, per second of the run, over the runs that met the SLO's percentiles. It cannot
exceed what the server completes, so a short run at an arrival rate the server cannot sustain (its queue
still draining when the run ends) scores no higher than the rate it served. Every run sends the same prompts
at the same (seeded) arrival times, scaled to its rate, so configurations are compared on the same load.
Finding it takes runs at several arrival rates, so the search spends them where they can change the answer:

- Per configuration (`rate_search`): the first one is run with every request at once (the scale), then at
  that rate, climbing 15% a run while it meets the SLO, then bisected between the last rate met and the
  first missed. Every later one is run first just above the best run's arrival rate so far; if it misses the SLO
  there, it cannot win (a server that misses the SLO at a rate misses it at higher ones) and costs one run.
  Only a configuration that passes there climbs and is bisected above it.
- Across configurations (`coordinate_search`): one flag at a time from the defaults, each flag's values with
  the others at the best found so far, then the next flag; a second pass while the first moved anything.
  The goodput surface over these flags is close to unimodal along each axis, which this exploits (vLLM's
  auto_tune walks the full grid instead: 25 servers for 5 x 5 values, against 9 here).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from llmaccel.tune.slo import SLOCheck

VARIANTS = ("default", "float32", "bf16", "int8", "int4")  # "default": the server's own dtype choice


@dataclass(frozen=True)
class Candidate:
    """One server configuration the tuner tries."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    variant: str = "default"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose one of {', '.join(VARIANTS)}")

    def config(self) -> dict[str, object]:
        """The serve flags of this configuration, as a config file holds them."""
        values: dict[str, object] = {"max_num_seqs": self.max_num_seqs,
                                     "max_num_batched_tokens": self.max_num_batched_tokens}
        if self.variant in ("float32", "bf16"):
            values["dtype"] = self.variant
        elif self.variant in ("int8", "int4"):
            values["quantization"] = self.variant
        return values

    def flags(self) -> list[str]:
        return [word for key, value in self.config().items() for word in (f"--{key.replace('_', '-')}", str(value))]

    def __str__(self) -> str:
        text = f"seqs={self.max_num_seqs} tokens={self.max_num_batched_tokens}"
        return text if self.variant == "default" else f"{text} {self.variant}"


@dataclass(frozen=True)
class RatePoint:
    """One load-generator run: the arrival rate asked (inf: all at once), what was completed, the SLO check."""

    rate: float
    throughput: float  # completed requests per second over the run
    check: SLOCheck



@dataclass
class CandidateResult:
    candidate: Candidate
    points: list[RatePoint] = field(default_factory=list)
    pruned: bool = False  # missed the SLO just above the best goodput so far: not searched further

    @property
    def goodput(self) -> float:
        """The highest goodput of a run that met the SLO (0 where none did)."""
        return max((p.check.goodput for p in self.points if p.check.met), default=0.0)

    @property
    def best_point(self) -> RatePoint | None:
        """The run that met the SLO with the highest goodput."""
        return max((p for p in self.points if p.check.met), key=lambda p: p.check.goodput, default=None)

    @property
    def closest(self) -> RatePoint | None:
        """The run that came closest to the SLO (lowest worst value/limit ratio)."""
        return min(self.points, key=lambda p: p.check.worst_ratio, default=None)


@dataclass(frozen=True)
class SearchSpace:
    max_num_seqs: tuple[int, ...] = (16, 32, 64, 128, 256)
    max_num_batched_tokens: tuple[int, ...] = (512, 1024, 2048, 4096)
    variants: tuple[str, ...] = ("default",)

    def axes(self) -> list[tuple[str, tuple]]:
        axes = [("max_num_seqs", self.max_num_seqs), ("max_num_batched_tokens", self.max_num_batched_tokens)]
        return axes + ([("variant", self.variants)] if len(self.variants) > 1 else [])


def rate_search(measure: Callable[[float], RatePoint], beat: float | None, steps: int = 3,
                margin: float = 0.05, climb: float = 1.15, max_climbs: int = 4) -> tuple[list[RatePoint], bool]:
    """Runs at chosen arrival rates for one configuration; returns them and whether it was pruned.

    `beat`: the arrival rate of the best configuration's best run so far (None for the first configuration,
    which is first run with every request at once to find the scale). A run that meets the SLO is followed by
    one `climb` times faster until one misses (paced arrivals can be served above the all-at-once rate), then
    `steps` bisection runs between the last met and the first missed rate. `margin`: how much faster than
    `beat` a configuration must meet the SLO to be searched further."""
    points: list[RatePoint] = []

    def run(rate: float) -> RatePoint:
        points.append(measure(rate))
        return points[-1]

    if beat is None or beat <= 0:
        capacity = run(math.inf)
        if capacity.check.met:
            return points, False
        low, rate = 0.0, capacity.throughput
    else:
        if not run(beat * (1 + margin)).check.met:  # beat may be inf: the best met every request at once
            return points, True
        if math.isinf(beat):
            return points, False
        low, rate = points[-1].rate, points[-1].rate * climb
    high = None
    for _ in range(max_climbs + 1):
        if run(rate).check.met:
            low, rate = rate, rate * climb
        else:
            high = rate
            break
    if high is None:  # met at every rate tried: the last one is the goodput found
        return points, False
    for _ in range(steps):
        point = run((low + high) / 2)
        if point.check.met:
            low = point.rate
        else:
            high = point.rate
    return points, False


def coordinate_search(space: SearchSpace, start: Candidate,
                      run_candidate: Callable[[Candidate, float | None], CandidateResult],
                      passes: int = 2, on_result: Callable[[CandidateResult], None] | None = None,
                      ) -> list[CandidateResult]:
    """Every configuration tried, in order; the first is `start` (the defaults)."""
    tried: dict[Candidate, CandidateResult] = {}

    def evaluate(candidate: Candidate) -> CandidateResult:
        if candidate not in tried:
            best = max(tried.values(), key=lambda r: r.goodput, default=None)
            beat = best.best_point.rate if best is not None and best.best_point is not None else None
            tried[candidate] = run_candidate(candidate, beat)
            if on_result is not None:
                on_result(tried[candidate])
        return tried[candidate]

    current = start
    evaluate(current)
    for _ in range(passes):
        moved = False
        for name, values in space.axes():
            for value in values:
                evaluate(replace(current, **{name: value}))
            best = max(tried.values(), key=lambda r: r.goodput)  # ties: the earliest (the defaults first)
            if best.goodput > tried[current].goodput:
                current, moved = best.candidate, True
        if not moved:
            break
    return list(tried.values())


def best_result(results: list[CandidateResult]) -> CandidateResult | None:
    """The configuration with the highest goodput, None where no run met the SLO."""
    best = max(results, key=lambda r: r.goodput, default=None)
    return best if best is not None and best.goodput > 0 else None


def count_runs(results: list[CandidateResult]) -> int:
    return sum(len(r.points) for r in results)
