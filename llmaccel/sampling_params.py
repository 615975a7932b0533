"""SamplingParams: how one request samples and when it stops; validated at construction."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields

from llmaccel.bounds import RANGES, reduce_seed
from llmaccel.structured.params import StructuredOutputsParams

# Temperatures below this sample greedily (as vLLM): dividing logits by ~1e-30 overflows to inf.
GREEDY_BELOW = 1e-5
LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]
POOLINGS = ("last", "mean")  # how an embedding request pools its prompt's final hidden states


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) means no top-k
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the context window
    min_tokens: int = 0
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per generated token (0: only the sampled token's)
    # logprobs of each prompt token after the first, with the top N there (vLLM's prompt_logprobs); such a
    # request computes its whole prompt: no prefix-cache hit
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # token id -> a number added to its logit before sampling (OpenAI's logit_bias; the logprobs stay the
    # model's own, as vLLM's raw logprobs); given as a mapping, kept as (id, bias) pairs sorted by id
    logit_bias: tuple[tuple[int, float], ...] = field(default_factory=tuple)
    # the output must match a JSON schema, regex, choice or grammar (vLLM's structured_outputs); a dict
    # of StructuredOutputsParams' fields is taken too
    structured_outputs: StructuredOutputsParams | None = None
    # an embedding request (/v1/embeddings): no token is generated; the prompt's final hidden states are pooled,
    # "last" (the last token's) or "mean" (every token's: no prefix-cache hit), and L2-normalized
    pooling: str | None = None
    # the LoRA adapter to generate with, by the name it was loaded under (lora/); None: the base model
    lora: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, Mapping):
            object.__setattr__(self, "structured_outputs", StructuredOutputsParams(**self.structured_outputs))
        # Accept lists and a bare string from callers, store tuples (hashable, immutable).
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        bias = self.logit_bias.items() if isinstance(self.logit_bias, Mapping) else self.logit_bias
        object.__setattr__(self, "logit_bias", tuple(bias))  # checked, then sorted by id, in _validate
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._validate()
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if self.seed is not None:
            object.__setattr__(self, "seed", reduce_seed(self.seed))

    def _validate(self) -> None:
        for name in _RANGED:  # the same table the server's request models are built from
            value = getattr(self, name)
            if value is not None or name not in _OPTIONAL:
                _check_kind(name, value, RANGES[name].kind)
                RANGES[name].check(name, value)
                if RANGES[name].kind is float:  # an integer such as 2**63 would overflow a torch tensor
                    object.__setattr__(self, name, _finite_float(name, value))
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("every stop string must be a non-empty string")
        for i, token in enumerate(self.stop_token_ids):
            _check_kind(f"stop_token_ids[{i}]", token, int)
            if token < 0:
                raise ValueError(f"stop_token_ids[{i}] must be a token id >= 0, got {token}")
        if self.seed is not None:
            _check_kind("seed", self.seed, int)
        biases = []
        for pair in self.logit_bias:
            if not isinstance(pair, tuple | list) or len(pair) != 2:
                raise ValueError(f"logit_bias must map token ids to numbers, got {pair!r}")
            token, bias = pair
            _check_kind("a logit_bias token id", token, int)
            if token < 0:
                raise ValueError(f"logit_bias: token id {token} must be >= 0")
            _check_kind(f"logit_bias[{token}]", bias, float)
            bias = _finite_float(f"logit_bias[{token}]", bias)
            if not -LOGIT_BIAS_LIMIT <= bias <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"logit_bias[{token}] must be in [-100, 100], got {pair[1]!r}")
            biases.append((token, bias))  # floats: 1 and 1.0 are one bias (and one result-cache key)
        if len({token for token, _ in biases}) != len(biases):
            raise ValueError("logit_bias names a token id twice")
        object.__setattr__(self, "logit_bias", tuple(sorted(biases)))
        if self.pooling is not None and self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.pooling is not None and self.n != 1:
            raise ValueError("an embedding request (pooling) has one result: n must be 1")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams (or a dict of its fields), got "
                             f"{type(self.structured_outputs).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def uses_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


_OPTIONAL = {"max_tokens", "logprobs", "prompt_logprobs"}  # None: up to the context window / no logprobs
_RANGED = [f.name for f in fields(SamplingParams) if f.name in RANGES]


def _finite_float(name: str, value: float) -> float:
    try:
        number = float(value)
    except OverflowError:
        number = math.inf
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return number


def _check_kind(name: str, value: object, kind: type) -> None:
    """Integers for integer fields; finite real numbers for float fields (bools are neither)."""
    ok = isinstance(value, int) if kind is int else isinstance(value, int | float)
    if not ok or isinstance(value, bool):
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}, got {value!r}")
