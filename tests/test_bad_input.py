"""Bad input raises an error that names the problem, and the engine keeps serving everyone else."""

from __future__ import annotations

import json
import shutil

import pytest

from llmaccel.errors import CorruptCheckpointError, InvalidRequestError, ModelNotFoundError, UnsupportedModelError
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), max_model_len=64)


def test_empty_prompt(llm):
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate("", GREEDY)
    with pytest.raises(InvalidRequestError, match="the prompt is empty"):
        llm.generate([[]], GREEDY)


def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(InvalidRequestError, match=r"the prompt has 70 tokens, but max_model_len is 64"):
        llm.generate([[5] * 70], GREEDY)


def test_token_id_outside_the_vocabulary(llm):
    with pytest.raises(InvalidRequestError, match=r"token id 100000 is outside the vocabulary"):
        llm.generate([[1, 100000]], GREEDY)


def test_max_tokens_is_capped_by_the_context_window(llm):
    out = llm.generate([[5] * 60], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 4 and out.outputs[0].finish_reason == "length"


def test_a_bad_prompt_in_a_list_queues_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()


def test_errors_leave_running_requests_untouched(llm):
    engine = llm.engine
    expected = llm.generate("The quick brown fox", GREEDY)[0].outputs[0].token_ids
    engine.add_request("good", "The quick brown fox", GREEDY)
    engine.step()
    engine.step()
    for bad in ("", [5] * 80, [1, 10**6]):
        with pytest.raises(InvalidRequestError):
            engine.add_request(None, bad, GREEDY)
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("good", "again", GREEDY)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in done] == ["good"]
    assert done[0].outputs[0].token_ids == expected
    assert engine.num_free_blocks == engine.num_blocks


def test_abort_frees_blocks_and_others_finish(llm):
    engine = llm.engine
    engine.add_request("a", "The quick brown fox", GREEDY)
    engine.add_request("b", "你好，世界", GREEDY)
    engine.step()
    assert engine.num_free_blocks < engine.num_blocks
    assert engine.abort_request("a")
    assert not engine.abort_request("a")
    finished = []
    while engine.has_unfinished_requests():
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["b"] and engine.num_free_blocks == engine.num_blocks


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-1), "temperature must be >= 0"),
    (dict(top_p=0), "top_p must be in"),
    (dict(n=0), r"n must be in \[1, 1024\]"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
])
def test_invalid_sampling_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not found: give an HF directory, a .gguf file, a hub id held"):
        LLM(str(tmp_path / "no-such-model"))


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelNotFoundError, match="has no config.json"):
        LLM(str(tmp_path))


def test_truncated_safetensors(llama_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=r"model.safetensors: unreadable safetensors file"):
        LLM(str(broken))


def test_unsupported_architecture(llama_dir, tmp_path):
    other = tmp_path / "falconish"
    shutil.copytree(llama_dir, other)
    config = json.loads((other / "config.json").read_text())
    config["architectures"] = ["FalconForCausalLM"]
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match="architecture FalconForCausalLM is not supported"):
        LLM(str(other))


def test_truncated_gguf(tiny_model_dirs, tiny_tokenizer, tmp_path, monkeypatch):
    import gguf

    from tests.tiny_gguf import write_gguf

    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))  # conversion must really run
    source = tiny_model_dirs["llama-tied"]
    config = json.loads((source / "config.json").read_text())
    path = write_gguf(source, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType.Q8_0, config, tiny_tokenizer)
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 5000])
    with pytest.raises(CorruptCheckpointError, match=r"tiny.gguf: "):
        LLM(str(path))


def test_not_a_gguf_file(tmp_path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"this is not gguf at all" * 10)
    with pytest.raises(CorruptCheckpointError, match="model.gguf is not a GGUF file"):
        LLM(str(fake))


def test_unknown_engine_option(llama_dir):
    with pytest.raises(ValueError, match="unknown engine option.*max_batch"):
        LLM(str(llama_dir), max_batch=3)


def test_bad_kv_cache_memory(llama_dir):
    with pytest.raises(ValueError, match="cannot read memory size 'lots'"):
        LLM(str(llama_dir), kv_cache_memory="lots")
