"""The families beyond Llama (model/registry.py): each tiny checkpoint is made by transformers itself, and
llmaccel must match HF on it. The batching scenarios run for every family in test_matches_hf.py and the
cached prefix in test_prefix_caching.py; here: what sets the families apart, their quantized and bf16
logits, GPT-2 served to the official client, and the errors a wrong checkpoint gets."""

from __future__ import annotations

import json
import shutil

import openai
import pytest
import torch
from safetensors.torch import load_file, save_file

from llmaccel.errors import CorruptCheckpointError, UnsupportedModelError
from llmaccel.llm import LLM
from llmaccel.model.registry import model_class, supported_architectures
from llmaccel.sampling_params import SamplingParams
from tests.test_serve_cli import start_server
from tests.tiny_models import FAMILIES, _hf_model, hf_greedy

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ARCHITECTURES = {"qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM", "gemma": "GemmaForCausalLM",
                 "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM", "gpt2": "GPT2LMHeadModel"}
TEXT = ("What is the capital of France? The capital of France is Paris. Tell me a story about a dragon. "
        "北京是中国的首都。")


def _logits(llm: LLM, ids: list[int]) -> torch.Tensor:
    engine = llm.engine
    return engine.runner.model.compute_logits(engine.scorer.hidden_states(ids)).float()


@pytest.mark.parametrize("name", FAMILIES)
def test_each_family_loads_into_its_own_class_and_its_float32_logits_are_hfs(tiny_model_dirs, tiny_tokenizer, name):
    model_dir = tiny_model_dirs[name]
    assert json.loads((model_dir / "config.json").read_text())["architectures"] == [ARCHITECTURES[name]]
    llm = LLM(str(model_dir), dtype="float32")
    model = llm.engine.runner.model
    assert type(model) is model_class(ARCHITECTURES[name])
    assert type(model).__module__ == "llmaccel.model." + ("gemma" if name.startswith("gemma") else name)
    # decode steps run the C++ decode stack (tests/test_decode_stack.py holds it to the layer path), but for
    # GPT-2 (LayerNorm with bias, learned positions, a plain GELU MLP): layer by layer
    assert (model.decode_stack is not None) == (name != "gpt2" and model.attention.uses_kernel)
    ids = tiny_tokenizer.encode(TEXT)
    with torch.no_grad():
        expected = _hf_model(model_dir)(torch.tensor([ids])).logits[0].float()
    assert torch.allclose(_logits(llm, ids), expected, atol=2e-4, rtol=0), name


@pytest.mark.parametrize("name", ["gemma2", "gemma3"])
def test_windowed_families_match_hf_well_past_their_window(tiny_model_dirs, tiny_tokenizer, name):
    """One local layer (window 16) and one global: outputs stay HF's token for token far past the window,
    prefilled whole, in chunks shorter than the window, and under preemption."""
    model_dir = tiny_model_dirs[name]
    spec = LLM(str(model_dir)).engine.spec
    assert (spec.sliding_window, spec.sliding_layers, spec.kv_window) == (16, (0,), None)
    prompts = [tiny_tokenizer.encode(TEXT * 2), tiny_tokenizer.encode(TEXT[:40])]
    assert len(prompts[0]) > 3 * spec.sliding_window
    expected = [hf_greedy(model_dir, p, 40) for p in prompts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for options in ({}, {"max_num_batched_tokens": 8}, {"num_kv_blocks": 22, "block_size": 8}):
        llm = LLM(str(model_dir), **options)
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected, options
        assert llm.engine.num_free_blocks == llm.engine.num_blocks
    assert llm.engine.scheduler.num_preemptions > 0


def test_phi3s_sliding_window_slides_every_layer_and_matches_hf_past_it(tiny_model_dirs, tiny_tokenizer, tmp_path):
    """Phi-3-mini slides every layer (window 2047): the KV cache then frees the blocks the window has passed."""
    model_dir = _copy_with_config(tiny_model_dirs["phi3"], tmp_path / "phi3-window", sliding_window=16)
    prompts = [tiny_tokenizer.encode(TEXT * 2), tiny_tokenizer.encode(TEXT[:40])]
    expected = [hf_greedy(model_dir, p, 40) for p in prompts]
    llm = LLM(str(model_dir), block_size=8)
    assert llm.engine.spec.kv_window == 16
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


# The stated bound, the same for every family: the RMS error of INT8 (per-channel) logits within this fraction
# of the float logits' spread (std), and the top token kept at >= 90% of positions. Random tiny models are
# chaotic, so this is harsher than on a trained one; the Llama family's tiny models measure 4.2-4.7% here.
INT8_LOGIT_ERROR = 0.06


@pytest.mark.parametrize("name", FAMILIES)
def test_int8_and_int4_logits_stay_within_the_stated_error(tiny_model_dirs, tiny_tokenizer, name):
    ids = tiny_tokenizer.encode(TEXT)
    reference = _logits(LLM(str(tiny_model_dirs[name]), dtype="float32"), ids)
    spread = reference.std().item()
    int8 = LLM(str(tiny_model_dirs[name]), dtype="float32", quantization="int8")
    assert sum(type(m).__name__ == "Int8Linear" for m in int8.engine.runner.model.layers.modules()) == 8
    int8_logits = _logits(int8, ids)
    int8_error = (int8_logits - reference).pow(2).mean().sqrt().item() / spread
    int4 = LLM(str(tiny_model_dirs[name]), dtype="float32", quantization="int4", quant_group_size=32)
    int4_error = (_logits(int4, ids) - reference).pow(2).mean().sqrt().item() / spread
    assert int8_error < INT8_LOGIT_ERROR, (name, int8_error)
    assert (int8_logits.argmax(-1) == reference.argmax(-1)).float().mean() >= 0.9
    assert int8_error < int4_error < 10 * INT8_LOGIT_ERROR, (name, int4_error)  # INT4 is coarser, still bounded
    assert int8.generate([ids], GREEDY)[0].outputs[0].token_ids  # and it serves


@pytest.mark.parametrize("name", FAMILIES)
def test_bfloat16_runs_every_family_close_to_float32(tiny_model_dirs, tiny_tokenizer, name):
    """bf16 (the fast dtype on AMX machines) through the tuned kernels: logits near the float32 ones."""
    ids = tiny_tokenizer.encode(TEXT)
    reference = _logits(LLM(str(tiny_model_dirs[name]), dtype="float32"), ids)
    llm = LLM(str(tiny_model_dirs[name]), dtype="bfloat16", enable_prefix_caching=False)  # reruns compare to the bit
    error = (_logits(llm, ids) - reference).pow(2).mean().sqrt().item() / reference.std().item()
    assert error < INT8_LOGIT_ERROR, (name, error)  # bf16 rounds every activation: about INT8's error here
    prompts = [ids, ids[:5]]
    batched = llm.generate(prompts, GREEDY)
    assert [len(o.outputs[0].token_ids) for o in batched] == [24, 24]
    assert llm.generate([ids[:5]], GREEDY)[0].outputs[0].token_ids == batched[1].outputs[0].token_ids


def test_gpt2_loads_the_original_openai_layout_too(tiny_model_dirs, tiny_tokenizer, tmp_path):
    """The first GPT-2 conversions name tensors without `transformer.` and store no LM head (it is tied)."""
    source = tiny_model_dirs["gpt2"]
    bare = tmp_path / "gpt2-bare"
    shutil.copytree(source, bare)
    tensors = load_file(str(source / "model.safetensors"))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items() if k != "lm_head.weight"},
              str(bare / "model.safetensors"))
    ids = tiny_tokenizer.encode(TEXT)
    expected = hf_greedy(source, ids, 24)
    assert LLM(str(bare)).generate([ids], GREEDY)[0].outputs[0].token_ids == expected


def test_a_gpt2_checkpoint_served_by_llmaccel_serve_answers_the_openai_client(tiny_model_dirs, tmp_path):
    model_dir = tiny_model_dirs["gpt2"]
    expected = LLM(str(model_dir)).generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=16,
                                                                                  ignore_eos=True))[0].outputs[0]
    proc, url = start_server(["--model", str(model_dir), "--served-model-name", "tiny-gpt2",
                              "--num-kv-blocks", "64"], tmp_path / "serve.log")
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        assert [m.id for m in client.models.list().data] == ["tiny-gpt2"]
        whole = client.completions.create(model="tiny-gpt2", prompt="Once upon a time", max_tokens=16,
                                          temperature=0, extra_body={"ignore_eos": True})
        assert whole.choices[0].text == expected.text and whole.usage.completion_tokens == 16
        pieces = client.completions.create(model="tiny-gpt2", prompt="Once upon a time", max_tokens=16,
                                           temperature=0, stream=True, extra_body={"ignore_eos": True})
        assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == expected.text
        chat = client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "你好"}],
                                              max_tokens=8, temperature=0)
        streamed = client.chat.completions.create(model="tiny-gpt2", messages=[{"role": "user", "content": "你好"}],
                                                  max_tokens=8, temperature=0, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == \
            chat.choices[0].message.content
    finally:
        proc.kill()


def _copy_with_config(source, target, **changes):
    shutil.copytree(source, target)
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (target / "config.json").write_text(json.dumps(config))
    return target


def test_an_unsupported_architecture_is_an_error_listing_the_supported_ones(tiny_model_dirs, tmp_path):
    bad = _copy_with_config(tiny_model_dirs["qwen3"], tmp_path / "falcon", architectures=["FalconForCausalLM"],
                            model_type="falcon")
    with pytest.raises(UnsupportedModelError) as error:
        LLM(str(bad))
    message = str(error.value)
    assert "architecture FalconForCausalLM is not supported" in message and str(bad / "config.json") in message
    assert all(arch in message for arch in supported_architectures())


@pytest.mark.parametrize("name,field", [("qwen3", "num_attention_heads"), ("gpt2", "n_head"),
                                        ("gemma2", "num_hidden_layers"), ("phi3", "original_max_position_embeddings")])
def test_a_config_missing_a_field_its_family_needs_names_the_field(tiny_model_dirs, tmp_path, name, field):
    source = tiny_model_dirs[name]
    changes = {field: None}
    if field == "original_max_position_embeddings":  # Phi-3 keeps it in rope_parameters too
        rope = json.loads((source / "config.json").read_text())["rope_parameters"]
        changes["rope_parameters"] = {k: v for k, v in rope.items() if k != field}
    bad = _copy_with_config(source, tmp_path / name, **changes)
    with pytest.raises(CorruptCheckpointError, match=f"config.json: missing field '{field}'"):
        LLM(str(bad))


def test_a_tokenizer_that_does_not_match_the_vocabulary_is_an_error(tiny_model_dirs, tmp_path):
    bad = _copy_with_config(tiny_model_dirs["gpt2"], tmp_path / "small-vocab", vocab_size=300)
    with pytest.raises(CorruptCheckpointError, match=r"the tokenizer has \d+ tokens but the model's vocabulary "
                                                     r"\(config.json vocab_size\) is 300"):
        LLM(str(bad))


def test_weights_of_another_shape_than_the_config_are_an_error(tiny_model_dirs, tmp_path):
    bad = _copy_with_config(tiny_model_dirs["gemma"], tmp_path / "wide", vocab_size=1000)
    with pytest.raises(CorruptCheckpointError, match=r"'model.embed_tokens.weight' is \(\d+, 64\), but config.json "
                                                     r"gives vocab_size x hidden_size = \(1000, 64\)"):
        LLM(str(bad))


def test_phi3_partial_rotary_is_refused_by_name(tiny_model_dirs, tmp_path):
    source = tiny_model_dirs["phi3"]
    rope = json.loads((source / "config.json").read_text())["rope_parameters"]
    bad = _copy_with_config(source, tmp_path / "phi4", rope_parameters={**rope, "partial_rotary_factor": 0.75})
    with pytest.raises(UnsupportedModelError, match="partial_rotary_factor < 1"):
        LLM(str(bad))


@pytest.mark.parametrize("name", ["qwen3", "phi3", "gemma", "gemma2", "gemma3"])
def test_saved_quantized_checkpoints_of_other_families_reload_to_identical_outputs(tiny_model_dirs, tmp_path, name):
    from llmaccel.cli import main

    source, out = tiny_model_dirs[name], tmp_path / f"{name}-int4"
    assert main(["quantize", "--model", str(source), "--method", "int4", "--group-size", "32", "--out", str(out)]) == 0
    prompts = ["The quick brown fox", "你好，世界"]
    on_the_fly = LLM(str(source), quantization="int4", quant_group_size=32).generate(prompts, GREEDY)
    reloaded = LLM(str(out))
    assert sum(type(m).__name__ == "Int4Linear" for m in reloaded.engine.runner.model.layers.modules()) == 8
    assert [o.outputs[0].token_ids for o in reloaded.generate(prompts, GREEDY)] == \
        [o.outputs[0].token_ids for o in on_the_fly]


def test_quantize_refuses_what_it_cannot_save_by_name(tiny_model_dirs, tmp_path, capsys):
    from llmaccel.cli import main

    assert main(["quantize", "--model", str(tiny_model_dirs["gpt2"]), "--method", "int8",
                 "--out", str(tmp_path / "a")]) == 2
    assert main(["quantize", "--model", str(tiny_model_dirs["gemma2"]), "--method", "int4", "--awq",
                 "--out", str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err
    assert "is GPT-2, whose checkpoints llmaccel does not save quantized; quantize it at load" in err
    assert "AWQ runs on LlamaForCausalLM" in err and "not Gemma2ForCausalLM" in err
