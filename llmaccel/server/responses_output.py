"""A Responses API answer in OpenAI's shapes: the Response object, its output items, and the stream's events.

The chat path's answer is translated. Whole: the chat completion's message becomes the output, its text a
`message` item and each tool call a `function_call` item. Streamed: the chat chunks become the Responses event
sequence, each event with its `sequence_number`: response.created, response.in_progress, then for each output
item .output_item.added, its text (.content_part.added, .output_text.delta..., .output_text.done,
.content_part.done) or its arguments (.function_call_arguments.delta..., .done), .output_item.done; and last
response.completed (response.incomplete when cut by max_output_tokens, response.failed after an error event).
A stream's items open in the order the text and the calls come, and its final response holds exactly those items.
"""

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from llmaccel.server.serving import _sse

# A chat finish_reason that leaves a response incomplete -> the reason its incomplete_details give.
INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def last_status(finish_reason: str | None) -> str:
    """The status of a response's last output item: the one a cut answer leaves unfinished."""
    return "incomplete" if finish_reason in INCOMPLETE else "completed"


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": []}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"type": "message", "id": item_id, "role": "assistant", "status": status, "content": [text_part(text)]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def usage_of(chat_usage: dict[str, Any]) -> dict[str, Any]:
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """A response's output as the chat turn that a later request's conversation holds (unfinished calls left out)."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call" and item["status"] == "completed"]
    return {"role": "assistant", "content": text if text or not calls else None, **({"tool_calls": calls} if calls
                                                                                     else {})}


@dataclass
class Draft:
    """One response in the making: its id, what it restates of its request, and the conversation it answers."""

    id: str
    model: str
    echoed: dict[str, Any]  # the request's settings, as the Response object restates them
    history: list[dict[str, Any]]  # the chat turns it answers (an earlier response's, then its input), no instructions
    keep: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None  # the store's put; None: store false
    created_at: int = field(default_factory=lambda: int(time.time()))

    def envelope(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 incomplete: dict[str, str] | None = None, error: dict[str, Any] | None = None) -> dict[str, Any]:
        response = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                    "incomplete_details": incomplete, "model": self.model, "output": output, "usage": usage,
                    **self.echoed}
        if error is not None:  # absent, not null, otherwise: a stream's lines name "error" only when one happened
            response["error"] = error
        return response

    def finish(self, output: list[dict[str, Any]], finish_reason: str | None, chat_usage: dict[str, Any],
               guard: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """The final Response, kept in the store (with its whole conversation) unless the request said store false."""
        reason = INCOMPLETE.get(finish_reason)
        response = self.envelope("incomplete" if reason else "completed", output, usage_of(chat_usage),
                                 {"reason": reason} if reason else None)
        if guard:
            response["guard"] = guard
        if self.keep is not None:
            self.keep(response, [*self.history, assistant_turn(output)])
        return response


class ResponsesView:
    """A chat answer as a Response (answer.py's `view`): the body of a whole one, the events of a streamed one."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft

    def body(self, chat: dict[str, Any]) -> dict[str, Any]:
        choice = chat["choices"][0]
        message, finish_reason = choice["message"], choice["finish_reason"]
        output = [message_item(new_id("msg"), message["content"] or "", "completed")] \
            if message["content"] or not message["tool_calls"] else []
        output += [call_item(new_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"],
                             "completed") for call in message["tool_calls"]]
        output[-1]["status"] = last_status(finish_reason)
        return self.draft.finish(output, finish_reason, chat["usage"])

    def stream(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        return _Events(self.draft).translate(chunks)


class _Events:
    """One streamed response: chat SSE chunks in, Responses SSE events out."""

    def __init__(self, draft: Draft) -> None:
        self.draft = draft
        self.sequence_number = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None  # the item being written, the last of `output`

    async def translate(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        yield self.event("response.created", response=self.draft.envelope("in_progress", []))
        yield self.event("response.in_progress", response=self.draft.envelope("in_progress", []))
        finish_reason, usage, guard = None, None, []
        async with contextlib.aclosing(chunks):  # closing this stream closes the chat's (aborting the request)
            async for line in chunks:
                if not line.startswith("data: {"):
                    continue  # data: [DONE]
                chunk = json.loads(line.removeprefix("data: "))
                if "error" in chunk:
                    for event in self.failed(chunk["error"]):
                        yield event
                    return
                usage, guard = chunk.get("usage") or usage, guard + chunk.get("guard", [])
                for choice in chunk["choices"]:
                    delta = choice["delta"]
                    events = self.text(delta["content"]) if delta.get("content") else []
                    for piece in delta.get("tool_calls") or []:
                        events += self.call(piece)
                    finish_reason = choice["finish_reason"] or finish_reason
                    for event in events:
                        yield event
        events = self.text("") if not self.output else []  # an empty answer is an empty message, as when whole
        for event in events + self.close(last_status(finish_reason)):
            yield event
        response = self.draft.finish(self.output, finish_reason, usage, guard)
        yield self.event(f"response.{response['status']}", response=response)

    def event(self, kind: str, **fields: Any) -> str:
        self.sequence_number += 1
        return f"event: {kind}\n" + _sse({"type": kind, "sequence_number": self.sequence_number - 1, **fields})

    def _opened(self, item: dict[str, Any], added: dict[str, Any]) -> list[str]:
        events = self.close("completed")
        self.output.append(item)
        self.open = item
        return events + [self.event("response.output_item.added", output_index=len(self.output) - 1, item=added)]

    def text(self, delta: str) -> list[str]:
        events = []
        if self.open is None or self.open["type"] != "message":
            item = message_item(new_id("msg"), "", "in_progress")
            events = self._opened(item, {**item, "content": []}) + [self.event(
                "response.content_part.added", **self._where(), content_index=0, part=text_part(""))]
        if delta:
            self.open["content"][0]["text"] += delta
            events.append(self.event("response.output_text.delta", **self._where(), content_index=0, delta=delta,
                                     logprobs=[]))
        return events

    def call(self, piece: dict[str, Any]) -> list[str]:
        """A chat tool-call delta: a header (id, name, maybe arguments) starts a call, a later piece adds arguments."""
        events = []
        if "id" in piece:
            item = call_item(new_id("fc"), piece["id"], piece["function"]["name"], "", "in_progress")
            events = self._opened(item, dict(item))
        arguments = piece["function"].get("arguments") or ""
        if arguments:
            self.open["arguments"] += arguments
            events.append(self.event("response.function_call_arguments.delta", **self._where(), delta=arguments))
        return events

    def close(self, status: str) -> list[str]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        where = {"item_id": item["id"], "output_index": len(self.output) - 1}
        if item["type"] == "message":
            part = item["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=part["text"], logprobs=[]),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        else:
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=item["arguments"])]
        return events + [self.event("response.output_item.done", output_index=where["output_index"], item=item)]

    def failed(self, error: dict[str, Any]) -> list[str]:
        """The chat stream's error event (a timeout, a failed request, a dead engine): OpenAI's error event, then
        response.failed with what was written so far. A failed response is not stored."""
        return [self.event("error", code=error.get("code"), message=error["message"], param=error.get("param")),
                self.event("response.failed", response=self.draft.envelope(
                    "failed", self.output, error={"code": error.get("code") or "server_error",
                                                  "message": error["message"]}))]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.open["id"], "output_index": len(self.output) - 1}
