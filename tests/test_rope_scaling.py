"""RoPE scalings (model/rope.py) against HF transformers' logits past the trained length, --rope-scaling as an
override, and the context a model may be served at."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmaccel.config import EngineConfig
from llmaccel.llm import LLM
from llmaccel.model.rope import servable_positions
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import _common

TRAINED = 64  # the tiny models' max_position_embeddings: every prompt below runs past it


def _tiny_llama(root, tokenizer, rope: dict | None):
    config = LlamaConfig(**{**_common(tokenizer), "max_position_embeddings": TRAINED}, num_attention_heads=4,
                         num_key_value_heads=2, rope_parameters={"rope_theta": 10000.0, **(rope or {})})
    torch.manual_seed(11)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(root)
    tokenizer.save_pretrained(root)
    return model


def _assert_prompt_logprobs_match(llm: LLM, hf_model, ids: list[int], hf_extra: list[int] = ()) -> None:
    """Each prompt token's logprob against HF's; HF's pass may run `hf_extra` tokens further (causal: the
    earlier positions' logits do not see them)."""
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))[0]
    with torch.no_grad():
        expected = torch.log_softmax(hf_model(torch.tensor([ids + list(hf_extra)])).logits[0].float(), -1)
    got = torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]])
    want = expected[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("rope, length", [
    ({"rope_type": "linear", "factor": 4.0}, 200),
    ({"rope_type": "yarn", "factor": 4.0}, 200),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "beta_fast": 16,
      "attention_factor": 1.2}, 120),
    ({"rope_type": "dynamic", "factor": 2.0}, 126),
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 16}, 60),
])
def test_each_scaling_gives_hfs_logits_past_the_trained_length(tmp_path, tiny_tokenizer, rope, length):
    hf = _tiny_llama(tmp_path, tiny_tokenizer, rope)
    llm = LLM(str(tmp_path), dtype="float32")
    assert llm.engine.max_model_len == servable_positions(TRAINED, rope)
    ids = [5 + (i * 13) % 300 for i in range(length + 1)]
    # HF's dynamic base follows the length of the sequence in the pass; llmaccel's is the longest's (128 tokens)
    extra = [7] * (llm.engine.max_model_len - len(ids)) if rope["rope_type"] == "dynamic" else []
    _assert_prompt_logprobs_match(llm, hf, ids, extra)


def test_rope_scaling_replaces_the_configs(tmp_path, tiny_tokenizer):
    """A model trained at 64 positions, served with YaRN x4 from the command line: HF's logits for the same
    model with that scaling in its config, at 200 tokens."""
    yarn = {"rope_type": "yarn", "factor": 4.0}
    _tiny_llama(tmp_path / "plain", tiny_tokenizer, None)
    hf = _tiny_llama(tmp_path / "yarn", tiny_tokenizer, yarn)  # the same seed: the same weights
    llm = LLM(str(tmp_path / "plain"), dtype="float32", rope_scaling=yarn, max_model_len=256)
    assert llm.engine.max_model_len == 256
    assert "rope=" in llm.engine.variant  # prefix-cache keys differ from the unscaled model's
    _assert_prompt_logprobs_match(llm, hf, [5 + (i * 13) % 300 for i in range(200)])


def test_a_context_past_the_trained_positions_needs_a_scaling(tmp_path, tiny_tokenizer):
    _tiny_llama(tmp_path, tiny_tokenizer, None)
    with pytest.raises(ValueError, match=r"--max-model-len 200 is past the 64 positions .* was trained for; a longer "
                                         r"context needs a RoPE scaling .*--rope-scaling '\{\"rope_type\": \"yarn\", "
                                         r"\"factor\": 4\}'"):
        LLM(str(tmp_path), max_model_len=200)
    assert LLM(str(tmp_path)).engine.max_model_len == 64  # unasked: the trained length, as before
    with pytest.raises(ValueError, match="past the 256 positions .* serves with its yarn RoPE scaling; raise its"):
        LLM(str(tmp_path), rope_scaling={"rope_type": "yarn", "factor": 4}, max_model_len=300)


@pytest.mark.parametrize("bad, message", [
    ("yarn", "rope_scaling must be a JSON object"),
    ({"rope_type": "ntk", "factor": 2}, "unknown rope_type 'ntk'; choose one of linear, dynamic, yarn"),
    ({"rope_type": "yarn"}, "factor must be a positive number, got None"),
    ({"rope_type": "linear", "factor": -1}, "factor must be a positive number, got -1"),
])
def test_bad_rope_scalings_are_named_errors(bad, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig.create(rope_scaling=bad)
