"""When to speculate: a rule measured while serving, not a constant.

A verification costs the target K + 1 rows a request and the drafter its passes. With few requests
decoding, the target's step is bound by reading its weights, so extra rows come almost free; with
many, the step is bound by compute and drafts that are rejected are pure cost. Neither the crossover
nor the acceptance rate is known in advance (they depend on the machine, the draft and the text),
so the policy measures both: per bucket of decoding batch size (1, 2-3, 4-7, ...), the tokens per
second of decode-only steps with and without drafts, and speculates where the measured rate with
drafts is higher (by `min_gain` once several requests decode). A side is measured over at least
`trial_rows` request-steps (8 steps of one request, one of 64): one step of one request says little
when prompt lookup keeps three tokens at one step and the draft none at the next. The chosen side
then follows the machine by moving averages of tokens and seconds a step (their ratio is the rate, a
step of few requests weighing less); a trial of the other side replaces its figures. Each side is
measured first, and the side not chosen is tried again after `explore_every` steps of that bucket, an
interval that doubles each time the trial confirms the choice, so the choice follows changes in the
text or the machine while trials of a losing side stay rare. The choice changes only on fresh figures
of both sides: when the choice's average falls behind the other side's old figures, that side is tried
at once, and a trial that beats the choice is checked against the choice measured again. (Once a
benchmark's batch of 64 drafted at 0.75x for two rounds; a switch on one side's stale figures, e.g. a
slow minute in plain's average, is the way the old rule allowed that.) The interval is also never shorter
than what keeps those trials within `trial_budget` of the bucket's time: a trial step of a side
measured at half the other's rate costs one step more, so at 0.5% a one-step trial comes at most every
200 steps; a draft model that must first catch its KV up over the plain stretch (`record_catch_up`)
adds that step's cost. (At 1% a draft head's trials at 64 cost 2% measured: a trial moves some requests
ahead, and the batch's tail then runs through smaller buckets' own first trials.) `max_batch`, when
given, replaces the measurement by a fixed limit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from llmaccel.engine.request import Request


@dataclass
class SpeculationStats:
    """Drafted and kept tokens since the engine started (each verification of one request is a draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # drafts kept at position 1, 2, ..., K

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verification yields on average: the kept drafts and the target's own one."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def record(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_position) < proposed:
            self.accepted_per_position.extend([0] * (proposed - len(self.accepted_per_position)))
        for position in range(accepted):
            self.accepted_per_position[position] += 1


class SpeculationPolicy:
    def __init__(self, num_speculative_tokens: int, max_model_len: int, max_batch: int | None = None,
                 explore_every: int = 16, max_explore_every: int = 1024, smoothing: float = 0.2,
                 trial_budget: float = 0.005, min_gain: float = 0.2, trial_rows: int = 8) -> None:
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.max_batch = max_batch
        self.explore_every = explore_every
        self.max_explore_every = max_explore_every
        self.smoothing = smoothing
        self.trial_budget = trial_budget
        self.min_gain = min_gain
        self.trial_rows = trial_rows
        self.rates: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> tokens/s of decode-only steps
        # (bucket, speculated) -> (tokens, seconds) a step, moving averages; their ratio is the rate
        self.flows: dict[tuple[int, bool], tuple[float, float]] = {}
        # (bucket, speculated) -> (tokens, seconds, request-steps, steps) of a measurement under way
        self.pending: dict[tuple[int, bool], tuple[int, float, int, int]] = {}
        self.steps: dict[int, int] = {}  # bucket -> decode-only steps recorded since its last exploration
        self.intervals: dict[int, int] = {}  # bucket -> steps between explorations of the side not chosen
        self.choices: dict[int, bool] = {}  # bucket -> the side chosen at its last exploration
        self.catch_up: dict[int, float] = {}  # bucket -> the last catch-up step's cost, in plain steps
        self.last_speculated: dict[int, bool] = {}  # bucket -> whether its last decode-only step had drafts
        self.rechecks: set[int] = set()  # buckets whose trial beat the choice: the choice is measured afresh
        self.stats = SpeculationStats()

    @staticmethod
    def bucket(num_decoding: int) -> int:
        return max(num_decoding, 1).bit_length()

    def speculates(self, num_running: int) -> bool:
        """Whether a step with `num_running` requests running gives them drafts. Plain steps are measured
        first (they cost nothing extra), then steps with drafts; then the faster side is chosen, and the
        other is tried again after `explore_every` steps, an interval that doubles (up to
        `max_explore_every`) each time the trial confirms the choice, or at once when the choice's moving
        average falls behind the other side's figures. A trial that beats the choice is checked against
        the choice measured afresh before the choice changes."""
        if self.max_batch is not None:
            return num_running <= self.max_batch
        bucket = self.bucket(num_running)
        with_drafts, without = self.rates.get((bucket, True)), self.rates.get((bucket, False))
        if without is None:
            return False
        if with_drafts is None:
            return True
        choice = self.choices[bucket]
        if bucket in self.rechecks:
            return choice
        interval = self.intervals.get(bucket, self.explore_every)
        return not choice if self.steps.get(bucket, 0) >= interval else choice

    def draft_slots(self, request: Request, num_running: int) -> int:
        """Drafts for a decoding request this step: K, fewer near its token limit or the context's end."""
        if not self.speculates(num_running):
            return 0
        room = self.max_model_len - request.num_tokens  # positions left for drafts
        if request.max_tokens is not None:
            room = min(room, request.max_tokens - request.num_output_tokens - 1)
        return max(0, min(self.k, room))

    def record_step(self, num_decoding: int, speculated: bool, num_tokens: int, seconds: float,
                    caught_up: bool = False) -> None:
        """A decode-only step's outcome: `num_tokens` generated by `num_decoding` requests in `seconds`.
        `caught_up`: the drafter first caught its KV up over more than the last step's tokens. Right after
        plain steps that is a trial's entry fee (`record_catch_up`), not a rate; after a step with drafts it
        is what speculating keeps costing (requests arriving, or prompt lookup and the draft taking turns)
        and counts as a rate, else a bucket where that recurs every step would never measure its drafts."""
        if seconds <= 0 or num_decoding < 1:
            return
        bucket = self.bucket(num_decoding)
        after_drafts = self.last_speculated.get(bucket, False)
        self.last_speculated[bucket] = speculated
        if speculated and caught_up and not after_drafts:
            self.record_catch_up(num_decoding, seconds)
            return
        key = (bucket, speculated)
        trial = bucket in self.choices and speculated != self.choices[bucket]
        recheck = bucket in self.rechecks and not trial
        if trial or recheck or key not in self.rates:  # measured afresh, over trial_rows
            tokens, spent, rows, steps = self.pending.get(key, (0, 0.0, 0, 0))
            tokens, spent, rows, steps = tokens + num_tokens, spent + seconds, rows + num_decoding, steps + 1
            if rows < self.trial_rows:
                self.pending[key] = (tokens, spent, rows, steps)
                return
            self.pending.pop(key, None)
            # a trial replaces its side's figures: that side was last measured a trial ago, on a machine
            # whose speed has moved since, and stale figures would keep the choice flipping afterwards
            self.flows[key] = (tokens / steps, spent / steps)
        else:  # the chosen side, step by step; a step of few requests weighs less (its rate is noisier)
            weight = self.smoothing * min(1.0, num_decoding / self.trial_rows)
            tokens, spent = self.flows[key]
            self.flows[key] = ((1 - weight) * tokens + weight * num_tokens, (1 - weight) * spent + weight * seconds)
        self.rates[key] = self.flows[key][0] / self.flows[key][1]
        if (bucket, True) not in self.rates or (bucket, False) not in self.rates:
            return
        better = self._drafts_win(bucket)
        if bucket not in self.choices:  # both sides measured: the first choice
            self.steps[bucket] = 0
            self.intervals[bucket] = self._affordable(self.explore_every, bucket)
        elif trial and better != self.choices[bucket]:
            # the trial beat the choice: before switching, measure the choice afresh (its moving average
            # may be a slow minute's)
            self.rechecks.add(bucket)
            return
        elif trial or recheck:  # confirmed (try again later) or, after the recheck, overturned
            self.rechecks.discard(bucket)
            interval = self.intervals.get(bucket, self.explore_every)
            self.intervals[bucket] = self._affordable(2 * interval, bucket) if better == self.choices[bucket] \
                else self.explore_every
            self.steps[bucket] = 0
        else:
            self.steps[bucket] = self.steps.get(bucket, 0) + 1
            if better != self.choices[bucket]:  # the choice's average fell behind the other's old figures:
                self.steps[bucket] = max(self.steps[bucket], self.intervals[bucket])  # try that side now
            return
        self.choices[bucket] = better

    def _drafts_win(self, bucket: int) -> bool:
        """Whether the bucket's measured rate with drafts beats plain decoding's: by `min_gain` once several
        requests decode (the bucket of one request is 1)."""
        margin = 1.0 if bucket == 1 else 1.0 + self.min_gain
        return self.rates[(bucket, True)] >= margin * self.rates[(bucket, False)]

    def record_catch_up(self, num_decoding: int, seconds: float) -> None:
        """A step with drafts after plain ones, whose draft model first caught its KV up: not a rate."""
        without = self.rates.get((self.bucket(num_decoding), False))
        if without is not None and num_decoding >= 1:
            self.catch_up[self.bucket(num_decoding)] = seconds * without / num_decoding

    def _affordable(self, interval: int, bucket: int) -> int:
        """`interval`, lengthened until a trial of the slower side every so many steps costs at most
        `trial_budget` of the time (each of a trial's steps costs faster / slower - 1 steps more, and a
        trial of drafts the draft model's catch-up), and capped."""
        with_drafts, without = self.rates[(bucket, True)], self.rates[(bucket, False)]
        trial_steps = math.ceil(self.trial_rows / 2 ** (bucket - 1))  # the bucket's fewest requests a step
        if self._drafts_win(bucket):  # the trial is of plain steps
            extra = max(0.0, with_drafts / without - 1) * trial_steps
        else:  # of drafts, which first catch up, even where they lose only on the margin
            extra = max(0.0, without / with_drafts - 1) * trial_steps + self.catch_up.get(bucket, 0.0)
        return min(max(interval, math.ceil(extra / self.trial_budget)), self.max_explore_every)
