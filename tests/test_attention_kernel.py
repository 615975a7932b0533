"""The C++ paged decode kernel equals the plain torch reference on scattered block tables."""

from __future__ import annotations

import pytest
import torch

from llmaccel.ops.attention import (
    cached_then_causal_attention,
    decode_gather,
    gathered_decode_attention,
    reference_decode_attention,
)
from llmaccel.ops.cpu_kernels import load_cpu_kernels


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim, block_size",
                         [(9, 3, 64, 16), (4, 4, 32, 8), (8, 1, 16, 4)])
@pytest.mark.parametrize("window", [None, 1, 5, 16, 33])
def test_kernel_matches_reference(num_heads, num_kv_heads, head_dim, block_size, window):
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine falls back to the reference")
    torch.manual_seed(0)
    num_blocks = 64
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim)
    lens = torch.tensor([1, block_size, block_size + 1, 37, 5 * block_size - 3], dtype=torch.int32)
    width = int((lens.max() + block_size - 1) // block_size)
    tables = torch.randperm(num_blocks)[: len(lens) * width].view(len(lens), width).to(torch.int32)
    qkv = torch.randn(len(lens), (num_heads + 2 * num_kv_heads) * head_dim)
    q = qkv[:, : num_heads * head_dim].view(len(lens), num_heads, head_dim)  # strided rows, as the engine passes
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, window or 0, scale)
    want = reference_decode_attention(q.contiguous(), k_cache, v_cache, tables, lens, block_size, scale, window)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("head_dim, dtype", [(64, torch.float32), (16, torch.float32), (64, torch.bfloat16)])
@pytest.mark.parametrize("window", [None, 7])
def test_soft_capped_scores_match_the_torch_reference(head_dim, dtype, window):
    """Gemma 2's cap, cap * tanh(s / cap), on the scaled scores before the softmax: the kernel (tanh through
    its vectorised exp) against HF's formula in torch; a cap of 2 bites on unit-variance scores x 8."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine falls back to the reference")
    torch.manual_seed(2)
    block_size, num_blocks, heads, kv_heads = 8, 32, 4, 2
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 9, 40], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[: 3 * 5].view(3, 5).to(torch.int32)
    q = (torch.randn(3, heads, head_dim) * 8).to(dtype)
    scale, cap = head_dim**-0.5, 2.0
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, window or 0, scale, cap)
    gather = decode_gather(tables, lens, block_size, int(lens.max()), window)
    want = gathered_decode_attention(q.float(), k_cache.float(), v_cache.float(), gather, scale, cap)
    uncapped = gathered_decode_attention(q.float(), k_cache.float(), v_cache.float(), gather, scale)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
    assert (want - uncapped).abs().max() > 0.1  # the cap changed the answer


@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(9, 3, 64), (10, 2, 64), (6, 1, 128), (5, 5, 128)])
@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_width_kernel_matches_reference(num_heads, num_kv_heads, head_dim, window, dtype):
    """bf16 caches are widened in registers and a group's heads share each value row (up to four heads a
    pass at head_dim 64, two at 128): every group size takes its passes. float16 caches take the portable
    path (the AVX-512 one once read them as bf16)."""
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine falls back to the reference")
    torch.manual_seed(1)
    block_size, num_blocks = 16, 64
    k_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, num_kv_heads, head_dim).to(dtype)
    lens = torch.tensor([1, 16, 17, 70, 150], dtype=torch.int32)
    tables = torch.randperm(num_blocks)[: 5 * 10].view(5, 10).to(torch.int32)
    q = torch.randn(5, num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    got = kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block_size, window or 0, scale)
    want = reference_decode_attention(q.float(), k_cache.float(), v_cache.float(), tables, lens, block_size, scale,
                                      window)
    torch.testing.assert_close(got.float(), want, atol=1e-2, rtol=1e-2)  # the output's bf16 rounding


def test_write_kv_puts_each_row_at_its_slot():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine falls back to index_copy_")
    qkv = torch.randn(3, (4 + 2 * 2) * 8)
    k, v = qkv[:, 32:48].view(3, 2, 8), qkv[:, 48:].view(3, 2, 8)
    k_cache, v_cache = torch.zeros(10, 2, 8), torch.zeros(10, 2, 8)
    kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([7, 0, 3]))
    assert torch.equal(k_cache[[7, 0, 3]], k) and torch.equal(v_cache[[7, 0, 3]], v)
    untouched = [1, 2, 4, 5, 6, 8, 9]
    assert not k_cache[untouched].any() and not v_cache[untouched].any()
    with pytest.raises(RuntimeError, match="slot 10 is outside the KV pool of 10"):
        kernels.write_kv(k, v, k_cache, v_cache, torch.tensor([1, 2, 10]))
    assert not k_cache[untouched].any()  # nothing written when any slot is bad


def test_engine_without_kernel_gives_the_same_tokens(llama_dir):
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "你好，世界", "A"]
    with_kernel = LLM(str(llama_dir)).generate(prompts, params)
    reference = LLM(str(llama_dir), use_kernel=False)
    assert not reference.engine.runner.model.attention.uses_kernel
    assert [o.outputs[0].token_ids for o in reference.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in with_kernel]


@pytest.mark.parametrize("use_kernel", [None, False])
def test_bfloat16_runs_on_both_attention_paths(llama_dir, use_kernel):
    """The CUDA default dtype, exercised here on the CPU: both attention paths accept bfloat16."""
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    llm = LLM(str(llama_dir), dtype="bfloat16", use_kernel=use_kernel)
    assert next(iter(llm.engine.runner.kv_caches))[0].dtype == torch.bfloat16
    float32 = LLM(str(llama_dir)).generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=3,
                                                                                  ignore_eos=True))
    out = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 20
    assert out[0].outputs[0].token_ids[:3] == float32[0].outputs[0].token_ids  # rounding differs, not meaning


@pytest.mark.parametrize("window", [None, 7])
def test_fused_decode_attention_is_rope_write_and_attend(window):
    """The decode step's one-call attention equals its parts: torch RoPE, index_copy_ into the pool, the
    reference attention over the block tables."""
    from llmaccel.model.layers import RotaryEmbedding

    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("no C++ compiler here: the engine takes the unfused path")
    torch.manual_seed(1)
    heads, kv_heads, dim, block_size = 6, 2, 16, 4
    rotary = RotaryEmbedding(dim, 64, 10000.0, None, torch.float32)
    lens = torch.tensor([1, 9, 23], dtype=torch.int32)
    tables = torch.tensor([[5, 0, 0, 0, 0, 0], [1, 7, 2, 0, 0, 0], [3, 4, 6, 8, 9, 10]], dtype=torch.int32)
    positions = (lens - 1).long()
    slots = torch.stack([tables[i, p // block_size].long() * block_size + p % block_size
                         for i, p in enumerate(positions.tolist())])
    k_cache, v_cache = torch.randn(12 * block_size, kv_heads, dim), torch.randn(12 * block_size, kv_heads, dim)
    qkv = torch.randn(3, (heads + 2 * kv_heads) * dim)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    qk = rotary(positions, qkv[:, : (heads + kv_heads) * dim].view(3, -1, dim))
    want_k.index_copy_(0, slots, qk[:, heads:])
    want_v.index_copy_(0, slots, qkv[:, (heads + kv_heads) * dim:].view(3, kv_heads, dim))
    want = reference_decode_attention(qk[:, :heads].contiguous(), want_k, want_v, tables, lens, block_size,
                                      dim**-0.5, window)
    got = kernels.fused_decode_attention(qkv, heads, kv_heads, dim, positions, rotary.cos, rotary.sin, k_cache,
                                         v_cache, slots, tables, lens, block_size, window or 0, dim**-0.5)
    torch.testing.assert_close(got, want.reshape(3, heads * dim), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_cache, want_k, atol=1e-6, rtol=1e-6)
    assert torch.equal(v_cache, want_v)


@pytest.mark.parametrize("num_heads, num_kv_heads, offset, n", [(8, 2, 37, 20), (4, 4, 1, 1), (6, 1, 300, 129)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_chunk_after_cached_keys_matches_the_masked_attention(num_heads, num_kv_heads, offset, n, dtype):
    """The cached keys unmasked and the chunk's own causal, merged by log-sum-exp, equal one pass under the
    [n, offset + n] mask where query i sees keys up to offset + i (HF's chunked prefill)."""
    torch.manual_seed(0)
    q = torch.randn(1, num_heads, n, 32, dtype=dtype)
    keys = torch.randn(1, num_kv_heads, offset + n, 32, dtype=dtype)
    values = torch.randn(1, num_kv_heads, offset + n, 32, dtype=dtype)
    mask = torch.arange(offset + n)[None, :] <= torch.arange(n)[:, None] + offset
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), keys.float(), values.float(), attn_mask=mask,
                                                            scale=0.2, enable_gqa=True)
    got = cached_then_causal_attention(q, keys, values, offset, 0.2)
    assert got.dtype == dtype and got.shape == q.shape
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tolerance, rtol=tolerance)
