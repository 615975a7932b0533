"""The range of every number a client can send, in one table.

`SamplingParams` checks its fields against these ranges, the server's pydantic models take their
constraints (and so the OpenAPI document its minimum and maximum) from them, and the server's 400
names the same range. A range may be narrower at the HTTP edge than in the Python API: OpenAI caps
temperature at 2 and n at 128, while the output guard's retries sample hotter than that and an
offline batch may ask for up to 1,024 samples of a prompt.

Values that a range cannot express are normalized, not refused, as OpenAI and vLLM do: any integer
is a seed (reduced to the 64 bits a generator takes) and a `top_k` at or above the vocabulary means
no limit. Token ids must lie in `[0, vocab)`, and the error names the index and the value.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from pydantic import Field

from llmaccel.errors import InvalidRequestError

SEED_MODULUS = 1 << 64  # torch.Generator.manual_seed takes [-2**63, 2**64): any integer maps into [0, 2**64)


@dataclass(frozen=True)
class Range:
    """`kind` values from `low` to `high` (None: unbounded), each end closed unless `*_open`."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    api_high: float | None = None  # a narrower upper end at the HTTP edge
    meaning: str = ""  # what values mean, for the API docs

    def at_api(self) -> Range:
        if self.api_high is None:
            return self
        return Range(self.kind, self.low, self.api_high, self.low_open, False, None, self.meaning)

    @property
    def text(self) -> str:
        """'in [0, 2]', 'in (0, 1]', '>= 1', '> 0'."""
        if self.low is not None and self.high is not None:
            return (f"in {'(' if self.low_open else '['}{_number(self.low)}, {_number(self.high)}"
                    f"{')' if self.high_open else ']'}")
        if self.low is not None:
            return f"{'>' if self.low_open else '>='} {_number(self.low)}"
        if self.high is not None:
            return f"{'<' if self.high_open else '<='} {_number(self.high)}"
        return "any " + ("integer" if self.kind is int else "finite number")

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def check(self, name: str, value: float) -> None:
        """Raise ValueError naming `name` and this range unless `value` lies in it."""
        if not self.contains(value):
            raise ValueError(f"{name} must be {self.text}, got {value!r}")

    def field(self, default: object) -> object:
        """A pydantic Field with this range, as the HTTP edge takes it, as its constraints (and so in the
        JSON schema)."""
        r = self.at_api()
        limits = {("gt" if r.low_open else "ge"): r.low} if r.low is not None else {}
        if r.high is not None:
            limits["lt" if r.high_open else "le"] = r.high
        return Field(default, description=f"Must be {r.text}. {self.meaning}".strip(), **limits)


# Every number of a completion or chat request. The server's models and SamplingParams read this table.
RANGES: dict[str, Range] = {
    "n": Range(int, 1, 1024, api_high=128, meaning="Choices to generate for each prompt."),
    "temperature": Range(float, 0, None, api_high=2, meaning="0 is greedy."),
    "top_p": Range(float, 0, 1, low_open=True),
    "top_k": Range(int, -1, None, meaning="0 or -1: no limit; at or above the vocabulary size: no limit."),
    "min_p": Range(float, 0, 1),
    "presence_penalty": Range(float, -2, 2),
    "frequency_penalty": Range(float, -2, 2),
    "repetition_penalty": Range(float, 0, None, low_open=True, api_high=10, meaning="1: none."),
    "max_tokens": Range(int, 1, None, meaning="Capped by the context window."),
    "max_completion_tokens": Range(int, 1, None, meaning="Capped by the context window."),
    "min_tokens": Range(int, 0, None, meaning="At most max_tokens."),
    "logprobs": Range(int, 0, 20),
    "top_logprobs": Range(int, 0, 20),
    "prompt_logprobs": Range(int, 0, 20, meaning="Logprobs of each prompt token and the top N there."),
}

SEED_MEANING = "Any integer; reduced modulo 2**64."


def reduce_seed(seed: int) -> int:
    """Any integer as a seed a torch.Generator takes."""
    return seed % SEED_MODULUS


def check_token_ids(token_ids: Iterable[int], vocab_size: int, where: str, param: str | None = None) -> None:
    """Raise InvalidRequestError naming the first id outside [0, vocab_size), with its index."""
    for index, token in enumerate(token_ids):
        if not 0 <= token < vocab_size:
            raise InvalidRequestError(f"{where}[{index}]: token id {token} is outside the vocabulary "
                                      f"[0, {vocab_size})", param=param)


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)
