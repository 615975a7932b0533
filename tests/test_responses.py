"""The Responses API (`/v1/responses`) through the real server and the official openai client: each answer equals
the chat completion of the same conversation (the same path), streams in OpenAI's event order, calls functions,
follows a JSON schema, continues a stored conversation by previous_response_id; and the errors for bad input."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest

from llmaccel.server.errors import APIError
from llmaccel.server.responses import ResponseStore
from tests.live_server import MODEL_NAME, live_server

GREEDY = {"model": MODEL_NAME, "temperature": 0}
LONG = {"ignore_eos": True}  # every answer runs to max_output_tokens, so its length is known
WEATHER_PARAMETERS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Rome"]},
                                                       "unit": {"enum": ["celsius", "fahrenheit"]}},
                      "required": ["city", "unit"], "additionalProperties": False}
TIME_PARAMETERS = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
                   "additionalProperties": False}
TOOLS = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
          "parameters": WEATHER_PARAMETERS},
         {"type": "function", "name": "get_time", "description": "The time", "parameters": TIME_PARAMETERS}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]
SCORE = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 0, "maximum": 99},
                                          "verdict": {"enum": ["good", "bad"]}},
         "required": ["score", "verdict"], "additionalProperties": False}
TEXT_EVENTS = ["response.created", "response.in_progress", "response.output_item.added",
               "response.content_part.added"]
TEXT_DONE = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]


class Verdict(pydantic.BaseModel):
    score: int = pydantic.Field(ge=0, le=99)
    verdict: Literal["good", "bad"]


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat(client, messages, max_tokens, **fields):
    return client.chat.completions.create(**GREEDY, messages=messages, max_tokens=max_tokens, **fields)


def test_a_text_response_is_the_chat_completion_of_the_same_conversation(client):
    reply = client.responses.create(**GREEDY, input="Tell me a story about a dragon.", instructions="Be brief.",
                                    max_output_tokens=12, extra_body=LONG)
    same = chat(client, [{"role": "system", "content": "Be brief."},
                         {"role": "user", "content": "Tell me a story about a dragon."}], 12, extra_body=LONG)
    assert reply.output_text == same.choices[0].message.content and len(reply.output_text) > 0
    assert (reply.usage.input_tokens, reply.usage.output_tokens, reply.usage.total_tokens) == (
        same.usage.prompt_tokens, 12, same.usage.prompt_tokens + 12)
    assert reply.usage.output_tokens_details.reasoning_tokens == 0
    (message,) = reply.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [(c.type, c.text, c.annotations) for c in message.content] == [("output_text", reply.output_text, [])]
    # cut by max_output_tokens: incomplete, as OpenAI reports it
    assert reply.status == "incomplete" and reply.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    assert reply.id.startswith("resp_") and reply.object == "response" and reply.model == MODEL_NAME
    assert (reply.instructions, reply.max_output_tokens, reply.temperature, reply.tools, reply.tool_choice) == (
        "Be brief.", 12, 0.0, [], "auto")


def test_message_items_with_parts_and_roles_are_the_chat_messages_they_name(client):
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is the capital "},
                                                             {"type": "input_text", "text": "of France?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "Paris."}]},
             {"role": "user", "content": "And of the moon?"}]
    reply = client.responses.create(**GREEDY, input=items, max_output_tokens=8, extra_body=LONG)
    same = chat(client, [{"role": "system", "content": "Answer in French."},
                         {"role": "user", "content": "What is the capital of France?"},
                         {"role": "assistant", "content": "Paris."},
                         {"role": "user", "content": "And of the moon?"}], 8, extra_body=LONG)
    assert reply.output_text == same.choices[0].message.content
    assert reply.usage.input_tokens == same.usage.prompt_tokens


def test_a_stream_sends_the_events_in_order_and_its_deltas_make_the_text(client):
    whole = client.responses.create(**GREEDY, input="The quick brown fox", max_output_tokens=10, extra_body=LONG)
    events = list(client.responses.create(**GREEDY, input="The quick brown fox", max_output_tokens=10,
                                          extra_body=LONG, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == TEXT_EVENTS + ["response.output_text.delta"] * len(deltas) + TEXT_DONE + ["response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(deltas) == whole.output_text and events[-4].text == whole.output_text
    created, final = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 and e.content_index == 0 for e in events[3:-2])
    assert final.output[0].id == item_id and final.output_text == whole.output_text
    assert final.status == "incomplete" and final.usage.output_tokens == 10
    assert final.usage.input_tokens == whole.usage.input_tokens


def test_the_clients_stream_helper_ends_with_the_final_response(client):
    """A stop string ends the answer before max_output_tokens: response.completed, which the helper needs."""
    whole = client.responses.create(**GREEDY, input="Continuous batching", max_output_tokens=12,
                                    extra_body=LONG).output_text
    stop = whole[-2:]
    assert len(whole) >= 4
    with client.responses.stream(**GREEDY, input="Continuous batching", max_output_tokens=12,
                                 extra_body={"stop": [stop]}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    text = whole[:whole.index(stop)]
    assert final.status == "completed" and final.output_text == text and final.incomplete_details is None
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.type for e in events][-4:] == TEXT_DONE + ["response.completed"]


def test_a_named_function_is_called_with_arguments_valid_for_its_schema(client):
    reply = client.responses.create(**GREEDY, input="What is the weather in Paris?", tools=TOOLS,
                                    tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=60)
    (call,) = reply.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and reply.output_text == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert reply.status == "completed"
    same = chat(client, [{"role": "user", "content": "What is the weather in Paris?"}], 60, tools=CHAT_TOOLS,
                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert call.arguments == same.choices[0].message.tool_calls[0].function.arguments
    assert reply.usage.input_tokens == same.usage.prompt_tokens


def test_a_streamed_call_sends_its_arguments_as_deltas(client):
    with client.responses.stream(**GREEDY, input="What is the weather in Paris?", tools=TOOLS,
                                 tool_choice={"type": "function", "name": "get_weather"},
                                 max_output_tokens=60) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added"] + [
        "response.function_call_arguments.delta"] * len(deltas) + [
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    (call,) = final.output
    assert len(deltas) > 2 and "".join(deltas) == call.arguments == events[-3].arguments
    assert events[2].item.call_id == call.call_id and events[2].item.arguments == ""
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)


def test_required_calls_and_the_answer_to_their_output(client):
    """tool_choice required: calls of the given tools; then their output continues the stored conversation, and
    the follow-up is the chat completion of the whole conversation (the call and its result in the prompt)."""
    question = [{"role": "user", "content": "Weather in Oslo, and the time?"}]
    first = client.responses.create(**GREEDY, input=question, tools=TOOLS, tool_choice="required",
                                    max_output_tokens=200)
    assert first.status == "completed" and first.output and all(i.type == "function_call" for i in first.output)
    schemas = {"get_weather": WEATHER_PARAMETERS, "get_time": TIME_PARAMETERS}
    for call in first.output:
        jsonschema.validate(json.loads(call.arguments), schemas[call.name])
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": '{"ok": true}'} for c in first.output]
    follow = client.responses.create(**GREEDY, previous_response_id=first.id, input=results, tools=TOOLS,
                                     max_output_tokens=6, extra_body=LONG)
    history = question + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
            for c in first.output]}] + [{"role": "tool", "tool_call_id": c.call_id, "content": '{"ok": true}'}
                                        for c in first.output]
    same = chat(client, history, 6, tools=CHAT_TOOLS, extra_body=LONG)
    assert follow.usage.input_tokens == same.usage.prompt_tokens
    assert follow.output_text == same.choices[0].message.content and follow.previous_response_id == first.id


def test_a_json_schema_format_holds_the_output_to_the_schema(client):
    reply = client.responses.create(**GREEDY, input="Rate this film.", max_output_tokens=80, text={
        "format": {"type": "json_schema", "name": "verdict", "schema": SCORE, "strict": True}})
    assert reply.status == "completed" and reply.text.format.type == "json_schema"
    jsonschema.validate(json.loads(reply.output_text), SCORE)
    parsed = client.responses.parse(**GREEDY, input="Rate this film.", max_output_tokens=80, text_format=Verdict)
    assert isinstance(parsed.output_parsed, Verdict) and parsed.output_parsed.verdict in ("good", "bad")
    with client.responses.stream(**GREEDY, input="Rate this film.", max_output_tokens=80,
                                 text_format=Verdict) as stream:
        final = stream.get_final_response()
    assert final.output_parsed == parsed.output_parsed
    as_object = client.responses.create(**GREEDY, input="Rate this film.", max_output_tokens=20,
                                        text={"format": {"type": "json_object"}})
    same = chat(client, [{"role": "user", "content": "Rate this film."}], 20, response_format={"type": "json_object"})
    assert as_object.output_text == same.choices[0].message.content and as_object.output_text.startswith("{")


def test_previous_response_id_continues_the_conversation_without_its_instructions(client):
    first = client.responses.create(**GREEDY, input="Hello there", instructions="Be brief.", max_output_tokens=6,
                                    extra_body=LONG)
    second = client.responses.create(**GREEDY, previous_response_id=first.id, input="And then?",
                                     max_output_tokens=6, extra_body=LONG)
    same = chat(client, [{"role": "user", "content": "Hello there"},
                         {"role": "assistant", "content": first.output_text},
                         {"role": "user", "content": "And then?"}], 6, extra_body=LONG)
    assert second.usage.input_tokens == same.usage.prompt_tokens > first.usage.input_tokens
    assert second.output_text == same.choices[0].message.content
    third = client.responses.create(**GREEDY, previous_response_id=second.id, input="Go on.", max_output_tokens=2)
    longer = chat(client, [{"role": "user", "content": "Hello there"},
                           {"role": "assistant", "content": first.output_text},
                           {"role": "user", "content": "And then?"},
                           {"role": "assistant", "content": second.output_text},
                           {"role": "user", "content": "Go on."}], 2)
    assert third.usage.input_tokens == longer.usage.prompt_tokens


def test_stored_responses_are_retrieved_and_deleted(client, server):
    reply = client.responses.create(**GREEDY, input="Hello", max_output_tokens=4)
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()
    client.responses.delete(reply.id)
    for call in (lambda: client.responses.retrieve(reply.id),
                 lambda: client.responses.create(**GREEDY, input="x", previous_response_id=reply.id)):
        with pytest.raises(openai.NotFoundError):
            call()
    unstored = client.responses.create(**GREEDY, input="Hello", max_output_tokens=4, store=False)
    assert unstored.store is False
    missing = httpx.get(f"{server.url}/v1/responses/{unstored.id}")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "response_not_found"


def test_an_unknown_previous_response_id_is_a_404_naming_it(server):
    reply = httpx.post(server.url + "/v1/responses", json={"input": "hi", "previous_response_id": "resp_nope"})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == (
        "invalid_request_error", "previous_response_id", "previous_response_not_found")
    assert "'resp_nope'" in error["message"]


FUNCTION = {"type": "function", "name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"input": []}, "input", "input must not be empty"),
    ({"input": 5}, "input", "input:"),
    ({"input": [{"role": "robot", "content": "x"}]}, "input", "input[0].role must be one of user, system"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]}, "input",
     "input[0].content[0]: parts of type 'input_image' are not supported"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]}, "input",
     "parts of type 'input_file' are not supported"),
    ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, "input", "input[0]: items of type 'web_search_call'"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f"}]}, "input",
     "input[0].arguments must be a string"),
    ({"input": [{"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{oops"}]}, "input",
     "a tool call's arguments are not valid JSON"),
    ({"input": "hello " * 1500}, "input", "but max_model_len is 1024"),
    ({"input": "hello " * 330, "max_output_tokens": 1000}, "input", "lower max_output_tokens"),
    ({"tools": [{"type": "web_search"}]}, "tools", "tools[0]: tools of type 'web_search' are not supported"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools", "tools.0.name"),
    ({"tools": [FUNCTION, FUNCTION]}, "tools", "two functions share a name"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "g"}}, "tool_choice",
     "'g', which is not among the tools (f)"),
    ({"tools": [FUNCTION], "tool_choice": {"type": "web_search_preview"}}, "tool_choice", "tool_choice must be"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "needs schema"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}}, "text.format",
     "the JSON schema is invalid"),
    ({"text": {"format": {"type": "yaml"}}}, "text.format", "type must be text, json_object or json_schema"),
    ({"text": {"verbosity": "high"}}, "text.verbosity", "only 'medium'"),
    ({"tools": [FUNCTION], "tool_choice": "required", "text": {"format": {"type": "json_object"}}}, "tool_choice",
     "cannot be combined with text.format"),
    ({"temperature": 3}, "temperature", "must be in [0, 2]"),
    ({"max_output_tokens": 0}, "max_output_tokens", "max_output_tokens"),
    ({"model": "nope"}, "model", "the model 'nope' does not exist"),
    ({"background": True}, "background", "background is not supported by this server"),
    ({"reasoning": {"effort": "high"}}, "reasoning", "reasoning is not supported by this server"),
    ({"include": ["message.output_text.logprobs"]}, "include", "include is not supported"),
    ({"truncation": "auto"}, "truncation", "only 'disabled' is served"),
    ({"conversation": "conv_1"}, "conversation", "continue a conversation with previous_response_id"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, message):
    reply = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 4, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and message in error["message"], error
    server.wait_idle()


def test_fields_without_effect_here_are_accepted(server):
    reply = httpx.post(server.url + "/v1/responses", timeout=60, json={
        "input": "hi", "max_output_tokens": 2, "truncation": "disabled", "reasoning": {"effort": None},
        "include": [], "background": False, "service_tier": "auto", "prompt_cache_key": "k", "text": {
            "verbosity": "medium"}, "metadata": {"k": "v"}})
    assert reply.status_code == 200, reply.text
    assert reply.json()["metadata"] == {"k": "v"} and reply.json()["usage"]["output_tokens"] <= 2


def test_responses_count_against_the_clients_rate_limit(llama_dir):
    with live_server(llama_dir, rate_limit_requests=2) as limited:
        statuses = [httpx.post(limited.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2},
                               timeout=30).status_code for _ in range(3)]
        chat_status = httpx.post(limited.url + "/v1/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).status_code
    assert statuses == [200, 200, 429] and chat_status == 429


def test_a_timeout_is_a_504_or_an_error_event_then_response_failed(llama_dir):
    """Past --request-timeout: a whole response is a 504; a stream, having sent its status line, ends with OpenAI's
    error event and response.failed, and the failed response is not stored."""
    with live_server(llama_dir, request_timeout=0.2) as limited:
        body = {"input": "Once upon a time", "max_output_tokens": 900, "ignore_eos": True}
        whole = httpx.post(limited.url + "/v1/responses", json=body, timeout=30)
        assert whole.status_code == 504 and whole.json()["error"]["code"] == "request_timeout"
        client = openai.OpenAI(base_url=limited.url + "/v1", api_key="unused", max_retries=0)
        events = list(client.responses.create(**GREEDY, input=body["input"], max_output_tokens=900,
                                              extra_body=LONG, stream=True))
        error, failed = events[-2:]
        assert error.type == "error" and error.code == "request_timeout"
        assert failed.type == "response.failed" and failed.response.status == "failed"
        assert failed.response.error.code == "request_timeout"
        assert [e.sequence_number for e in events] == list(range(len(events)))
        assert httpx.get(f"{limited.url}/v1/responses/{failed.response.id}").status_code == 404
        limited.wait_idle()


def test_the_store_evicts_the_least_recently_used_within_its_count_and_size():
    def response(i: int) -> dict:
        return {"id": f"resp_{i}", "output": []}

    store = ResponseStore(max_responses=3, max_chars=10_000)
    for i in range(3):
        store.put(response(i), [{"role": "user", "content": "x"}])
    store.find("resp_0")  # used: resp_1 is now the least recently used
    store.put(response(3), [])
    assert [r for r in ("resp_0", "resp_1", "resp_2", "resp_3") if _stored(store, r)] == ["resp_0", "resp_2", "resp_3"]
    small = ResponseStore(max_responses=100, max_chars=200)
    small.put(response(0), [{"role": "user", "content": "a" * 60}])
    small.put(response(1), [{"role": "user", "content": "b" * 60}])
    assert not _stored(small, "resp_0") and _stored(small, "resp_1") and len(small) == 1
    small.delete("resp_1")
    assert small.chars == 0 and len(small) == 0


def _stored(store: ResponseStore, response_id: str) -> bool:
    try:
        store.find(response_id)
    except APIError:
        return False
    return True
