"""--batch-invariant (issue 50): the ordered kernels give a row the bits the plain GEMM gives it alone, at any row
count; a prompt's chunks run as decode rows; so a greedy answer is the same alone, in any batch, in any chunking
and from a warm prefix cache. On the default model in bf16 with this machine's kernels (float32 where this CPU
has no AVX512-BF16)."""

from __future__ import annotations

import pytest
import torch

from llmaccel import LLM
from llmaccel.bench.invariance import answers
from llmaccel.ops.kernel_choice import FORCE_ENV, ORDERED_KERNELS, candidates, pack_vnni, run_bf16

ordered = set(ORDERED_KERNELS) <= set(candidates())
needs_ordered = pytest.mark.skipif(not ordered, reason="no AVX512-BF16 on this CPU: no ordered kernels")
FAST_DTYPE = "bfloat16" if ordered else "float32"


@needs_ordered
@pytest.mark.parametrize(("n", "k"), [(8, 2), (37, 96), (100, 576), (576, 1536)])
def test_the_ordered_kernels_give_every_row_the_plain_gemms_bits_alone(n, k):
    generator = torch.Generator().manual_seed(n + k)
    x = torch.randn(70, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    alone = torch.cat([run_bf16("gemm", x[i:i + 1], w) for i in range(70)])
    packed = pack_vnni(w)
    for kernel in ORDERED_KERNELS:
        for rows in (1, 2, 3, 4, 5, 17, 64, 70):
            assert torch.equal(run_bf16(kernel, x[:rows], packed, n), alone[:rows]), (kernel, rows)
    want = x.double() @ w.double().T
    torch.testing.assert_close(alone.double(), want, rtol=2**-8, atol=1e-4 * k**0.5)


def _every_configuration_agrees(model: str, dtype: str, prompts: list[list[int]], tokens: int, chunk: int) -> None:
    base = LLM(model, dtype=dtype, batch_invariant=True, enable_prefix_caching=False)
    reference = answers(base, prompts, tokens, len(prompts))
    for group in (1, 2, 16):
        assert answers(base, prompts, tokens, group) == reference, f"batches of {group}"
    chunked = LLM(model, dtype=dtype, batch_invariant=True, enable_prefix_caching=False,
                  max_num_batched_tokens=chunk)
    assert answers(chunked, prompts, tokens, len(prompts)) == reference, f"chunked prefill at {chunk}"
    cached = LLM(model, dtype=dtype, batch_invariant=True)
    assert answers(cached, prompts, tokens, len(prompts)) == reference  # the cache fills as batch-mates share
    assert answers(cached, prompts, tokens, len(prompts)) == reference, "prefix cache warm"
    assert cached.engine.prefix_cache_stats.hits > 0


@pytest.mark.parametrize("dtype", ["float32", pytest.param("bfloat16", marks=needs_ordered)])
def test_a_tiny_llamas_greedy_answers_do_not_change_with_the_load(llama_dir, dtype):
    prompts = [[5 + i, 9, 13 + i, 2, 7] * (1 + i % 4) for i in range(12)]
    _every_configuration_agrees(str(llama_dir), dtype, prompts, tokens=24, chunk=4)


@pytest.mark.slow
def test_the_default_models_64_chat_answers_do_not_change_with_the_load():
    """The issue's own check: 64 chat prompts x 128 greedy tokens, alone, in batches of 2, 16 and 64, with prefill
    chunked at 32 tokens and from a warm prefix cache: 64/64 identical."""
    from llmaccel.bench.kv_cache import _chat_prompts

    prompts = _chat_prompts(LLM("smollm2-135m", dtype=FAST_DTYPE, num_kv_blocks=8), 64)
    _every_configuration_agrees("smollm2-135m", FAST_DTYPE, prompts, tokens=128, chunk=32)


@needs_ordered
def test_batch_invariant_runs_only_ordered_kernels_and_names_what_it_cannot_run(llama_dir, monkeypatch):
    model = LLM(str(llama_dir), dtype="bfloat16", batch_invariant=True).engine.runner.model
    assert {k for _, k in model.layers[0].qkv.bf16_choice.buckets} <= set(ORDERED_KERNELS)
    assert {k for _, k in model.lm_head.bf16_choice.buckets} <= set(ORDERED_KERNELS)
    assert model.decode_stack is not None and model.decode_stack.choice.layout == "vnni"
    monkeypatch.setenv(FORCE_ENV, "stream")
    with pytest.raises(ValueError, match="'stream' is not batch-invariant: with --batch-invariant force one of "
                                         "ordered_stream, ordered_gemm"):
        LLM(str(llama_dir), dtype="bfloat16", batch_invariant=True)


def test_batch_invariant_refuses_quantized_weights_by_name(llama_dir):
    with pytest.raises(ValueError, match="--quantization int8's kernels are not batch-invariant yet"):
        LLM(str(llama_dir), quantization="int8", batch_invariant=True)


def test_the_mode_is_part_of_the_variant_that_keys_the_prefix_and_result_caches(llama_dir):
    invariant = LLM(str(llama_dir), dtype="float32", batch_invariant=True).engine
    default = LLM(str(llama_dir), dtype="float32").engine
    assert invariant.variant == default.variant + "|batch-invariant"
    assert invariant.runner.chunks_as_rows and not default.runner.chunks_as_rows
