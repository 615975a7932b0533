"""Structured outputs and tool calling on the real default model: the official openai client's parse
helpers, a tool round trip, outputs validated with jsonschema, and the 400s that name the field."""

from __future__ import annotations

import json
import re
from typing import Literal

import jsonschema
import openai
import pydantic
import pytest

from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.structured.params import StructuredOutputsParams
from tests.live_server import MODEL_NAME, live_server

pytestmark = pytest.mark.slow

SHORT = {"type": "string", "maxLength": 24}
SCHEMAS = {
    "nested objects": ({"type": "object", "properties": {
        "name": SHORT, "address": {"type": "object", "properties": {
            "street": SHORT, "city": SHORT, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["street", "city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False}, "Give a person and their home address."),
    "enums in a bounded array": ({"type": "object", "properties": {
        "colours": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
        "size": {"enum": ["S", "M", "L"]}}, "required": ["colours", "size"], "additionalProperties": False},
        "Describe a T-shirt."),
    "numbers with bounds": ({"type": "object", "properties": {
        "price": {"type": "number", "minimum": 0, "maximum": 1000}, "quantity": {"type": "integer", "minimum": 1,
                                                                                    "maximum": 99},
        "discount": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}},
        "required": ["price", "quantity", "discount"], "additionalProperties": False}, "Price an order of apples."),
    "objects in an array, nullable": ({"type": "object", "properties": {
        "items": {"type": "array", "maxItems": 3, "items": {"type": "object", "properties": {
            "name": SHORT, "note": {"anyOf": [SHORT, {"type": "null"}]}, "done": {"type": "boolean"}},
            "required": ["name", "note", "done"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}, "List my tasks for today."),
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 40},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}}]
WEATHER = [{"role": "user", "content": "What is the weather in Paris?"}]
GET_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=30)
    age: int
    colour: Literal["red", "green", "blue"]


@pytest.fixture(scope="module")
def server():
    with live_server("smollm2-135m", engine_options={"dtype": "float32"}) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize("name", SCHEMAS)
def test_outputs_validate_against_many_schemas(name):
    """Greedy and three seeds per schema: every answer finishes and validates."""
    llm = _llm()
    schema, question = SCHEMAS[name]
    prompt = llm.tokenizer.apply_chat_template([{"role": "user", "content": question + " Answer in JSON."}],
                                               tokenize=False, add_generation_prompt=True)
    constraint = StructuredOutputsParams(json=schema)
    params = [SamplingParams(temperature=0, max_tokens=300, structured_outputs=constraint)] + [
        SamplingParams(temperature=1.0, seed=seed, max_tokens=300, structured_outputs=constraint) for seed in range(3)]
    for out in llm.generate([prompt] * len(params), params):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        jsonschema.validate(json.loads(out.outputs[0].text), schema)


def test_parse_returns_the_pydantic_object(client):
    reply = client.chat.completions.parse(model=MODEL_NAME, messages=[
        {"role": "user", "content": "Describe a person as JSON: name, age, favourite colour."}],
        response_format=Person, temperature=0, max_tokens=100)
    person = reply.choices[0].message.parsed
    assert isinstance(person, Person) and reply.choices[0].finish_reason == "stop"
    assert Person.model_validate_json(reply.choices[0].message.content) == person


def test_parse_streams_the_same_object(client):
    messages = [{"role": "user", "content": "Describe a person as JSON: name, age, favourite colour."}]
    whole = client.chat.completions.parse(model=MODEL_NAME, messages=messages, response_format=Person,
                                          temperature=0, max_tokens=100)
    with client.chat.completions.stream(model=MODEL_NAME, messages=messages, response_format=Person, temperature=0,
                                        max_tokens=100) as stream:
        deltas = [event.delta for event in stream if event.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 3 and "".join(deltas) == whole.choices[0].message.content
    assert final.choices[0].message.parsed == whole.choices[0].message.parsed


def test_json_object_and_vllm_fields_on_both_endpoints(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER, temperature=0, max_tokens=120,
                                           response_format={"type": "json_object"})
    assert isinstance(json.loads(reply.choices[0].message.content), dict)
    text = client.completions.create(model=MODEL_NAME, prompt="My phone number is", temperature=0, max_tokens=20,
                                     extra_body={"guided_regex": r"\+[0-9]{2} [0-9]{3} [0-9]{4}"}).choices[0].text
    assert re.fullmatch(r"\+[0-9]{2} [0-9]{3} [0-9]{4}", text)
    choice = client.completions.create(model=MODEL_NAME, prompt="The sky is", temperature=0, max_tokens=5,
                                       extra_body={"structured_outputs": {"choice": ["blue", "green"]}})
    assert choice.choices[0].text in ("blue", "green") and choice.choices[0].finish_reason == "stop"
    grammar = client.completions.create(model=MODEL_NAME, prompt="Count:", temperature=0, max_tokens=20,
                                        extra_body={"guided_grammar": 'root ::= "one, two" (", " [a-z]{3,5}){0,2}'})
    assert re.fullmatch(r"one, two(, [a-z]{3,5}){0,2}", grammar.choices[0].text)


def test_a_tool_round_trip(client, server):
    """The model calls the named tool (valid for its schema), gets the result, and answers."""
    first = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER, tools=TOOLS, tool_choice=GET_WEATHER,
                                           temperature=0, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), TOOLS[0]["function"]["parameters"])
    history = WEATHER + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id,
                          "content": json.dumps({"temperature": 18, "unit": "celsius", "sky": "sunny"})}]
    final = client.chat.completions.create(model=MODEL_NAME, messages=history, tools=TOOLS, temperature=0,
                                           max_tokens=40)
    assert final.choices[0].message.content and final.choices[0].message.tool_calls in (None, [])
    rendered = server.state.serving.render_chat([p for p in _chat_messages(history)], tools=None)
    assert "<tool_call>\n{\"name\": \"get_weather\"" in rendered and "<tool_response>\n{\"temperature\": 18" in rendered


def test_required_tool_calls_stream_in_openai_shapes(client):
    whole = client.chat.completions.create(model=MODEL_NAME, messages=WEATHER, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_tokens=80)
    calls = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "tool_calls" and calls
    for call in calls:
        spec = next(t for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), spec["function"]["parameters"])
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=WEATHER, tools=TOOLS,
                                                 tool_choice="required", temperature=0, max_tokens=80, stream=True))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (i, c.function.name, c.function.arguments) for i, c in enumerate(calls)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    named = list(client.chat.completions.create(model=MODEL_NAME, messages=WEATHER, tools=TOOLS,
                                                tool_choice=GET_WEATHER, temperature=0, max_tokens=60, stream=True))
    pieces = [d for c in named if c.choices for d in c.choices[0].delta.tool_calls or []]
    assert pieces[0].id.startswith("call_") and pieces[0].function.name == "get_weather" and len(pieces) > 2
    assert all(p.id is None and p.function.name is None for p in pieces[1:])
    jsonschema.validate(json.loads("".join(p.function.arguments for p in pieces)), TOOLS[0]["function"]["parameters"])


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format", "the JSON schema is invalid: Invalid type: wat"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "needs json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"description": "x" * 70000}}}},
     "response_format", "the JSON schema is 70018 bytes; at most 65536"),
    ({"response_format": {"type": "yaml"}}, "response_format", "type"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not among the tools (get_weather, get_time)"),
    ({"tool_choice": "required"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", ""),
    ({"guided_regex": "[a-"}, "guided_regex", "the regex is invalid"),
    ({"guided_choice": []}, "guided_choice", "non-empty list of strings"),
    ({"guided_choice": [""], "min_tokens": 2}, "guided_choice", "the choice matches only the empty output"),
    ({"guided_json": {"type": "object"}, "guided_regex": "a"}, None, "at most one output constraint"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "unknown field(s) jsn"),
    ({"logit_bias": {"49152": 1}}, "logit_bias", "token id 49152 is outside the vocabulary [0, 49152)"),
])
def test_bad_constraints_get_a_400_naming_the_field(server, body, param, message):
    import httpx

    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": WEATHER, "max_tokens": 4, **body})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
    server.wait_idle()


_LLM: list[LLM] = []


def _llm() -> LLM:
    if not _LLM:
        _LLM.append(LLM("smollm2-135m", dtype="float32"))
    return _LLM[0]


def _chat_messages(history):
    from llmaccel.server.chat_messages import chat_message

    return [chat_message(m) for m in history]
