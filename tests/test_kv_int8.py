"""The INT8 KV cache (--kv-cache-dtype int8): its row format against the torch reference byte for byte, the
paged decode kernel on INT8 pools against attention over the dequantized rows, the pool's size, and an
engine's logits and greedy tokens against the float cache's."""

from __future__ import annotations

import pytest
import torch

from llmaccel.config import EngineConfig
from llmaccel.llm import LLM
from llmaccel.ops.attention import reference_decode_attention
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kv_int8 import dequantize_kv, kv_storage_dtype, quantize_kv
from llmaccel.sampling_params import SamplingParams


def _kernels():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine falls back to the reference")
    return kernels


def test_a_row_is_its_int8_values_then_its_float16_scale():
    x = torch.tensor([[0.0, 1.0, -2.54, 0.5], [0.0, 0.0, 0.0, 0.0]])
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (2, 6)
    scale = rows[0, 4:].view(torch.float16)
    assert float(scale) == pytest.approx(2.54 / 127, rel=1e-3)
    assert rows[0, :4].tolist() == [0, 50, -127, 25]  # round(x / scale), half to even
    assert rows[1].tolist() == [0] * 6  # an all-zero row: scale 0, values 0
    back = dequantize_kv(rows, torch.float32)
    assert (back - x).abs().max() <= float(scale) / 2 + 1e-7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_the_kernel_writes_the_references_bytes(dtype, head_dim):
    """write_kv into an int8 pool: every slot's row equals quantize_kv's, byte for byte, from strided rows of
    a fused projection; untouched slots stay zero."""
    kernels = _kernels()
    torch.manual_seed(0)
    tokens, kv_heads, num_slots = 37, 3, 64
    fused = (torch.randn(tokens, 3 * kv_heads * head_dim) * 3).to(dtype)
    k = fused[:, kv_heads * head_dim:2 * kv_heads * head_dim].view(tokens, kv_heads, head_dim)
    v = fused[:, 2 * kv_heads * head_dim:].view(tokens, kv_heads, head_dim)
    k_cache = torch.zeros(num_slots, kv_heads, head_dim + 2, dtype=torch.int8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.randperm(num_slots)[:tokens]
    kernels.write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache[slots], quantize_kv(k)) and torch.equal(v_cache[slots], quantize_kv(v))
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="slot 64 is outside the KV pool of 64"):
        kernels.write_kv(k[:1], v[:1], k_cache, v_cache, torch.tensor([64]))


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (32, 8, 64), (6, 1, 128), (10, 5, 128),
                                                                (4, 2, 16), (3, 3, 48)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_decode_kernel_attends_over_the_dequantized_rows(num_heads, num_kv_heads, head_dim, window, dtype):
    """Against plain torch attention over the same rows dequantized: every group size takes its passes
    (head_dim 64 and 128 the AVX-512 ones, 16 and 48 the portable loops), scattered block tables."""
    kernels = _kernels()
    torch.manual_seed(1)
    block_size, num_blocks = 16, 64
    k_cache = quantize_kv(torch.randn(num_blocks * block_size, num_kv_heads, head_dim))
    v_cache = quantize_kv(torch.randn(num_blocks * block_size, num_kv_heads, head_dim))
    lens = torch.tensor([1, 16, 17, 70, 150], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[: 5 * 10].view(5, 10).to(torch.int32)
    q = torch.randn(5, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, window or 0, scale)
    want = reference_decode_attention(q.float(), dequantize_kv(k_cache, torch.float32),
                                      dequantize_kv(v_cache, torch.float32), tables, lens, block_size, scale, window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)


def test_the_kernel_and_the_torch_path_agree_in_an_engine(llama_dir):
    """Greedy tokens of a chunked prompt and its continuation: the C++ path and the torch path (which
    quantizes with quantize_kv and reads with dequantize_kv) on the same int8 pool."""
    _kernels()
    prompt = list(range(5, 105))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = []
    for use_kernel in (None, False):
        llm = LLM(str(llama_dir), use_kernel=use_kernel, dtype="float32", kv_cache_dtype="int8",
                  max_num_batched_tokens=32, enable_prefix_caching=False)
        assert llm.engine.runner.model.attention.uses_kernel == (use_kernel is None)
        outs.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    assert outs[0] == outs[1]


def test_an_int8_pool_holds_the_tokens_its_bytes_allow(llama_dir):
    """The tiny llama: 2 layers x 2 KV heads x head_dim 16. float32 K and V: 512 bytes a token; int8: 16 values
    and a 2-byte scale per row, 144 bytes. 1 MiB in blocks of 16 tokens: 128 blocks against 455."""
    plain = LLM(str(llama_dir), dtype="float32", kv_cache_memory="1MiB")
    int8 = LLM(str(llama_dir), dtype="float32", kv_cache_memory="1MiB", kv_cache_dtype="int8")
    assert (plain.engine.num_blocks, int8.engine.num_blocks) == (128, 455)
    slab = int8.engine.runner.kv_slab
    assert slab.dtype == torch.int8 and slab.shape == (2, 2, 455 * 16, 2, 18)
    assert int8.engine.variant != plain.engine.variant  # prefix-cache and result-cache keys differ


def test_int8_logits_stay_close_to_the_float_caches(llama_dir):
    """A 300-token prompt in 64-token chunks (each chunk reads the earlier ones from the pool) on the tiny
    random llama (head_dim 16, peaked attention: harsher than a trained model): the prompt's perplexity under
    the int8 cache within 1% of the float32 cache's (0.19% measured), each token's logprob within 0.3 (0.16),
    0.04 on average (0.021); and they do differ (the int8 path ran)."""
    ids = [5 + (i * 7) % 300 for i in range(300)]
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    logprobs = []
    for kv_dtype in ("auto", "int8"):
        llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype=kv_dtype, max_num_batched_tokens=64)
        out = llm.generate([ids], params)[0]
        logprobs.append(torch.tensor([entry.logprob for entry in out.prompt_logprobs[1:]]))
    difference = (logprobs[0] - logprobs[1]).abs()
    assert 0 < difference.max() < 0.3 and difference.mean() < 0.04
    assert float((logprobs[0].mean() - logprobs[1].mean()).exp()) == pytest.approx(1.0, abs=0.01)


def test_a_prefix_cache_hit_reads_the_same_rows_a_cold_prefill_did(llama_dir):
    """The first chunk of a prompt attends to its keys as the pool holds them (quantized), as every later
    chunk and step does: a prompt served again from the prefix cache gives the same greedy tokens."""
    llm = LLM(str(llama_dir), dtype="float32", kv_cache_dtype="int8")
    prompt = list(range(5, 69))
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cold = llm.generate([prompt], params)[0]
    warm = llm.generate([prompt + [70, 71]], params)[0]
    again = llm.generate([prompt], params)[0]
    assert cold.num_cached_tokens == 0 and warm.num_cached_tokens == 64 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == cold.outputs[0].token_ids


def test_bad_kv_cache_dtypes_are_named_errors():
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'; choose one of auto, bf16, float32, int8, fp8"):
        EngineConfig.create(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8 .* needs a CUDA GPU .* use --kv-cache-dtype int8"):
        kv_storage_dtype("fp8", torch.bfloat16, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"--kv-cache-dtype bfloat16 differs from the model's dtype \(float32\)"):
        kv_storage_dtype("bf16", torch.float32, torch.device("cpu"))
    assert kv_storage_dtype("auto", torch.float32, torch.device("cpu")) == torch.float32
    assert kv_storage_dtype("int8", torch.bfloat16, torch.device("cpu")) == torch.int8
