"""`POST /v1/responses` (OpenAI's Responses API) on the chat path, and the store behind `previous_response_id`.

A Responses request is translated into the chat completion it means: `instructions` a system turn first, the
`input` items (messages, function calls and their outputs) the conversation's turns, flat function `tools`
chat's nested ones, `text.format` a `response_format`, `max_output_tokens` `max_completion_tokens`. That request
then goes through answer.py as /v1/chat/completions does (prompt checks and the input filter, the chat template,
rate limits, the tool-call machinery, the grammar engine, the result cache, the errors), and the answer comes
back in the Responses shapes (responses_output.py). A stored response (`store`, the default) keeps its whole
conversation in a bounded in-memory LRU, so `previous_response_id` continues it; as in OpenAI's API, an earlier
turn's `instructions` are not carried over. What this server cannot honour (built-in tools, image or file
inputs, background, reasoning options) is a 400 that names the field.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, Field, ValidationError

from llmaccel.bounds import RANGES
from llmaccel.server import protocol as p
from llmaccel.server.answer import answer
from llmaccel.server.chat_messages import _STRICT
from llmaccel.server.errors import APIError, validation_error_message
from llmaccel.server.response_models import ErrorResponse
from llmaccel.server.responses_output import Draft, ResponsesView
from llmaccel.server.serving import OpenAIServing, quoted

if TYPE_CHECKING:
    from llmaccel.server.state import ServerState

logger = logging.getLogger(__name__)

MAX_STORED_RESPONSES = 1024
MAX_STORED_CHARS = 64 * 2**20  # of the conversations' JSON: a chain of turns stores each turn's whole history
NOT_FOUND = {404: {"model": ErrorResponse, "description": "No stored response has this id (the path's, or "
                                                         "previous_response_id): never stored, or evicted."}}

# Fields of OpenAI's API this server cannot honour: any value but null, false, 0 or empty is a 400 naming the field.
_UNSUPPORTED = {
    "background": "background responses are not supported; stream instead",
    "conversation": "conversation objects are not supported; continue a conversation with previous_response_id",
    "include": "no extra output data is available",
    "prompt": "stored prompt templates are not supported; give instructions and input",
    "reasoning": "this model has no reasoning options",
    "max_tool_calls": "a limit on tool calls is not supported",
    "top_logprobs": "logprobs are not served on /v1/responses; use /v1/chat/completions",
    "truncation": "only 'disabled' is served: a conversation over the context window is a 400",
}
# Hints with no effect here (the prefix cache needs no key, there is one service tier): accepted quietly.
_NO_EFFECT = {"stream_options", "safety_identifier", "prompt_cache_key", "prompt_cache_retention", "service_tier"}
# vLLM's sampling extras, taken as chat takes them (the openai client sends them through extra_body).
_SAMPLING_EXTRAS = ("seed", "stop", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
                    "min_tokens", "ignore_eos", "stop_token_ids", "logit_bias", "skip_special_tokens", "priority",
                    "result_cache")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text")
# A chat field's name in an error -> the Responses field it came from ("messages" only where it leads, as a field).
_RESPONSES_NAMES = [(r"^messages\b", "input"), (r"\bresponse_format(\.json_schema)?\b", "text.format"),
                    (r"\bmax_(completion_)?tokens\b", "max_output_tokens"), (r"^tools\.(\d+)\.function\b", r"tools.\1")]


class TextConfig(BaseModel):
    model_config = _STRICT
    format: dict[str, Any] | None = Field(None, description="{'type': 'text'}, {'type': 'json_object'} or "
                                                            "{'type': 'json_schema', 'name', 'schema', 'strict'}.")
    verbosity: Literal["low", "medium", "high"] | None = Field(None, description="Only 'medium' (the default).")


class ResponsesRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None  # None: the served model
    input: str | list[dict[str, Any]] = Field(
        description="Text (one user message), or items: messages {role: user|system|developer|assistant, content: "
                    "text or input_text/output_text parts}, function_call {call_id, name, arguments} and "
                    "function_call_output {call_id, output}.")
    instructions: str | None = Field(None, description="A system message before the conversation (this turn only).")
    max_output_tokens: int | None = RANGES["max_completion_tokens"].field(None)
    temperature: float | None = RANGES["temperature"].field(1.0)
    top_p: float | None = RANGES["top_p"].field(1.0)
    tools: list[dict[str, Any]] | None = Field(None, description="Function tools: {'type': 'function', 'name', "
                                                                 "'description', 'parameters', 'strict'}.")
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] | None = Field(
        None, description="auto, none, required, or {'type': 'function', 'name': ...}.")
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    stream: bool | None = False
    store: bool | None = Field(True, description="Keep the response (in memory, bounded) for previous_response_id.")
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


@dataclass
class StoredResponse:
    response: dict[str, Any]
    conversation: list[dict[str, Any]]  # its chat turns, its own answer last (instructions left out)
    size: int


class ResponseStore:
    """Stored responses with their conversations, least recently used out first, within a count and a size."""

    def __init__(self, max_responses: int = MAX_STORED_RESPONSES, max_chars: int = MAX_STORED_CHARS) -> None:
        self.max_responses, self.max_chars = max_responses, max_chars
        self.chars = 0
        self._stored: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._stored)

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(conversation, ensure_ascii=False))
        self._stored[response["id"]] = StoredResponse(response, conversation, size)
        self.chars += size
        while len(self._stored) > self.max_responses or self.chars > self.max_chars:
            self.chars -= self._stored.popitem(last=False)[1].size

    def find(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The stored response (now the most recently used); a 404 naming the id when there is none."""
        stored = self._stored.get(response_id)
        if stored is None:
            raise APIError(404, f"no stored response has the id {response_id!r}: it was never stored (store false), "
                           f"or the server restarted or evicted it (it keeps the last {self.max_responses})",
                           param=param, code="previous_response_not_found" if param else "response_not_found")
        self._stored.move_to_end(response_id)
        return stored

    def delete(self, response_id: str) -> None:
        """Forget a stored response; a 404 naming the id when there is none."""
        self.find(response_id)
        self.chars -= self._stored.pop(response_id).size


async def create(serving: OpenAIServing, body: ResponsesRequest, model: str, request: Request, state: ServerState,
                 store: ResponseStore) -> Response:
    """The response to `body`: its conversation (the stored one it continues, then its input) answered on the chat
    path, in the Responses shapes; kept in `store` unless the request says store false."""
    extras = _extras(body)
    history = [] if body.previous_response_id is None else \
        list(store.find(body.previous_response_id, "previous_response_id").conversation)
    history += input_messages(body.input)
    instructions = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat = chat_request(body, instructions + history, extras)
    draft = Draft(f"resp_{uuid.uuid4().hex}", model, _echoed(body), history,
                  store.put if body.store is not False else None)
    try:
        return await answer(serving, chat, model, request, state, ResponsesView(draft))
    except APIError as exc:  # the chat path names chat's fields
        exc.info = exc.info.model_copy(update={"message": _responses_name(exc.info.message),
                                               "param": exc.info.param and _responses_name(exc.info.param)})
        raise


def input_messages(value: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as chat messages: a function_call joins the assistant turn before it (or makes one), as chat has it."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not value:
        raise _bad("input must not be empty", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            if item.get("role") not in _ROLES:
                raise _bad(f"{where}.role must be one of {', '.join(_ROLES)}", "input")
            messages.append({"role": item["role"], "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function", "function": {
                "name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": _text(output, f"{where}.output")})
        else:
            raise _bad(f"{where}: items of type {kind!r} are not supported; give messages, function_call and "
                       "function_call_output items", "input")
    return messages


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]], extras: dict[str, Any]
                 ) -> p.ChatCompletionRequest:
    fields = {**extras, "messages": messages, "stream": bool(body.stream), "temperature": body.temperature,
              "top_p": body.top_p, "max_completion_tokens": body.max_output_tokens, "tools": _chat_tools(body.tools),
              "tool_choice": _chat_tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
              "response_format": _response_format(body.text), "user": body.user}
    if body.stream:  # the usage goes into response.completed
        fields["stream_options"] = {"include_usage": True}
    try:
        return p.ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as exc:
        message, param = validation_error_message(exc.errors())
        raise _bad(_responses_name(message), param and _responses_name(param)) from None


def _extras(body: ResponsesRequest) -> dict[str, Any]:
    """The sampling extras to pass on; a 400 for a field this server cannot honour, a warning for an unknown one."""
    passed, unknown = {}, []
    for name, value in (body.model_extra or {}).items():
        if name in _UNSUPPORTED:
            if not _unset(value) and not (name == "truncation" and value == "disabled"):
                raise _bad(f"{name} is not supported by this server: {_UNSUPPORTED[name]}", name)
        elif name in _SAMPLING_EXTRAS:
            passed[name] = value
        elif name not in _NO_EFFECT:
            unknown.append(name)
    if unknown:
        logger.warning("ignoring unknown request field(s): %s", quoted(unknown))
    if body.text is not None and body.text.verbosity not in (None, "medium"):
        raise _bad("text.verbosity: only 'medium' (the default) is served", "text.verbosity")
    return passed


def _chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise _bad(f"tools[{i}]: tools of type {tool.get('type')!r} are not supported by this server; give "
                       "function tools ({'type': 'function', 'name', 'parameters'})", "tools")
    return [{"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in tools]


def _chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str) or len(choice) != 2:
        raise _bad("tool_choice must be auto, none, required or {'type': 'function', 'name': ...}", "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    given = text.format if text is not None else None
    kind = given.get("type") if given is not None else "text"
    if kind == "json_schema":
        if "schema" not in given:
            raise _bad("text.format: type 'json_schema' needs schema, the JSON schema the output must match",
                       "text.format")
        return {"type": "json_schema", "json_schema": {k: v for k, v in given.items() if k != "type"}}
    if kind not in ("text", "json_object"):
        raise _bad(f"text.format: type must be text, json_object or json_schema, got {kind!r}", "text.format")
    return None if kind == "text" else {"type": "json_object"}


def _echoed(body: ResponsesRequest) -> dict[str, Any]:
    """The request's settings as its Response restates them (defaults filled in)."""
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls is not False,
            "previous_response_id": body.previous_response_id, "store": body.store is not False,
            "temperature": 1.0 if body.temperature is None else body.temperature,
            "top_p": 1.0 if body.top_p is None else body.top_p,
            "text": {"format": body.text.format if body.text is not None and body.text.format else {"type": "text"}},
            "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "truncation": "disabled",
            "user": body.user, "background": False, "reasoning": {"effort": None, "summary": None}}


def _text(content: Any, where: str) -> str:
    """Message content (or a call's output) as text: a string, or input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _bad(f"{where} must be a string or a list of input_text parts", "input")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _bad(f"{where}[{j}]: parts of type {kind!r} are not supported; this model reads text only "
                       "({'type': 'input_text', 'text': ...})", "input")
        texts.append(part["text"])
    return "".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise _bad(f"{where}.{key} must be a string", "input")
    return item[key]


def _unset(value: Any) -> bool:
    return value in (None, False, 0, "", [], {}) or (isinstance(value, dict) and all(map(_unset, value.values())))


def _responses_name(text: str) -> str:
    for chat, ours in _RESPONSES_NAMES:
        text = re.sub(chat, ours, text)
    return text


def _bad(message: str, param: str | None) -> APIError:
    return APIError(400, message, param=param, rejected="invalid_request")
