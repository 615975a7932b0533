"""Embeddings: a prompt run through the engine and pooled (last token or mean), L2-normalized, against a pooling
of HF transformers' final hidden states; over HTTP with the official openai client, mixed with chat traffic."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.server.embeddings import model_pooling
from tests.live_server import MODEL_NAME, live_server

PROMPTS = [[5, 9, 13, 2, 7], list(range(20, 57)), [3] * 11, list(range(100, 180))]


def hf_vectors(model_dir, prompts: list[list[int]], pooling: str) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in prompts:
            hidden = model.model(torch.tensor([ids])).last_hidden_state[0]
            vectors.append(torch.nn.functional.normalize(hidden[-1] if pooling == "last" else hidden.mean(0), dim=0))
    return torch.stack(vectors)


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_pooled_vectors_match_hf_in_chunks_and_after_a_prefix_cache_hit(llama_dir, pooling):
    # 16-token steps: the 37- and 80-token prompts pool over several chunks
    llm = LLM(str(llama_dir), dtype="float32", max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(max_tokens=1, pooling=pooling)
    want = hf_vectors(llama_dir, PROMPTS, pooling)
    for _ in range(2):  # the second pass finds the prompts' blocks in the prefix cache ("last" takes them)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        got = torch.tensor([o.embedding for o in outs])
        assert got.shape == want.shape
        assert (got * want).sum(1).min() > 0.99999
        assert all(o.finished and o.outputs[0].token_ids == [] and o.outputs[0].finish_reason == "stop" for o in outs)
    assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.prefix_cache_stats.hits > 0 if pooling == "last" else llm.engine.prefix_cache_stats.hits == 0


def test_a_batch_of_embeddings_and_generations_keeps_every_generation_token_identical_to_hf(llama_dir):
    """Embedding prompts share steps with generating ones, before them in the batch: the generations still
    sample their own rows."""
    from tests.tiny_models import hf_greedy

    llm = LLM(str(llama_dir), dtype="float32")
    engine = llm.engine
    embed, generate = SamplingParams(max_tokens=1, pooling="mean"), SamplingParams(max_tokens=12, temperature=0,
                                                                                 ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"e{i}", prompt, embed)
        engine.add_request(f"g{i}", prompt[::-1], generate)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step(emit_unfinished=False)})
    for i, prompt in enumerate(PROMPTS):
        assert done[f"g{i}"].outputs[0].token_ids == hf_greedy(llama_dir, prompt[::-1], 12)
        assert done[f"e{i}"].embedding is not None and done[f"g{i}"].embedding is None


def test_bad_pooling_settings_are_named_errors(tmp_path):
    with pytest.raises(ValueError, match="pooling must be one of last, mean"):
        SamplingParams(pooling="max")
    with pytest.raises(ValueError, match="n must be 1"):
        SamplingParams(pooling="last", n=2)
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    assert model_pooling("auto", tmp_path) == "mean" and model_pooling("auto", tmp_path / "none") == "last"
    assert model_pooling("last", tmp_path) == "last"


@pytest.fixture(scope="module")
def server(llama_dir):
    with live_server(llama_dir) as live:
        yield live


def test_the_openai_client_gets_vectors_that_match_hf(server, llama_dir, tiny_tokenizer):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    texts = ["hello world", "the cat sat on the mat", "a b c d e f g"]
    ids = [tiny_tokenizer.encode(t, add_special_tokens=True) for t in texts]
    want = hf_vectors(llama_dir, ids, "last")
    as_base64 = client.embeddings.create(model=MODEL_NAME, input=texts)  # the client asks for base64
    as_floats = client.embeddings.create(model=MODEL_NAME, input=texts, encoding_format="float")
    by_ids = client.embeddings.create(model=MODEL_NAME, input=ids)
    one = client.embeddings.create(model=MODEL_NAME, input=texts[1])
    for response in (as_base64, as_floats, by_ids):
        assert [d.index for d in response.data] == [0, 1, 2] and response.model == MODEL_NAME
        got = torch.tensor([d.embedding for d in response.data])
        assert (got * want).sum(1).min() > 0.999  # the server runs the model in its default dtype
        assert response.usage.prompt_tokens == response.usage.total_tokens == sum(len(i) for i in ids)
    assert torch.tensor(one.data[0].embedding) @ want[1] > 0.999
    width = len(as_floats.data[0].embedding)
    assert client.embeddings.create(model=MODEL_NAME, input="x", dimensions=width).data  # its own width is fine


@pytest.mark.parametrize("body, words", [
    ({"input": "x", "dimensions": 8}, "dimensions 8 is not served"),
    ({"input": []}, "input must not be empty"),
    ({"input": ["ok", ""]}, "input[1] is empty"),
    ({"input": [[5, 6], [7, 10**9]]}, "input[1][1]: token id 1000000000 is outside the vocabulary"),
    ({"input": [5, -1]}, "input[1]: token id -1 is outside the vocabulary"),
    ({"input": [1] * 5000}, "input[0]:"),
    ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
])
def test_bad_embedding_requests_are_named_errors(server, body, words):
    response = httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=30)
    assert response.status_code == 400, response.text
    assert words in response.json()["error"]["message"]


def test_embeddings_count_against_the_clients_rate_limit(llama_dir):
    with live_server(llama_dir, rate_limit_requests=2) as limited:
        statuses = [httpx.post(limited.url + "/v1/embeddings", json={"model": MODEL_NAME, "input": "hi"},
                               timeout=30).status_code for _ in range(3)]
        chat = httpx.post(limited.url + "/v1/chat/completions", timeout=30,
                          json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert statuses == [200, 200, 429] and chat.status_code == 429


def test_embeddings_mixed_with_chats_are_all_answered(server):
    client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")

    async def run():
        embeds = [client.embeddings.create(model=MODEL_NAME, input=f"text number {i}") for i in range(64)]
        chats = [client.chat.completions.create(model=MODEL_NAME, max_tokens=8, temperature=0,
                                                messages=[{"role": "user", "content": f"say {i}"}]) for i in range(64)]
        return await asyncio.gather(*embeds, *chats)

    results = asyncio.run(run())
    assert all(len(r.data) == 1 and len(r.data[0].embedding) > 0 for r in results[:64])
    assert all(r.choices[0].finish_reason in ("stop", "length") for r in results[64:])
    engine = server.state.engine.engine
    assert engine.num_free_blocks == engine.num_blocks


@pytest.mark.slow
def test_the_default_model_pools_as_hf_does_in_its_own_dtype():
    """In float32 the vectors equal HF's; in the machine's default dtype (bf16 where the CPU has it) they are
    compared with HF in that dtype, since bf16 alone moves a short prompt's last state by up to ~1e-3 in cosine."""
    from llmaccel.model.loader import hf_dir_for

    texts = ["The capital of France is Paris.", "A short one", "长城是中国古代的军事防御工程。"]
    for dtype in ("float32", "auto"):
        llm = LLM("smollm2-135m", dtype=dtype)
        ids = [llm.tokenizer.encode(t) for t in texts]
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], SamplingParams(max_tokens=1, pooling="last"),
                            use_tqdm=False)
        model = AutoModelForCausalLM.from_pretrained(hf_dir_for("smollm2-135m"), dtype=llm.engine.dtype).eval()
        with torch.no_grad():
            want = torch.stack([torch.nn.functional.normalize(
                model.model(torch.tensor([i])).last_hidden_state[0, -1].float(), dim=0) for i in ids])
        got = torch.tensor([o.embedding for o in outs])
        assert (got * want).sum(1).min() > (0.9999 if dtype == "float32" else 0.999)
