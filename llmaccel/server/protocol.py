"""OpenAI API request models (pydantic): completions and chat completions.

Requests are validated strictly ("5" is not an integer, 3 is not a temperature, NaN is not a
number) so that a bad field gets a 400 that names it. Every number's range comes from the one table
in llmaccel/bounds.py, which SamplingParams checks too. Unknown fields are ignored with a warning,
as vLLM does, because client libraries send fields of newer API versions. Fields whose meaning
llmaccel cannot honour (suffix, best_of other than n, ...) are rejected rather than silently ignored.
Structured outputs come as OpenAI's `response_format` or as vLLM's `structured_outputs` and older
`guided_*` fields; each is checked here into one StructuredOutputsParams, so its error names its field.
A chat request's messages and tools are in chat_messages.py, the response models in response_models.py.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from llmaccel.bounds import RANGES, SEED_MEANING
from llmaccel.sampling_params import LOGIT_BIAS_LIMIT
from llmaccel.server.chat_messages import _STRICT, ChatMessage, ChatTool, NamedToolChoice
from llmaccel.structured.params import StructuredOutputsParams

_PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"

R = RANGES

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "minItems": 1},
                            _TOKEN_IDS, {"type": "array", "items": _TOKEN_IDS, "minItems": 1}],
                  "description": f"{_PROMPT_SHAPES[0].upper()}{_PROMPT_SHAPES[1:]}; token ids lie in [0, vocab)."}


class StreamOptions(BaseModel):
    model_config = _STRICT
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = _STRICT
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("type 'json_schema' needs json_schema.schema, the JSON schema the output must match")
        return self

    def params(self) -> StructuredOutputsParams | None:
        if self.type == "json_object":
            return StructuredOutputsParams(json_object=True, source="response_format")
        if self.type == "json_schema":
            return StructuredOutputsParams(json=self.json_schema.schema_, source="response_format")
        return None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_CONSTRAINT_FIELDS = ("response_format", "structured_outputs", *_GUIDED)


class _Request(BaseModel):
    model_config = _STRICT

    model: str | None = None  # None: the served model
    # Fields with a default take null as "the default", as OpenAI's API does (its clients send nulls);
    # a completion's null max_tokens means "up to the context window", as in vLLM.
    temperature: float | None = R["temperature"].field(1.0)
    top_p: float | None = R["top_p"].field(1.0)
    n: int | None = R["n"].field(1)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, description=SEED_MEANING)
    presence_penalty: float | None = R["presence_penalty"].field(0.0)
    frequency_penalty: float | None = R["frequency_penalty"].field(0.0)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = Field(
        None, description="Token id (as a string) -> a number in [-100, 100] added to its logit before sampling; "
                          "-100 bans the token, 100 all but forces it. Ids lie in [0, vocab).")
    # vLLM-style extras (the openai client sends them through extra_body)
    top_k: int | None = R["top_k"].field(0)
    min_p: float | None = R["min_p"].field(0.0)
    repetition_penalty: float | None = R["repetition_penalty"].field(1.0)
    ignore_eos: bool | None = False
    min_tokens: int | None = R["min_tokens"].field(0)
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, description="Token ids in [0, vocab).")
    skip_special_tokens: bool | None = True
    prompt_logprobs: int | None = R["prompt_logprobs"].field(None)
    priority: int | None = Field(0, ge=-(2**31), lt=2**31, description="With --scheduling-policy priority: lower "
                                                                      "values are served first (vLLM's).")
    # llmaccel: false keeps this request out of the result cache (neither answered from it nor stored)
    result_cache: bool | None = True
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM's: exactly one of json (a JSON schema), json_object (true), regex, choice (a list "
                          "of strings) or grammar (Lark, or llama.cpp's GBNF).")
    guided_json: dict[str, Any] | str | None = Field(None, description="A JSON schema the output must match.")
    guided_regex: str | None = Field(None, description="A regular expression the output must match.")
    guided_choice: list[str] | None = Field(None, description="The output is exactly one of these strings.")
    guided_grammar: str | None = Field(None, description="A Lark or GBNF grammar the output must match.")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        if isinstance(data, dict):
            defaults = _defaults(cls)
            nulls = [name for name, value in data.items() if value is None and name in defaults]
            if nulls:
                data = {**data, **{name: defaults[name] for name in nulls}}
        return data

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value: str | list[str] | None) -> list[str]:
        stops = [value] if isinstance(value, str) else list(value or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, value: dict[str, float] | None) -> dict[int, float]:
        """OpenAI's JSON keys are token ids written as strings: "50256", not "a" or "-1"."""
        bias = {}
        for key, number in (value or {}).items():
            if not key.isascii() or not key.isdigit():
                raise ValueError(f"keys must be token ids written as strings (e.g. \"50256\"), got {key!r}")
            if not -LOGIT_BIAS_LIMIT <= number <= LOGIT_BIAS_LIMIT:
                raise ValueError(f"the bias of token {key} must be in [-100, 100], got {number!r}")
            bias[int(key)] = number
        return bias

    @field_validator("response_format", "structured_outputs", *_GUIDED)
    @classmethod
    def _constraint(cls, value: Any, info) -> Any:
        """Checked into StructuredOutputsParams now, so that a bad one's error names its field."""
        if value is not None:
            try:
                _constraint_of(info.field_name, value)
            except ValueError as exc:  # the 400 names the field already
                raise ValueError(str(exc).removeprefix(f"{info.field_name}: ")) from None
        return value

    @functools.cached_property
    def output_constraint(self) -> StructuredOutputsParams | None:
        """The one constraint on this request's output (`_one_constraint` allows no second), or None."""
        for name in _CONSTRAINT_FIELDS:
            value = getattr(self, name)
            if value is not None and (constraint := _constraint_of(name, value)) is not None:
                return constraint
        return None

    @model_validator(mode="after")
    def _one_constraint(self) -> _Request:
        given = [name for name in _CONSTRAINT_FIELDS if getattr(self, name) is not None
                 and not (name == "response_format" and self.response_format.type == "text")]
        if len(given) > 1:
            raise ValueError(f"give at most one output constraint; got {', '.join(given)}")
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _Request:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    @property
    def unknown_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def _constraint_of(name: str, value: Any) -> StructuredOutputsParams | None:
    if name == "response_format":
        return value.params()
    if name == "structured_outputs":
        if not isinstance(value, dict):
            raise ValueError("must be an object with one of json, json_object, regex, choice or grammar")
        known = {"json", "json_object", "regex", "choice", "grammar"}
        unknown = sorted(set(value) - known - {"disable_any_whitespace", "disable_fallback", "whitespace_pattern"})
        if unknown:
            raise ValueError(f"unknown field(s) {', '.join(unknown)}; give one of {', '.join(sorted(known))}")
        fields = {k: v for k, v in value.items() if k in known and v is not None}
        return StructuredOutputsParams(**fields, source=name)
    return StructuredOutputsParams(**{_GUIDED[name]: value}, source=name)


@functools.cache
def _defaults(model: type[BaseModel]) -> dict[str, Any]:
    """The fields of a request model whose null means their default (a null max_tokens: the window)."""
    return {name: f.default for name, f in model.model_fields.items() if f.default is not None and name != "max_tokens"}



class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = R["max_tokens"].field(None)
    max_completion_tokens: int | None = R["max_completion_tokens"].field(None)
    logprobs: bool | None = False
    top_logprobs: int | None = R["top_logprobs"].field(None)
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = True

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        for message in self.messages:
            message.text()
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: Annotated[Any, WithJsonSchema(_PROMPT_SCHEMA)]
    max_tokens: int | None = R["max_tokens"].field(16)
    logprobs: int | None = R["logprobs"].field(None)
    echo: bool | None = Field(False, description="Start each choice's text (and, with logprobs, its logprobs) "
                                                 "with the prompt.")
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt_shape(cls, value: Any) -> list[str] | list[list[int]]:
        """Normalise to a list of prompts: strings or token-id lists."""
        def is_ids(v: Any) -> bool:
            return isinstance(v, list) and bool(v) and all(isinstance(t, int) and not isinstance(t, bool) for t in v)

        if isinstance(value, str):
            return [value]
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return list(value)
            if is_ids(value):
                return [list(value)]
            if all(is_ids(p) for p in value):
                return [list(p) for p in value]
        raise ValueError(f"must be {_PROMPT_SHAPES} (non-empty)")

    @field_validator("suffix")
    @classmethod
    def _not_supported(cls, value: object, info) -> object:
        if value:
            raise ValueError(f"{info.field_name} is not supported by this server")
        return value

    @model_validator(mode="after")
    def _completion_checks(self) -> CompletionRequest:
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

