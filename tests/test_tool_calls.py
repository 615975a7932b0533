"""Tool calling without a model: the Hermes parser whole and streamed, tool_choice into constraints and
errors, and the tools in the prompt (the model's template or the Hermes fallback)."""

from __future__ import annotations

import json

import pytest

from llmaccel.errors import InvalidRequestError
from llmaccel.server import protocol as p
from llmaccel.server.chat_messages import AssistantTurn, FunctionCall, ToolCall, ToolMessage, UserMessage, chat_message
from llmaccel.server.tools import ToolCallStream, assistant_message, chat_turns, tool_plan
from llmaccel.structured.tool_parsers import HermesToolParser, ParsedCall, tool_parser

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time"}}
TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
        '<tool_call>{"name": "get_time", "arguments": "{\\"city\\": \\"Oslo\\"}"}</tool_call> Done <b>.')
CALLS = [ParsedCall("get_weather", '{"city": "Paris"}'), ParsedCall("get_time", '{"city": "Oslo"}')]


def request(**fields) -> p.ChatCompletionRequest:
    return p.ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def test_hermes_extracts_every_call_and_keeps_the_rest_as_content():
    extracted = HermesToolParser().extract(TEXT)
    assert extracted.calls == CALLS
    assert extracted.content == "Let me look.\n\n Done <b>."
    assert HermesToolParser().extract("no calls here").content == "no calls here"
    broken = HermesToolParser().extract('<tool_call>{"name": oops}</tool_call>')
    assert broken.calls == [] and broken.content == '<tool_call>{"name": oops}</tool_call>'


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_hermes_streamed_in_any_pieces_gives_the_same(piece):
    stream = HermesToolParser().stream()
    content, calls = "", []
    for start in range(0, len(TEXT), piece):
        text, found = stream.push(TEXT[start:start + piece])
        assert "<tool_call" not in text and "<tool" not in text.removesuffix("<b>.")
        content, calls = content + text, calls + found
    rest, tail = stream.finish()
    assert calls + tail == CALLS and content + rest == "Let me look.\n\n Done <b>."


def test_an_unclosed_call_at_the_end_still_counts_when_whole():
    stream = HermesToolParser().stream()
    assert stream.push('<tool_call>{"name": "get_time", "arguments": {}}') == ("", [])
    assert stream.finish() == ("", [ParsedCall("get_time", "{}")])


def test_tool_choice_becomes_the_constraint():
    assert tool_plan(request(tools=[WEATHER])).mode == "auto" and tool_plan(request(tools=[WEATHER])).constraint is None
    assert tool_plan(request(tools=[WEATHER], tool_choice="none")) is None and tool_plan(request()) is None
    named = tool_plan(request(tools=[WEATHER, TIME], tool_choice={"type": "function",
                                                                   "function": {"name": "get_weather"}}))
    assert json.loads(named.constraint.json) == WEATHER["function"]["parameters"] and named.named == "get_weather"
    required = tool_plan(request(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(required.constraint.json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][1]["properties"]["parameters"] == {"type": "object"}


@pytest.mark.parametrize(("fields", "param", "message"), [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     r"'nope', which is not among the tools \(get_weather\)"),
    ({"tool_choice": "auto"}, "tool_choice", "tool_choice needs tools"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "two functions share a name"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "cannot be combined"),
])
def test_bad_tool_use_names_the_field(fields, param, message):
    with pytest.raises(InvalidRequestError, match=message) as info:
        tool_plan(request(**fields))
    assert info.value.param == param


def test_replies_carry_calls_and_finish_with_tool_calls():
    auto = tool_plan(request(tools=[WEATHER, TIME]))
    message, finish = assistant_message(auto, HermesToolParser(), TEXT, "stop")
    assert finish == "tool_calls" and [(c.function.name, c.function.arguments) for c in message.tool_calls] == [
        (c.name, c.arguments) for c in CALLS]
    assert len({c.id for c in message.tool_calls}) == 2 and message.content == "Let me look.\n\n Done <b>."
    assert assistant_message(auto, HermesToolParser(), "plain", "length")[1] == "length"
    named = tool_plan(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    message, finish = assistant_message(named, HermesToolParser(), '{"city": "Rome"}', "stop")
    assert message.content is None and message.tool_calls[0].function.arguments == '{"city": "Rome"}'
    cut, finish = assistant_message(named, HermesToolParser(), '{"city": "Ro', "length")
    assert cut.tool_calls == [] and cut.content == '{"city": "Ro' and finish == "length"


def test_a_named_call_streams_its_arguments_after_one_header():
    named = tool_plan(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    stream = ToolCallStream(named, HermesToolParser())
    first = stream.push('{"ci', False)[1]
    assert first[0]["id"].startswith("call_") and first[0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert stream.push('ty": "Rome"}', True) == (None, [{"index": 0, "function": {"arguments": 'ty": "Rome"}'}}])
    required = ToolCallStream(tool_plan(request(tools=[WEATHER], tool_choice="required")), HermesToolParser())
    assert required.push('[{"name": "get_weather", ', False) == (None, [])
    (call,) = required.push('"parameters": {"city": "Rome"}}]', True)[1]
    assert call["index"] == 0 and call["function"] == {"name": "get_weather", "arguments": '{"city": "Rome"}'}


def test_tools_are_written_in_the_hermes_format_where_the_template_has_none():
    history = [UserMessage(role="user", content="Weather in Paris?"),
               AssistantTurn(role="assistant", content=None, tool_calls=[ToolCall(
                   id="call_1", function=FunctionCall(name="get_weather", arguments='{"city": "Paris"}'))]),
               ToolMessage(role="tool", content='{"sky": "sunny"}', tool_call_id="call_1")]
    turns = chat_turns(history, tool_plan(request(tools=[WEATHER])), native=False)
    assert turns[0]["role"] == "system" and '<tools>\n{"type": "function", "function": {"name": "get_weather"' \
        in turns[0]["content"]
    assert turns[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                        '{"city": "Paris"}}\n</tool_call>'}
    assert turns[3] == {"role": "user", "content": '<tool_response>\n{"sky": "sunny"}\n</tool_response>'}
    native = chat_turns(history, None, native=True)
    assert native[1]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert native[2] == {"role": "tool", "content": '{"sky": "sunny"}', "tool_call_id": "call_1"}


def test_tool_fields_on_another_role_are_unknown_fields_not_calls():
    """The API fuzz sent a user turn with "tool_calls": ["x"]: an unknown field there (ignored, logged), never a
    call to write into the prompt (it was a 500)."""
    history = [chat_message({"role": "user", "content": "Hi", "tool_calls": ["x"], "tool_call_id": 7})]
    for native in (False, True):
        assert chat_turns(history, None, native=native) == [{"role": "user", "content": "Hi"}]


def test_an_unknown_parser_is_an_error_listing_the_known():
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes"):
        tool_parser("mistral")


TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {% for t in tools %}{{ t.function.name }};{% endfor %}<|im_end|>\n"
    "{% endif %}{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% if message.tool_calls %}{% for c in message.tool_calls %}[call {{ c.function.name }} "
    "{{ c.function.arguments.city }}]{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_reads_tools_renders_them_itself(llama_dir, tmp_path):
    """The tools and an earlier call reach the model's own template (arguments as an object), not the
    Hermes fallback: the prompt the server ran is the template's, token for token."""
    import shutil

    import openai
    from transformers import AutoTokenizer

    from tests.live_server import MODEL_NAME, live_server

    model_dir = tmp_path / "tools-template"
    shutil.copytree(llama_dir, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.chat_template = TOOLS_TEMPLATE
    tokenizer.save_pretrained(model_dir)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    with live_server(model_dir) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.chat.completions.create(model=MODEL_NAME, messages=messages, tools=[WEATHER, TIME],
                                               max_tokens=2, temperature=0)
    rendered = tokenizer.apply_chat_template(
        [messages[0], {**messages[1], "tool_calls": [{**messages[1]["tool_calls"][0], "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]}, messages[2]],
        tools=[WEATHER, TIME], tokenize=False, add_generation_prompt=True)
    assert "Tools: get_weather;get_time;" in rendered and "[call get_weather Paris]" in rendered
    assert reply.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
