"""Weight-only INT8 / INT4: packing round trips exactly, each quantized linear matches its
dequantized float reference to rounding, and a quantized tiny model runs through the whole engine."""

from __future__ import annotations

import pytest
import torch

from llmaccel.llm import LLM
from llmaccel.ops.gemv import gemv_kernels
from llmaccel.ops.quant_linear import Int4Linear, Int8Linear, int4_kernel_available, int8_kernel_available
from llmaccel.quantization.formats import Int8Weight, pack_int4, quantize_int4, quantize_int8, unpack_int4
from llmaccel.quantization.perplexity import weight_bytes
from llmaccel.sampling_params import SamplingParams

CPU = torch.device("cpu")


def test_int4_pack_unpack_round_trips_exactly():
    q = torch.randint(0, 16, (7, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    packed = pack_int4(q)
    assert packed.shape == (7, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), q)
    assert packed[0, 0].item() == q[0, 0].item() | (q[0, 1].item() << 4)  # even column in the low nibble
    with pytest.raises(ValueError, match="even number"):
        pack_int4(q[:, :63])


def test_quantizers_reconstruct_within_half_a_step():
    w = torch.randn(24, 128, generator=torch.Generator().manual_seed(1))
    w8 = quantize_int8(w)
    assert w8.q.dtype == torch.int8 and w8.q.abs().max() == 127  # the largest weight of a row maps to +-127
    assert ((w8.dequantize() - w) .abs() <= w8.scale[:, None] / 2 + 1e-6).all()
    for group in (32, 64, 128):
        w4 = quantize_int4(w, group)
        assert w4.packed.shape == (24, 64) and w4.scale.shape == (24, 128 // group)
        step = w4.scale.repeat_interleave(group, dim=1)
        assert ((w4.dequantize() - w).abs() <= step / 2 + 1e-5).all()
        assert w4.nbytes < w.numel() * w.element_size() / 5  # really packed: under a fifth of float32


def test_quantizing_a_slice_of_rows_at_a_time_gives_the_whole_matrixs_bits(monkeypatch):
    """Each row's codes depend on that row alone: slices of 7 rows (the last one short) give what one pass gives."""
    from llmaccel.quantization import formats

    w = torch.randn(45, 128, generator=torch.Generator().manual_seed(2)).bfloat16()
    whole8, whole4 = quantize_int8(w), quantize_int4(w, 32)
    monkeypatch.setattr(formats, "QUANTIZE_ROWS", 7)
    sliced8, sliced4 = quantize_int8(w), quantize_int4(w, 32)
    assert torch.equal(sliced8.q, whole8.q) and torch.equal(sliced8.scale, whole8.scale)
    assert all(torch.equal(a, b) for a, b in zip((sliced4.packed, sliced4.scale, sliced4.zero),
                                                 (whole4.packed, whole4.scale, whole4.zero), strict=True))


def test_group_size_must_divide_the_layer():
    with pytest.raises(ValueError, match="group size 128 does not divide the 576 input features of qkv"):
        quantize_int4(torch.randn(8, 576), 128, "qkv")
    with pytest.raises(ValueError, match="must be one of"):
        quantize_int4(torch.randn(8, 96), 48)


@pytest.mark.parametrize("use_kernel", [True, False])
def test_int8_linear_matches_its_dequantized_reference(use_kernel):
    if use_kernel and not int8_kernel_available():
        pytest.skip("no int8 weight-only kernel in this torch build")
    g = torch.Generator().manual_seed(2)
    w, bias, x = torch.randn(96, 64, generator=g), torch.randn(96, generator=g), torch.randn(5, 64, generator=g)
    qw = quantize_int8(w)
    layer = Int8Linear(qw, bias, CPU, use_kernel=use_kernel)
    want = x @ qw.dequantize().t() + bias
    tolerance = 1e-2 * want.abs().max() if use_kernel else 1e-4  # the kernel rounds x and its output to bf16
    assert (layer(x) - want).abs().max() <= tolerance
    assert layer(x).dtype == torch.float32


@pytest.mark.parametrize("use_kernel", [True, False])
def test_grouped_int8_linear_matches_its_dequantized_reference(use_kernel):
    """GGUF Q8_0's layout: one scale per 32 inputs."""
    if use_kernel and not int8_kernel_available():
        pytest.skip("no int8 weight-only kernel in this torch build")
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (80, 128), dtype=torch.int8, generator=g)
    weight = Int8Weight(q, (torch.rand(80, 4, generator=g) / 100 + 1e-3).half().float(), 32)  # Q8_0's d: float16
    x = torch.randn(5, 128, generator=g)
    layer = Int8Linear(weight, None, CPU, use_kernel=use_kernel)
    want = x @ weight.dequantize().t()
    tolerance = 1e-2 * want.abs().max() if use_kernel else 1e-4
    assert (layer(x) - want).abs().max() <= tolerance
    # streamed: the blocks hold the scales as float16, 2 bytes each (float32 before: 8.5 bits a weight, not 9)
    assert layer.weight_bytes == 80 * 128 + 80 * 4 * (2 if layer.streams else 4)


def test_grouped_int8_scales_that_float16_would_round_are_not_streamed():
    g = torch.Generator().manual_seed(4)
    q = torch.randint(-127, 128, (32, 64), dtype=torch.int8, generator=g)
    weight = Int8Weight(q, torch.full((32, 2), 1e-5) + torch.rand(32, 2, generator=g) * 1e-6, 32)
    layer = Int8Linear(weight, None, CPU)
    assert not layer.streams  # float16 would lose these scales' low bits (1e-5 is subnormal there)
    ids = torch.tensor([1, 31])
    assert torch.equal(layer.rows(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("group", [None, 32])
def test_int8_rows_are_the_dequantized_rows(group):
    """The embedding lookup on an INT8 table reads exactly the dequantized rows."""
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (50, 64), dtype=torch.int8, generator=g)
    scale = torch.rand(50, generator=g) if group is None else torch.rand(50, 2, generator=g).half().float()
    weight = Int8Weight(q, scale, group)
    ids = torch.tensor([3, 0, 49, 3])
    layer = Int8Linear(weight, None, CPU)
    assert layer.streams == (gemv_kernels() is not None)
    assert torch.equal(layer.rows(ids), weight.dequantize()[ids])


@pytest.mark.parametrize("use_kernel", [True, False])
@pytest.mark.parametrize("group", [32, 64])
def test_int4_linear_matches_its_dequantized_reference(use_kernel, group):
    if use_kernel and not int4_kernel_available():
        pytest.skip("no int4 weight-only kernel in this torch build")
    g = torch.Generator().manual_seed(3)
    w, x = torch.randn(80, 128, generator=g), torch.randn(4, 128, generator=g)
    qw = quantize_int4(w, group)
    layer = Int4Linear(qw, None, CPU, use_kernel=use_kernel)
    want = x @ qw.dequantize().t()
    tolerance = 1e-2 * want.abs().max() if use_kernel else 1e-4
    assert (layer(x) - want).abs().max() <= tolerance
    assert layer.weight_bytes < w.numel() * 4 / 5


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantized_model_runs_through_the_engine_batched_and_preempted(llama_dir, method):
    """Greedy outputs of a quantized tiny model are the same alone, in a batch, and under preemption."""
    prompts = ["The quick brown fox", "你好，世界", "Continuous batching packs", "A paged KV cache"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    alone = [LLM(str(llama_dir), quantization=method, quant_group_size=32).generate(p, params)[0]
             for p in prompts[:1]]
    batched = LLM(str(llama_dir), quantization=method, quant_group_size=32).generate(prompts, params)
    squeezed = LLM(str(llama_dir), quantization=method, quant_group_size=32, num_kv_blocks=12, block_size=4)
    preempted = squeezed.generate(prompts, params)
    assert squeezed.engine.scheduler.num_preemptions > 0
    assert batched[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert [o.outputs[0].token_ids for o in preempted] == [o.outputs[0].token_ids for o in batched]
    modules = list(squeezed.engine.runner.model.modules())
    quantized = Int8Linear if method == "int8" else Int4Linear
    assert sum(isinstance(m, quantized) for m in modules) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers


def test_unknown_method_is_a_clear_error(llama_dir):
    with pytest.raises(ValueError, match="unknown quantization method 'int3'; choose int8, int4 or gguf"):
        LLM(str(llama_dir), quantization="int3")


@pytest.mark.parametrize("name", ["llama-tied", "llama-gqa"])
def test_quantized_embedding_is_int8_and_tied_tables_are_one_copy(tiny_model_dirs, name):
    model_dir = tiny_model_dirs[name]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "你好，世界", "A paged KV cache"]
    plain = LLM(str(model_dir), quantization="int4", quant_group_size=32)
    llm = LLM(str(model_dir), quantization="int4", quant_group_size=32, quantize_embedding=True)
    model = llm.engine.runner.model
    assert isinstance(model.embedding, Int8Linear) and isinstance(model.lm_head, Int8Linear)
    assert (model.lm_head is model.embedding) == (name == "llama-tied")
    vocab, hidden = model.embedding.out_features, model.embedding.in_features
    float_model = plain.engine.runner.model
    float_tables = sum(weight_bytes(table) for table in {float_model.embedding, float_model.lm_head})
    if name == "llama-tied" and gemv_kernels() is not None:  # the float tied table is one copy too
        assert float_model.lm_head is float_model.embedding and float_tables == -(-vocab // 16) * 16 * hidden * 4
    int8_tables = (vocab * hidden + vocab * 4) * (1 if name == "llama-tied" else 2)
    assert weight_bytes(float_model) - weight_bytes(model) == float_tables - int8_tables
    batched = llm.generate(prompts, params)
    assert llm.generate(prompts[1], params)[0].outputs[0].token_ids == batched[1].outputs[0].token_ids


@pytest.mark.parametrize("method,group,embedding", [("int8", None, False), ("int4", 32, False), ("int4", 32, True)])
def test_saved_quantized_checkpoint_reloads_to_identical_outputs(llama_dir, tmp_path, method, group, embedding):
    from llmaccel.cli import main

    out = tmp_path / f"tiny-{method}"
    args = ["quantize", "--model", str(llama_dir), "--method", method, "--out", str(out)]
    args += (["--group-size", str(group)] if group else []) + (["--quantize-embedding"] if embedding else [])
    assert main(args) == 0
    assert (out / "llmaccel_quantization.json").is_file() and (out / "tokenizer.json").is_file()
    assert (out / "model.safetensors").stat().st_size < (llama_dir / "model.safetensors").stat().st_size
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The quick brown fox", "你好，世界"]
    on_the_fly = LLM(str(llama_dir), quantization=method, quant_group_size=group,
                     quantize_embedding=embedding).generate(prompts, params)
    reloaded = LLM(str(out))
    model = reloaded.engine.runner.model
    quantized = Int8Linear if method == "int8" else Int4Linear
    assert sum(isinstance(m, quantized) for m in model.layers.modules()) == 8
    assert isinstance(model.embedding, Int8Linear) == embedding and isinstance(model.lm_head, Int8Linear) == embedding
    assert [o.outputs[0].token_ids for o in reloaded.generate(prompts, params)] == \
        [o.outputs[0].token_ids for o in on_the_fly]
    with pytest.raises(ValueError, match=f"already quantized to {method}"):
        LLM(str(out), quantization="int8" if method == "int4" else "int4")


def test_quantize_command_errors_are_clear(llama_dir, tmp_path, capsys):
    from llmaccel.cli import main

    assert main(["quantize", "--model", str(llama_dir), "--method", "int3", "--out", str(tmp_path / "a")]) == 2
    assert main(["quantize", "--model", str(llama_dir), "--method", "int4", "--group-size", "128",
                 "--out", str(tmp_path / "b")]) == 2
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("x")
    assert main(["quantize", "--model", str(llama_dir), "--method", "int8", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "unknown quantization method 'int3'" in err
    assert "INT4 group size 128 does not divide the 64 input features of model.layers.0." in err
    assert "exists and is not empty" in err
