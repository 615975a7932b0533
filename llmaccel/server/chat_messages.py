"""The messages and tools of a chat request (pydantic), as OpenAI's API has them.

A message's role picks its kind (system or developer, user, assistant, tool), and only an assistant turn
that called tools may go without content. `_STRICT` is the config every request model shares (protocol.py,
tokenizing.py): strict types, no NaN, unknown fields kept so that the server can warn about them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, model_validator

_STRICT = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)


class FunctionDefinition(BaseModel):
    model_config = _STRICT
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None


class ChatTool(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = _STRICT
    name: str


class NamedToolChoice(BaseModel):
    model_config = _STRICT
    type: Literal["function"]
    function: NamedFunction


class FunctionCall(BaseModel):
    model_config = _STRICT
    name: str
    arguments: str  # JSON text, as the API sends it


class ToolCall(BaseModel):
    model_config = _STRICT
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


_CONTENT_REQUIRED = ("content is required and must not be null (except in an assistant message with tool_calls): "
                     "give a string or a list of {'type': 'text', 'text': ...} parts")
Content = str | list[dict[str, Any]]


class Message(BaseModel):
    """A turn of the conversation; the role picks the kind (below), and only an assistant turn that called
    tools may go without content."""

    model_config = _STRICT
    role: str
    content: Content | None = None
    name: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _content_given(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("content") is None and not (
                data.get("role") == "assistant" and data.get("tool_calls")):
            raise ValueError(_CONTENT_REQUIRED)
        return data

    def text(self) -> str:
        """The message as plain text; only text content parts are understood."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"content part of type {part.get('type')!r} is not supported; "
                                 "this model reads only {'type': 'text', 'text': ...} parts")
            parts.append(part["text"])
        return "".join(parts)


class SystemMessage(Message):
    role: Literal["system", "developer"]
    content: Content


class UserMessage(Message):
    role: Literal["user"]
    content: Content


class AssistantTurn(Message):
    role: Literal["assistant"]
    tool_calls: list[ToolCall] | None = None  # the calls it made


class ToolMessage(Message):
    role: Literal["tool"]
    content: Content
    tool_call_id: str | None = None  # the call it answers


ChatMessage = Annotated[SystemMessage | UserMessage | AssistantTurn | ToolMessage, Field(discriminator="role")]
_MESSAGE = TypeAdapter(ChatMessage)


def chat_message(data: dict[str, Any]) -> Message:
    """One message from its JSON form (the role picks its kind)."""
    return _MESSAGE.validate_python(data)

