"""Tool calling: the tools into the prompt, tool_choice into a constraint, the model's calls into tool_calls.

As vLLM's server does:
- The tools go through the model's own chat template where it reads `tools`. A template that does not
  (SmolLM2's) gets them in the Hermes format instead: a system block listing the functions and asking
  for `<tool_call>` JSON, earlier calls written back as `<tool_call>` text and tool results as
  `<tool_response>` user turns, which is how Qwen2.5's template renders them.
- `auto`: the model decides; its text is read by the server's tool-call parser (structured/tool_parsers.py).
- A named function: the output is held by the grammar to that function's parameters schema and is
  the call's arguments. `required`: the output is held to a JSON array of one or more
  `{"name", "parameters"}` objects of the given tools. Either way every call is valid JSON for its
  schema, whatever the model.
- `none` (or no tools): no tools in the prompt and nothing parsed.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from llmaccel.errors import InvalidRequestError
from llmaccel.server import protocol as p
from llmaccel.server.chat_messages import (
    AssistantTurn,
    ChatTool,
    FunctionCall,
    Message,
    NamedToolChoice,
    ToolCall,
    ToolMessage,
)
from llmaccel.server.response_models import AssistantMessage
from llmaccel.structured.params import StructuredOutputsParams
from llmaccel.structured.tool_parsers import HermesToolParser, ParsedCall

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    mode: str  # "auto", "named" or "required" ("none" has no plan)
    tools: tuple[ChatTool, ...]
    named: str | None = None
    constraint: StructuredOutputsParams | None = None

    @property
    def specs(self) -> list[dict[str, Any]]:
        return [tool.model_dump(exclude_none=True) for tool in self.tools]


def tool_plan(request: p.ChatCompletionRequest) -> ToolPlan | None:
    """How this request uses its tools; None when it uses none. Raises InvalidRequestError naming the field."""
    tools, choice = request.tools or [], request.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise InvalidRequestError("tool_choice needs tools: give the functions the model may call", param="tool_choice")
    if not tools or choice == "none":
        return None
    names = [tool.function.name for tool in tools]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools: two functions share a name", param="tools")
    if choice is not None and choice != "auto" and request.output_constraint is not None:
        raise InvalidRequestError("a forced tool call (tool_choice required or a named function) cannot be combined "
                                  "with response_format or structured_outputs", param="tool_choice")
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise InvalidRequestError(f"tool_choice names the function {name!r}, which is not among the tools "
                                      f"({', '.join(names)})", param="tool_choice")
        schema = tools[names.index(name)].function.parameters or ANY_OBJECT
        return ToolPlan("named", tuple(tools), name, StructuredOutputsParams(json=schema, source="tool_choice"))
    if choice == "required":
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name},
                                                   "parameters": t.function.parameters or ANY_OBJECT},
                  "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
        if request.parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", tuple(tools), None, StructuredOutputsParams(json=schema, source="tool_choice"))
    return ToolPlan("auto", tuple(tools))


def template_reads_tools(tokenizer) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def chat_turns(messages: list[Message], plan: ToolPlan | None, native: bool) -> list[dict[str, Any]]:
    """The conversation as chat-template turns. `native`: the template renders tools and tool turns
    itself; otherwise they are written in the Hermes format."""
    turns = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        turn: dict[str, Any] = {"role": role, "content": m.text()}
        # only an assistant turn's calls and a tool turn's answer: on another role they are unknown fields
        calls = m.tool_calls if isinstance(m, AssistantTurn) else None
        answers = m.tool_call_id if isinstance(m, ToolMessage) else None
        if native:
            if calls:
                turn["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                    "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in calls]
            if answers is not None:
                turn["tool_call_id"] = answers
        elif calls:
            written = "\n".join(_hermes_call(c) for c in calls)
            turn["content"] = f"{turn['content']}\n{written}" if turn["content"] else written
        elif role == "tool":
            turn = {"role": "user", "content": f"<tool_response>\n{turn['content']}\n</tool_response>"}
        turns.append(turn)
    if plan is not None and not native:
        block = hermes_tools_prompt(plan.specs)
        if turns and turns[0]["role"] == "system":
            turns[0] = {**turns[0], "content": f"{turns[0]['content']}\n\n{block}"}
        else:
            turns.insert(0, {"role": "system", "content": block})
    return turns


def hermes_tools_prompt(specs: list[dict[str, Any]]) -> str:
    listing = "\n".join(json.dumps(spec, ensure_ascii=False) for spec in specs)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{listing}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def _hermes_call(call: ToolCall) -> str:
    body = json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)},
                      ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _arguments(text: str) -> Any:
    """A call's arguments as the template wants them: the object (the API sends JSON text)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise InvalidRequestError(f"a tool call's arguments are not valid JSON: {text[:80]!r}",
                                  param="messages") from None


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def calls_of(plan: ToolPlan, text: str, parser: HermesToolParser) -> tuple[str | None, list[ParsedCall]]:
    """A finished choice's content and calls."""
    if plan.mode == "named":
        return (None, [ParsedCall(plan.named, text)]) if _is_json(text) else (text, [])
    if plan.mode == "required":
        try:
            items = json.loads(text)
        except json.JSONDecodeError:  # cut short by max_tokens
            return text, []
        return None, [ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in items]
    extracted = parser.extract(text)
    return extracted.content, extracted.calls


def assistant_message(plan: ToolPlan | None, parser: HermesToolParser, text: str, finish_reason: str | None
                      ) -> tuple[AssistantMessage, str | None]:
    """A finished chat choice's message, with its tool calls when it made any (finish_reason tool_calls)."""
    if plan is None:
        return AssistantMessage(content=text), finish_reason
    content, calls = calls_of(plan, text, parser)
    tool_calls = [ToolCall(id=new_call_id(), function=FunctionCall(name=c.name, arguments=c.arguments))
                  for c in calls]
    return AssistantMessage(content=content, tool_calls=tool_calls), called(finish_reason, bool(calls))


def called(finish_reason: str | None, made_calls: bool) -> str | None:
    return "tool_calls" if made_calls and finish_reason == "stop" else finish_reason


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


class ToolCallStream:
    """One streamed choice: its text deltas in, (content delta, tool_calls deltas) out, in OpenAI's
    shapes. A named call streams its arguments as they come (the header with the first piece); a
    parsed call (auto) or a required call's list goes out whole once it is complete."""

    def __init__(self, plan: ToolPlan, parser: HermesToolParser) -> None:
        self.plan = plan
        self.hermes = parser.stream() if plan.mode == "auto" else None
        self.text = ""
        self.num_calls = 0

    def push(self, delta: str, final: bool) -> tuple[str | None, list[dict[str, Any]]]:
        if self.plan.mode == "named":
            if not delta:
                return None, []
            if self.num_calls == 0:
                self.num_calls = 1
                return None, [{"index": 0, "id": new_call_id(), "type": "function",
                               "function": {"name": self.plan.named, "arguments": delta}}]
            return None, [{"index": 0, "function": {"arguments": delta}}]
        if self.plan.mode == "required":
            self.text += delta
            if not final:
                return None, []
            content, calls = calls_of(self.plan, self.text, HermesToolParser())
        else:
            content, calls = self.hermes.push(delta)
            if final:
                more, tail = self.hermes.finish()
                content, calls = content + more, calls + tail
        return content or None, [self._header(call) for call in calls]

    def _header(self, call: ParsedCall) -> dict[str, Any]:
        self.num_calls += 1
        return {"index": self.num_calls - 1, "id": new_call_id(), "type": "function",
                "function": {"name": call.name, "arguments": call.arguments}}
