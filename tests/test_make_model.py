"""`llmaccel bench make-model`: random weights at published shapes, the same model in every format."""

from __future__ import annotations

import math

import pytest

from llmaccel.bench.make_model import make_model, tensor_shapes
from llmaccel.llm import LLM
from llmaccel.model.gguf.reader import GGUFFile
from llmaccel.model.shapes import SHAPES, ModelShape
from llmaccel.model.spec import ModelSpec
from llmaccel.sampling_params import SamplingParams

TINY = ModelShape("tiny-llama", "LlamaForCausalLM", 256, 512, 2, 4, 2, 64, False, 500000.0, "a test",
                  max_position_embeddings=2048,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 512})


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_published_shape_reads_as_its_config_says(name):
    shape = SHAPES[name]
    spec = ModelSpec.from_hf_config(shape.hf_config())
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        shape.hidden_size, shape.num_layers, shape.num_heads, shape.num_kv_heads, shape.head_dim)
    matrices = sum(math.prod(d) for n, d in tensor_shapes(shape) if len(d) == 2)
    assert matrices == shape.num_parameters
    # the published counts less the vocabulary: 49,152 tokens here against their 128k-152k
    published = {"llama-1b": 1.07e9, "llama-3b": 2.97e9, "llama-8b": 7.38e9, "qwen-0.5b": 4.02e8, "qwen-7b": 6.88e9}
    assert published[name] == pytest.approx(shape.num_parameters, rel=0.01)


def test_every_format_of_a_shape_holds_the_same_model(tmp_path, monkeypatch):
    """The HF directory and the BF16 GGUF file (q/k rows permuted as llama.cpp's converter does, Llama 3's rope
    scaling as its rope_freqs tensor) give the same greedy tokens; a Q8_0 file (written here without
    llama-quantize) runs natively; every file carries the default model's tokenizer."""
    from llmaccel.ops.cpu_kernels import load_cpu_kernels

    load_cpu_kernels()  # built in the user's cache before the test moves it
    monkeypatch.setenv("PEERS_DIR", str(tmp_path / "no-peers"))
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))
    hf = make_model(TINY, "hf", tmp_path / "hf")
    bf16 = make_model(TINY, "gguf:BF16", tmp_path)
    q8 = make_model(TINY, "gguf:Q8_0", tmp_path)
    assert GGUFFile(bf16).tensors["rope_freqs.weight"].shape == (32,)
    assert {t.type_name for t in GGUFFile(q8).tensors.values() if len(t.shape) == 2} == {"Q8_0"}
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompt = list(range(300, 340))
    dense = LLM(str(hf))
    expected = dense.generate([prompt], params)[0].outputs[0].token_ids
    assert LLM(str(bf16)).generate([prompt], params)[0].outputs[0].token_ids == expected
    native = LLM(str(q8), quantization="gguf")
    assert len(native.generate([prompt], params)[0].outputs[0].token_ids) == 10
    assert native.tokenizer.chat_template == dense.tokenizer.chat_template
    assert native.tokenizer.encode("What is the capital of France?") == dense.tokenizer.encode(
        "What is the capital of France?")
    assert make_model(TINY, "gguf:Q8_0", tmp_path) == q8  # kept, not rewritten
    with pytest.raises(ValueError, match="llama-quantize, which is not built here"):
        make_model(TINY, "gguf:Q4_K_M", tmp_path)
