"""LoRA adapters through the real server and the official openai client: a request's `model` names an adapter,
adapters and the base share batches and answer as HF + PEFT does, /v1/models lists them with their parent,
load and unload at run time, and every bad adapter or name is a 400 that leaves the server serving."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.live_server import MODEL_NAME, live_server
from tests.test_lora import ADAPTERS, make_adapter, peft_greedy

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("served-adapters")
    return {name: make_adapter(llama_dir, root / name, seed, **options)
            for seed, (name, options) in enumerate(ADAPTERS.items())}


@pytest.fixture(scope="module")
def server(llama_dir, adapters):
    options = {"lora_modules": {"r4-qv": adapters["r4-qv"], "r8-all": adapters["r8-all"]}, "enable_lora": True,
               "max_loras": 3, "max_lora_rank": 16}
    with live_server(llama_dir, engine_options=options) as live:
        yield live


def test_models_lists_the_adapters_with_their_base_as_parent(server, adapters):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [MODEL_NAME, "r4-qv", "r8-all"]
    assert cards["r4-qv"].parent == MODEL_NAME and cards["r4-qv"].root == adapters["r4-qv"]
    assert cards[MODEL_NAME].parent is None


def test_requests_for_different_adapters_share_batches_and_answer_as_peft(server, llama_dir, adapters,
                                                                          tiny_tokenizer):
    ids = tiny_tokenizer.encode(PROMPT)
    want = {name: peft_greedy(llama_dir, adapters[name], [ids], merge=False)[0] for name in ("r4-qv", "r8-all")}
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
    names = [MODEL_NAME, "r4-qv", "r8-all"] * 8

    async def run():
        return await asyncio.gather(*[client.completions.create(model=name, prompt=ids, max_tokens=16, temperature=0,
                                                                extra_body={"ignore_eos": True})
                                      for name in names])

    steps_before = server.engine.num_steps
    results = asyncio.run(run())
    assert server.engine.num_steps - steps_before < 16 * 3  # the 24 requests did share steps
    texts = {}
    for name, result in zip(names, results, strict=True):
        assert result.model == name
        texts.setdefault(name, set()).add(result.choices[0].text)
    assert all(len(t) == 1 for t in texts.values())  # every copy of a request answered alike
    for name in ("r4-qv", "r8-all"):  # the text held back at the end is an unfinished UTF-8 character
        text = tiny_tokenizer.decode(want[name], skip_special_tokens=True)
        assert {t.rstrip("\ufffd") for t in texts[name]} == {text.rstrip("\ufffd")}
    assert texts[MODEL_NAME] != texts["r4-qv"]
    server.wait_idle()


def test_load_use_and_unload_at_run_time(server, adapters, llama_dir, tiny_tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    loaded = httpx.post(server.url + "/v1/load_lora_adapter", json={"lora_name": "r16-rs",
                                                                     "lora_path": adapters["r16-rs"]})
    assert loaded.status_code == 200 and "r16-rs" in loaded.text
    ids = tiny_tokenizer.encode(PROMPT)
    answer = client.completions.create(model="r16-rs", prompt=ids, max_tokens=16, temperature=0,
                                       extra_body={"ignore_eos": True})
    want = tiny_tokenizer.decode(peft_greedy(llama_dir, adapters["r16-rs"], [ids], False)[0], skip_special_tokens=True)
    assert answer.choices[0].text.rstrip("\ufffd") == want.rstrip("\ufffd")
    unloaded = httpx.post(server.url + "/v1/unload_lora_adapter", json={"lora_name": "r16-rs"})
    assert unloaded.status_code == 200
    assert "r16-rs" not in [m.id for m in client.models.list().data]
    with pytest.raises(openai.BadRequestError, match="the model 'r16-rs' does not exist"):
        client.completions.create(model="r16-rs", prompt="hi", max_tokens=2)


@pytest.mark.parametrize("path, body, words", [
    ("load", {"lora_name": "x", "lora_path": "/nonexistent/adapter"}, "no such directory"),
    ("load", {"lora_name": MODEL_NAME, "lora_path": "/tmp"}, "is the base model's name"),
    ("load", {"lora_name": "r4-qv", "lora_path": "/tmp"}, "already loaded"),
    ("load", {"lora_name": "x"}, "lora_path: this field is required"),
    ("unload", {"lora_name": "nope"}, "no LoRA adapter named 'nope' is loaded"),
])
def test_bad_adapter_requests_are_named_errors_and_the_server_goes_on(server, path, body, words):
    response = httpx.post(f"{server.url}/v1/{path}_lora_adapter", json=body, timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    assert client.completions.create(model="r4-qv", prompt="hi", max_tokens=2).choices[0].text is not None


def test_an_adapter_over_the_rank_limit_is_refused_by_name(llama_dir, adapters):
    with live_server(llama_dir, engine_options={"enable_lora": True, "max_lora_rank": 8}) as live:
        response = httpx.post(live.url + "/v1/load_lora_adapter",
                              json={"lora_name": "big", "lora_path": adapters["r16-rs"]})
        assert response.status_code == 400
        assert "rank 16 is over --max-lora-rank 8" in response.json()["error"]["message"]


def test_runtime_loading_needs_enable_lora(llama_dir, adapters):
    with live_server(llama_dir, engine_options={"lora_modules": {"r4-qv": adapters["r4-qv"]}}) as live:
        response = httpx.post(live.url + "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": "/tmp"})
        assert response.status_code == 400 and "--enable-lora" in response.json()["error"]["message"]
        client = openai.OpenAI(base_url=live.url + "/v1", api_key="none")
        assert client.chat.completions.create(model="r4-qv", max_tokens=2,
                                              messages=[{"role": "user", "content": "hi"}]).model == "r4-qv"
