"""The bfloat16 prefill attention kernel (csrc/prefill_attention.cpp): HF's masked attention over the context
in the paged pool, and a query's result the same to the bit however the prompt is cut into chunks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from llmaccel.ops.attention import prefill_kernel
from llmaccel.ops.cpu_kernels import load_cpu_kernels

kernels = load_cpu_kernels()
attend = prefill_kernel(kernels) if kernels is not None else None
pytestmark = pytest.mark.skipif(kernels is None or not kernels.prefill_attention_available(),
                                reason="the bfloat16 prefill attention needs AVX512-BF16")


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor, window: int,
              scale: float) -> torch.Tensor:
    """float32 SDPA under HF's chunk mask: query i at position L - n + i sees keys up to there (and within
    the window)."""
    n, length = q.shape[0], slots.numel()
    keys = k_cache[slots].transpose(0, 1)[None].float()
    values = v_cache[slots].transpose(0, 1)[None].float()
    rows = torch.arange(n)[:, None] + length - n
    columns = torch.arange(length)[None, :]
    mask = columns <= rows
    if window:
        mask &= columns > rows - window
    out = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1)[None].float(), keys, values,
                                                           attn_mask=mask, scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def pool(num_slots: int, kv_heads: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(num_slots, kv_heads, dim).bfloat16(), torch.randn(num_slots, kv_heads, dim).bfloat16()


@pytest.mark.parametrize("n, length, heads, kv_heads, dim, window", [
    (5, 5, 4, 2, 64, 0),        # a whole short prompt
    (37, 100, 9, 3, 64, 0),     # the default model's heads, a chunk after 63 cached keys
    (64, 64, 32, 8, 64, 0),     # Llama-3.2-1B's heads
    (33, 200, 8, 8, 128, 0),    # head_dim 128, no grouping
    (20, 90, 12, 4, 96, 0),     # head_dim 96 (Phi-3): a 32-wide tail
    (50, 300, 4, 1, 64, 40),    # a sliding window: the first blocks are passed over
    (1, 77, 4, 4, 32, 0),       # one query
    (130, 130, 28, 4, 32, 0),   # 7 query heads a KV head
])
def test_the_kernel_is_hfs_masked_attention(n, length, heads, kv_heads, dim, window):
    torch.manual_seed(0)
    k_cache, v_cache = pool(512, kv_heads, dim)
    slots = torch.randperm(512)[:length]
    qkv = torch.randn(n, (heads + 2 * kv_heads) * dim).bfloat16()
    q = qkv[:, :heads * dim].view(n, heads, dim)  # a strided view, as the layers pass it
    got = attend(q, k_cache, v_cache, slots, window, dim**-0.5)
    assert got.dtype == torch.bfloat16 and got.shape == (n, heads, dim)
    torch.testing.assert_close(got.float(), reference(q, k_cache, v_cache, slots, window, dim**-0.5),
                               atol=1.5e-2, rtol=1.5e-2)


@pytest.mark.parametrize("window", [0, 50])
@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_a_querys_attention_does_not_depend_on_how_the_prompt_is_chunked(chunk, window):
    """A prefix-cache hit or another chunk budget gives each token the attention a whole prefill gave it."""
    torch.manual_seed(1)
    length, heads, kv_heads, dim = 300, 8, 2, 64
    k_cache, v_cache = pool(400, kv_heads, dim)
    slots = torch.randperm(400)[:length]
    q = torch.randn(length, heads, dim).bfloat16()
    whole = attend(q, k_cache, v_cache, slots, window, 0.125)
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        part = attend(q[start:end], k_cache, v_cache, slots[:end], window, 0.125)
        assert torch.equal(part, whole[start:end]), (start, end)


def test_bad_arguments_are_named_errors():
    k_cache, v_cache = pool(16, 2, 64)
    q = torch.randn(4, 4, 64).bfloat16()
    with pytest.raises(RuntimeError, match="outside the pool"):
        attend(q, k_cache, v_cache, torch.tensor([0, 1, 2, 99]), 0, 0.125)
    with pytest.raises(RuntimeError, match="must include the chunk"):
        attend(q, k_cache, v_cache, torch.tensor([0, 1]), 0, 0.125)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        attend(torch.randn(4, 4, 16).bfloat16(), *pool(16, 2, 16), torch.arange(4), 0, 0.25)
    with pytest.raises(RuntimeError, match="bfloat16"):
        attend(q.float(), k_cache, v_cache, torch.arange(4), 0, 0.125)


@pytest.fixture(scope="module")
def llama32(tmp_path_factory, tiny_tokenizer):
    """A tiny Llama whose heads are 32 wide, the kernel's narrowest."""
    config = LlamaConfig(vocab_size=len(tiny_tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         rms_norm_eps=1e-5, initializer_range=0.2, bos_token_id=tiny_tokenizer.bos_token_id,
                         eos_token_id=tiny_tokenizer.eos_token_id, pad_token_id=tiny_tokenizer.pad_token_id)
    torch.manual_seed(7)
    out = tmp_path_factory.mktemp("llama32")
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


def test_a_bfloat16_engine_prefills_with_the_kernel_as_with_torchs_attention(llama32):
    """Chunks after cached keys included (a 16-token budget): the same greedy tokens and prompt logprobs
    within bfloat16's rounding as torch's attention gives."""
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    prompt = list(range(5, 205))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, prompt_logprobs=0)
    results = []
    for use_kernel in (True, False):
        llm = LLM(str(llama32), dtype="bfloat16", max_num_batched_tokens=16, enable_prefix_caching=False)
        attention = llm.engine.runner.model.attention
        assert (attention._prefill_kernel is not None) == (prefill_kernel(kernels) is not None)
        if not use_kernel:
            attention._prefill_kernel = None
        out = llm.generate([prompt], params)[0]
        results.append((out.outputs[0].token_ids, torch.tensor([e.logprob for e in out.prompt_logprobs[1:]])))
    (tokens, logprobs), (torch_tokens, torch_logprobs) = results
    assert tokens == torch_tokens
    torch.testing.assert_close(logprobs, torch_logprobs, atol=0.1, rtol=0.05)
