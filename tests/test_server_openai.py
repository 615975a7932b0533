"""e2e: the official openai client against a live uvicorn server on a tiny random model.

Greedy outputs are checked token for token against HF transformers' own generate.
"""

from __future__ import annotations

import openai
import pytest

from tests.live_server import MODEL_NAME, live_server
from tests.tiny_models import hf_greedy

GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)


def chat_prompt_ids(server, messages) -> list[int]:
    tok = server.engine.tokenizer
    return tok.encode(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True),
                      add_special_tokens=False)


def test_chat_greedy_matches_hf_and_counts_usage(server, client, llama_dir):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=12, **GREEDY)
    prompt_ids = chat_prompt_ids(server, QUESTION)
    expected = server.engine.tokenizer.decode(hf_greedy(llama_dir, prompt_ids, 12), skip_special_tokens=True)
    choice = reply.choices[0]
    assert choice.message.content == expected
    assert choice.message.role == "assistant" and choice.finish_reason == "length" and choice.index == 0
    assert reply.object == "chat.completion" and reply.model == MODEL_NAME and reply.id.startswith("chatcmpl-")
    assert reply.usage.prompt_tokens == len(prompt_ids)
    assert reply.usage.completion_tokens == 12 and reply.usage.total_tokens == len(prompt_ids) + 12


def test_streamed_greedy_text_equals_non_streamed(client):
    full = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20, **GREEDY)
    chunks = list(client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=20, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1 and len({c.created for c in chunks}) == 1
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_string_ids_and_batch(server, client, llama_dir):
    tok = server.engine.tokenizer
    ids = tok.encode("The quick brown fox")
    expected = tok.decode(hf_greedy(llama_dir, ids, 8))
    by_text = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=8, **GREEDY)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, **GREEDY)
    assert by_text.choices[0].text == by_ids.choices[0].text == expected
    assert by_text.object == "text_completion" and by_text.usage.prompt_tokens == len(ids)
    batch = client.completions.create(model=MODEL_NAME, prompt=["The quick brown fox", "你好"], max_tokens=8, n=2,
                                      **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert batch.choices[0].text == batch.choices[1].text == expected  # greedy: both samples agree
    assert batch.usage.prompt_tokens == len(ids) + len(tok.encode("你好")) and batch.usage.completion_tokens == 32


def test_completions_stream_matches_and_default_max_tokens_is_16(client):
    full = client.completions.create(model=MODEL_NAME, prompt="Continuous batching", **GREEDY)
    parts = list(client.completions.create(model=MODEL_NAME, prompt="Continuous batching", stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in parts) == full.choices[0].text
    assert full.usage.completion_tokens == 16 and parts[-1].choices[0].finish_reason == "length"


def test_n2_sampling_gives_two_choices(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=10, n=2, temperature=1.0,
                                           seed=3, extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.choices[0].message.content != reply.choices[1].message.content
    assert reply.usage.completion_tokens == 20
    streamed = list(client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=10, n=2,
                                                   temperature=1.0, seed=3, stream=True,
                                                   extra_body={"ignore_eos": True}))
    for index in (0, 1):
        text = "".join(choice.delta.content or "" for c in streamed for choice in c.choices
                       if choice.index == index)
        assert text == reply.choices[index].message.content


def test_stop_strings_cut_the_text_in_both_modes(client):
    free = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, **GREEDY)
    text = free.choices[0].text
    stop = text[8:11]
    assert len(stop) == 3 and stop.strip()
    cut = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == text[:text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = list(client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=24,
                                              stop=stop, stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs_in_chat_and_completions(client):
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=6, logprobs=True,
                                           top_logprobs=3, **GREEDY)
    content = reply.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.logprob == pytest.approx(max(t.logprob for t in entry.top_logprobs))  # greedy takes the top
        assert bytes(entry.bytes).decode("utf-8", errors="replace") == entry.token
    raw = b"".join(bytes(entry.bytes) for entry in content)  # exact bytes, even for half a UTF-8 character
    assert raw.decode("utf-8", errors="replace").rstrip("\ufffd") == reply.choices[0].message.content.rstrip("\ufffd")
    comp = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, logprobs=2,
                                     **GREEDY)
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens).rstrip("\ufffd") == comp.choices[0].text.rstrip("\ufffd")
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert 1 <= len(top) <= 2  # keyed by text: two byte pieces may both read as U+FFFD
        assert top[token] == pytest.approx(logprob) == pytest.approx(max(top.values()))
    no_lp = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=3, **GREEDY)
    assert no_lp.choices[0].logprobs is None


def test_seed_reproducibility(client):
    def sample(seed: int) -> str:
        return client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=16, temperature=1.0,
                                              seed=seed, extra_body={"ignore_eos": True}).choices[0].message.content

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_extra_sampling_fields_are_honoured(client):
    reply = client.completions.create(model=MODEL_NAME, prompt="The quick", max_tokens=8, temperature=0.9, seed=1,
                                      extra_body={"top_k": 1, "min_p": 0.1, "repetition_penalty": 1.2,
                                                  "ignore_eos": True, "min_tokens": 8})
    greedy_like = client.completions.create(model=MODEL_NAME, prompt="The quick", max_tokens=8, temperature=0,
                                            extra_body={"repetition_penalty": 1.2, "ignore_eos": True})
    assert reply.choices[0].text == greedy_like.choices[0].text  # top_k=1 is greedy whatever the temperature


def test_logit_bias_through_the_openai_client(server, client):
    """+100 on one token makes every greedy token it; -100 on the unbiased answer's first token moves it;
    both endpoints, streamed and not; an id outside the vocabulary is a 400."""
    tok = server.engine.tokenizer
    forced = tok.encode(" Paris", add_special_tokens=False)[0]
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=4, logprobs=True,
                                           logit_bias={str(forced): 100}, **GREEDY)
    assert [t.token for t in reply.choices[0].logprobs.content] == [tok.decode([forced])] * 4
    assert all(t.logprob < 0 for t in reply.choices[0].logprobs.content)  # the model's own logprobs, not biased
    plain = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, **GREEDY)
    first = tok.encode(plain.choices[0].text, add_special_tokens=False)[0]
    banned = client.completions.create(model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6,
                                       logit_bias={str(first): -100}, **GREEDY)
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt="The quick brown fox", max_tokens=6, logit_bias={str(first): -100}, stream=True,
        **GREEDY))
    assert streamed == banned.choices[0].text != plain.choices[0].text
    assert tok.encode(banned.choices[0].text, add_special_tokens=False)[0] != first
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        client.completions.create(model=MODEL_NAME, prompt="hi", logit_bias={"99999": 1})


def test_tokenize_and_detokenize_as_vllm_has_them(server, client):
    """/tokenize gives the ids /v1/completions and /v1/chat/completions would run (the chat reply's usage
    counts the same prompt), /detokenize gives the text back; bad bodies are 400s naming the field."""
    import httpx

    tok = server.engine.tokenizer
    text = "你好，世界 and the quick brown fox"
    got = httpx.post(server.url + "/tokenize", json={"prompt": text, "return_token_strs": True}).json()
    assert got["tokens"] == tok.encode(text) and got["count"] == len(got["tokens"])
    assert got["token_strs"] == tok.convert_ids_to_tokens(got["tokens"])
    assert got["max_model_len"] == server.engine.max_model_len
    chat = httpx.post(server.url + "/tokenize", json={"model": MODEL_NAME, "messages": QUESTION}).json()
    assert chat["tokens"] == chat_prompt_ids(server, QUESTION) and chat["token_strs"] is None
    reply = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1)
    assert reply.usage.prompt_tokens == chat["count"]
    back = httpx.post(server.url + "/detokenize", json={"tokens": got["tokens"]}).json()
    assert back == {"prompt": tok.decode(got["tokens"])}
    for path, body, param, words in (
            ("/tokenize", {"prompt": "a", "messages": QUESTION}, None, "exactly one of prompt and messages"),
            ("/tokenize", {}, None, "exactly one of prompt and messages"),
            ("/tokenize", {"prompt": "a", "model": "gpt-4"}, "model", "does not exist"),
            ("/detokenize", {"tokens": [1, 99999]}, "tokens", "tokens[1]: token id 99999 is outside the vocabulary"),
            ("/detokenize", {"tokens": [-1]}, "tokens", "greater than or equal to 0")):
        answer = httpx.post(server.url + path, json=body)
        assert answer.status_code == 400, (path, body, answer.text)
        error = answer.json()["error"]
        assert words in error["message"] and error["param"] == param, (path, body, error)


def test_echo_and_prompt_logprobs_on_completions(server, client, llama_dir):
    """echo puts the prompt before the text (a token-id prompt as its text) and, with logprobs, the prompt's
    tokens before the completion's, the first one's logprob null, the others HF's; streamed, the same text;
    vLLM's prompt_logprobs gives each prompt token's entry with its rank."""
    import torch

    from tests.tiny_models import _hf_model

    tok = server.engine.tokenizer
    prompt = "The quick brown fox"
    ids = tok.encode(prompt)
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, **GREEDY).choices[0].text
    echoed = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                       **GREEDY).choices[0]
    assert echoed.text == prompt + plain
    with torch.no_grad():
        expected = torch.log_softmax(_hf_model(llama_dir)(torch.tensor([ids])).logits[0].float(), -1)
    lp = echoed.logprobs
    assert lp.tokens[:len(ids)] == [server_token_text(server, t) for t in ids] and len(lp.tokens) == len(ids) + 4
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for position in range(1, len(ids)):
        assert lp.token_logprobs[position] == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
        assert len(lp.top_logprobs[position]) <= 2
    assert lp.text_offset == sorted(lp.text_offset) and "".join(lp.tokens[:len(ids)]) == prompt
    assert lp.text_offset[len(ids)] == len(prompt)  # the completion's offsets continue after the prompt
    by_ids = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=4, echo=True, **GREEDY).choices[0]
    assert by_ids.text == tok.decode(ids) + plain
    chunks = list(client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4, echo=True, logprobs=2,
                                            stream=True, **GREEDY))
    assert "".join(c.choices[0].text for c in chunks) == echoed.text
    assert chunks[0].choices[0].text == prompt and chunks[0].choices[0].logprobs.token_logprobs[0] is None
    scored = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0,
                                       extra_body={"ignore_eos": True, "prompt_logprobs": 1}).choices[0]
    entries = scored.model_extra["prompt_logprobs"]
    assert len(entries) == len(ids) and entries[0] is None
    for position in range(1, len(ids)):
        entry = entries[position][str(ids[position])]
        assert entry["logprob"] == pytest.approx(float(expected[position - 1, ids[position]]), abs=1e-4)
        assert entry["rank"] == int((expected[position - 1] > expected[position - 1, ids[position]]).sum()) + 1
        assert entry["decoded_token"] == server_token_text(server, ids[position])
    chat = client.chat.completions.create(model=MODEL_NAME, messages=QUESTION, max_tokens=1, temperature=0,
                                          extra_body={"prompt_logprobs": 0})
    chat_ids = chat_prompt_ids(server, QUESTION)
    entries = chat.model_extra["prompt_logprobs"]
    assert len(entries) == len(chat_ids) and entries[0] is None
    assert [next(iter(e)) for e in entries[1:]] == [str(t) for t in chat_ids[1:]]  # N = 0: the token alone


def server_token_text(server, token_id: int) -> str:
    return server.engine.tokenizer.convert_tokens_to_string([server.engine.tokenizer.convert_ids_to_tokens(token_id)])


def test_models_version_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]
    import httpx

    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert "version" in httpx.get(server.url + "/version").json()
    server.wait_idle()


def test_a_stream_holding_unicode_line_separators_reads_line_by_line(server, client):
    """U+2028, U+2029 and U+0085 are line breaks to str.splitlines (so to httpx's iter_lines) but raw in
    JSON: each `data:` event stays one line, and the text comes back exact through both clients."""
    import json

    import httpx

    prompt = "one\u2028two\u2029three\x85four"
    body = {"model": MODEL_NAME, "prompt": prompt, "echo": True, "max_tokens": 2, "stream": True,
            "temperature": 0, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and all(line.startswith("data: {") for line in lines[:-1])
    text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1])
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL_NAME, prompt=prompt, echo=True, max_tokens=2, stream=True, **GREEDY))
    assert text.startswith(prompt) and text == streamed
