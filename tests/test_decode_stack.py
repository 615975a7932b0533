"""The decode step in one C++ call (model/decode_stack.py) against the layer-by-layer path: the same
kernels in the same order, so every logit must agree to the bit, for float32, INT8 and INT4 weights,
q/k/v bias, q/k norms (Qwen3), fused projections (Phi-3), tied tables, sliding windows and batches of
sequences at different lengths."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from llmaccel import LLM
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kernel_choice import FORCE_ENV, QUANT_FORCE_ENV, candidates
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import _common

# the families whose layers the stack runs: the Llama family's, Qwen3's (q/k norms), Phi-3's, Gemma 1, 2 and 3's
# (GeGLU, the norms around attention and MLP, soft-capped scores, local rotary tables)
STACKED = ["llama-gqa", "qwen2-bias", "llama-tied", "qwen3", "phi3", "gemma", "gemma2", "gemma3"]

pytestmark = pytest.mark.skipif(not hasattr(load_cpu_kernels(), "DecodeStack"),
                                reason="C++ kernels unavailable on this machine")


class CountingStack:
    """Passes calls to the real stack and counts them, so a test knows the stack ran."""

    def __init__(self, stack) -> None:
        self.stack, self.calls = stack, 0

    def forward(self, *args):
        self.calls += 1
        return self.stack.forward(*args)


def _prompts() -> list[list[int]]:
    return [[5, 9, 13, 2, 7], list(range(20, 57)), [3] * 11]  # three lengths: tables of 1, 3 and 1 blocks


def _run(llm: LLM, prompts: list[list[int]], tokens: int) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [(o.outputs[0].token_ids, [(lp.logprob, sorted(lp.top.items())) for lp in o.outputs[0].logprobs])
            for o in outs]


def _stack_against_layers(llm: LLM, prompts: list[list[int]], tokens: int) -> None:
    """`llm` without prefix caching: the second run must compute each prompt as the first did (a cached
    prompt's last token alone runs as a decode row, whose kernel may sum in another order)."""
    assert not llm.engine.kv_cache.enable_prefix_caching
    model = llm.engine.runner.model
    assert model.decode_stack is not None, "the stack should serve this model"
    stack = model.decode_stack
    counting = stack.stack = CountingStack(stack.stack)
    with_stack = _run(llm, prompts, tokens)
    assert counting.calls >= tokens - 1  # every decode-only step
    model.decode_stack = None
    assert _run(llm, prompts, tokens) == with_stack  # token ids, logprobs and top-3 alternatives, exact
    model.decode_stack = stack


@pytest.mark.parametrize("name", STACKED)
@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
def test_the_stack_gives_the_layer_paths_logits_to_the_bit(tiny_model_dirs, name, quantization):
    llm = LLM(str(tiny_model_dirs[name]), dtype="float32", quantization=quantization, enable_prefix_caching=False)
    _stack_against_layers(llm, _prompts(), tokens=24)


def test_the_stack_keeps_to_each_layers_sliding_window(tmp_path, tiny_tokenizer):
    config = MistralConfig(**_common(tiny_tokenizer), sliding_window=16)
    torch.manual_seed(7)
    MistralForCausalLM(config).eval().save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", enable_prefix_caching=False)
    assert all(layer.window == 16 for layer in llm.engine.runner.model.layers)
    _stack_against_layers(llm, _prompts(), tokens=40)  # every sequence decodes far past its window


@pytest.mark.parametrize("name", STACKED)
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_bfloat16_steps_of_few_rows_take_the_stack_to_the_bit(tiny_model_dirs, name, quantization):
    # no prefix cache: the second run must prefill as the first did (oneDNN's bf16 sums depend on the rows)
    llm = LLM(str(tiny_model_dirs[name]), dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    model = llm.engine.runner.model
    stack = model.decode_stack
    assert stack.dtype == torch.bfloat16
    first = model.layers[0].qkv
    assert stack.choice is (first.bf16_choice if quantization is None else first.batch_choice)
    _stack_against_layers(llm, _prompts()[:2], tokens=24)


def test_a_bfloat16_model_with_an_int8_table_runs_in_bfloat16(tiny_model_dirs):
    """The INT8 table's rows come back in float32; the residual stream must still be bfloat16."""
    llm = LLM(str(tiny_model_dirs["llama-tied"]), dtype="bfloat16", quantization="int8", quantize_embedding=True,
              enable_prefix_caching=False)
    _stack_against_layers(llm, _prompts(), tokens=16)


@pytest.mark.parametrize("name", ["llama-gqa", "qwen3", "gemma2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_an_int8_kv_cache_takes_the_stack_to_the_bit(tiny_model_dirs, name, dtype):
    """The stack quantizes each new row into the INT8 pool and attends over it as the layer path's kernels do."""
    llm = LLM(str(tiny_model_dirs[name]), dtype=dtype, kv_cache_dtype="int8", enable_prefix_caching=False)
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.int8
    _stack_against_layers(llm, _prompts()[:2], tokens=24)


def test_an_int8_kv_cache_at_head_dim_64_takes_the_stack_to_the_bit(tmp_path, tiny_tokenizer):
    """head_dim 64: the INT8 attention's AVX-512 passes (the tiny families' 16 take the portable loops)."""
    config = LlamaConfig(**{**_common(tiny_tokenizer), "hidden_size": 128}, num_attention_heads=2,
                         num_key_value_heads=1)
    torch.manual_seed(3)
    LlamaForCausalLM(config).eval().save_pretrained(tmp_path)
    tiny_tokenizer.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), dtype="bfloat16", kv_cache_dtype="int8", enable_prefix_caching=False)
    assert llm.engine.runner.kv_caches[0][0].shape[1:] == (1, 66)
    _stack_against_layers(llm, _prompts(), tokens=24)


@pytest.mark.parametrize("name", STACKED)
@pytest.mark.parametrize("kernel", ["stream", "gemm", "onednn", "vnni_stream", "brgemm", "compact_stream",
                                    "compact_gemm"])
def test_bfloat16_batches_take_the_stack_to_the_bit_with_each_kernel(tiny_model_dirs, name, kernel, monkeypatch):
    """Three sequences decode together: the stack streams, runs the AVX512-BF16 GEMM inside its region, or
    calls oneDNN between its phases, as the layer path does at the same rows; with the weights packed for
    AMX it streams them or runs oneDNN's brgemm inside its region; in the compact layout it decodes them."""
    if kernel not in candidates():
        pytest.skip(f"no {kernel} kernel on this CPU")
    monkeypatch.setenv(FORCE_ENV, kernel)
    llm = LLM(str(tiny_model_dirs[name]), dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.decode_stack.choice.kernel(3) == kernel == model.layers[1].mlp.down.bf16_choice.kernel(3)
    _stack_against_layers(llm, _prompts(), tokens=24)


@pytest.mark.parametrize("name", STACKED)
@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantized_bfloat16_batches_take_the_stack_to_the_bit_on_amx(tiny_model_dirs, name, quantization,
                                                                      monkeypatch):
    """INT8/INT4 weights dequantized a block at a time for AMX tiles: the stack and the layer path alike."""
    if "brgemm" not in candidates():
        pytest.skip("no AMX kernels on this CPU")
    monkeypatch.setenv(QUANT_FORCE_ENV, "dequant_amx")
    llm = LLM(str(tiny_model_dirs[name]), dtype="bfloat16", quantization=quantization, enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.decode_stack.choice.kernel(3) == "dequant_amx" == model.layers[1].mlp.down.batch_choice.kernel(3)
    _stack_against_layers(llm, _prompts(), tokens=24)


def test_a_kernel_that_does_not_read_the_stacks_weights_is_refused_by_name(tiny_model_dirs, monkeypatch):
    if "brgemm" not in candidates():
        pytest.skip("no AMX kernels on this CPU")
    monkeypatch.setenv(FORCE_ENV, "brgemm")
    packed = LLM(str(tiny_model_dirs["llama-gqa"]), dtype="bfloat16").engine.runner.model
    monkeypatch.setenv(FORCE_ENV, "stream")
    plain = LLM(str(tiny_model_dirs["llama-gqa"]), dtype="bfloat16").engine.runner.model
    spec = plain.spec
    pools = [torch.zeros(64, spec.num_kv_heads, spec.head_dim, dtype=torch.bfloat16)] * spec.num_layers
    hidden = torch.zeros(1, spec.hidden_size, dtype=torch.bfloat16)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)

    def step(model, kernel):
        model.decode_stack.stack.forward(hidden, torch.zeros(1, dtype=torch.long), model.rotary.cos, model.rotary.sin,
                                         pools, pools, torch.tensor([0]), table, lens, 16, kernel, False)

    with pytest.raises(RuntimeError, match="bfloat16 kernel 'stream' does not read this stack's packed weights"):
        step(packed, "stream")
    with pytest.raises(RuntimeError, match="bfloat16 kernel 'brgemm' does not read this stack's plain weights"):
        step(plain, "brgemm")
    with pytest.raises(RuntimeError, match="kernel 'dequant_amx' reads INT8, INT4 and K-quant weights only"):
        step(plain, "dequant_amx")
    step(packed, "brgemm")
    step(plain, "stream")  # and each with its own kind, well formed, runs


def test_a_step_the_stack_cannot_read_is_refused_with_the_reason(tiny_model_dirs):
    llm = LLM(str(tiny_model_dirs["llama-gqa"]), dtype="float32")
    model = llm.engine.runner.model
    spec = model.spec
    pool = torch.zeros(64, spec.num_kv_heads, spec.head_dim)
    pools = [pool] * spec.num_layers
    hidden = torch.zeros(1, spec.hidden_size)
    table, lens = torch.zeros(1, 4, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    position = torch.zeros(1, dtype=torch.long)
    cos, sin = model.rotary.cos, model.rotary.sin

    def step(positions=position, slots=None, tables=table, k_pools=pools, kernel="stream"):
        slots = torch.tensor([0]) if slots is None else slots
        model.decode_stack.stack.forward(hidden, positions, cos, sin, k_pools, k_pools, slots, tables, lens, 16,
                                         kernel, False)

    with pytest.raises(RuntimeError, match="slot 64 is outside the KV pool of 64"):
        step(slots=torch.tensor([64]))
    with pytest.raises(RuntimeError, match="position 100000 is outside the rotary table"):
        step(positions=torch.tensor([100000]))
    with pytest.raises(RuntimeError, match="block 9 is outside the KV pool"):
        step(tables=table + 9)
    with pytest.raises(RuntimeError, match="one K and one V pool a layer"):
        step(k_pools=pools[:1])
    with pytest.raises(RuntimeError, match="unknown bfloat16 kernel 'fastest' \\(stream, gemm, onednn, vnni_stream, "):
        step(kernel="fastest")
    step()  # and the same step, well formed, runs
