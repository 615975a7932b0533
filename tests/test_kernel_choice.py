"""The bfloat16 kernels a model's projections run (ops/kernel_choice.py): llmaccel's AVX512-BF16 GEMM
against float64, each kernel's choice by row count, the timing cached per machine and model, and the
forced choice rejected by name when this CPU lacks it."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from llmaccel import LLM
from llmaccel.ops import kernel_choice
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.kernel_choice import (
    FORCE_ENV,
    PACKED_KERNELS,
    Bf16Choice,
    candidates,
    pack_vnni,
    run_bf16,
    tune_bf16,
)

needs_gemm = pytest.mark.skipif("gemm" not in candidates(), reason="no AVX512-BF16 GEMM on this CPU")
needs_packed = pytest.mark.skipif("brgemm" not in candidates(), reason="torch's brgemm cannot pack bf16 here (no AMX)")


@needs_gemm
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(8, 2), (37, 96), (300, 576), (576, 1536)])
def test_the_gemm_matches_float64(rows, n, k):
    generator = torch.Generator().manual_seed(rows * n)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    got = load_cpu_kernels().gemm_bf16(x, w)
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # float32 sums of exact bf16 products, rounded once to bf16: within half a bf16 ulp and the sums' error
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4 * k**0.5)


@needs_gemm
@pytest.mark.parametrize("n", [200, 37])  # up to 32 rows tiles of 8 columns, then of 4 and 1 (37 = 4 x 8 + 4 + 1)
# 70 rows: a tile of 64 and one of 16; 40: one of 48; 100 at K = 4,096: chunks of 32 rows, each over passes of
# 32 columns (gemm_bf16.cpp)
@pytest.mark.parametrize(("rows", "k"), [(70, 576), (40, 576), (100, 4096)])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(n, rows, k):
    x = torch.randn(rows, k).to(torch.bfloat16)
    w = torch.randn(n, k).to(torch.bfloat16)
    gemm = load_cpu_kernels().gemm_bf16
    batch = gemm(x, w)
    for i in sorted({0, 15, 16, 31, 32, 33, 47, 48, 63, 64, rows - 1} & set(range(rows))):  # each tile's ends
        assert torch.equal(gemm(x[i:i + 1], w)[0], batch[i])
        assert torch.equal(gemm(x[i:i + 16], w)[0], batch[i])


@needs_gemm
def test_the_gemm_names_what_it_cannot_take():
    gemm = load_cpu_kernels().gemm_bf16
    with pytest.raises(RuntimeError, match="K must be even, got 5"):
        gemm(torch.zeros(2, 5, dtype=torch.bfloat16), torch.zeros(3, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="w must be contiguous bfloat16"):
        gemm(torch.zeros(2, 4, dtype=torch.bfloat16), torch.zeros(3, 4))
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[rows, 4\]"):
        gemm(torch.zeros(2, 6, dtype=torch.bfloat16), torch.zeros(3, 4, dtype=torch.bfloat16))


@needs_packed
@pytest.mark.parametrize("kernel", PACKED_KERNELS)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 16, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(8, 2), (37, 96), (300, 578), (576, 1536)])
def test_the_packed_kernels_match_float64(kernel, rows, n, k):
    generator = torch.Generator().manual_seed(rows * n + k)
    x = torch.randn(rows, k, generator=generator).to(torch.bfloat16)
    w = torch.randn(n, k, generator=generator).to(torch.bfloat16)
    got = run_bf16(kernel, x, pack_vnni(w), n)
    want = x.double() @ w.double().T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    torch.testing.assert_close(got.double(), want, rtol=2**-8, atol=1e-4 * k**0.5)


@needs_packed
def test_packing_puts_each_pair_of_inputs_of_32_columns_side_by_side():
    w = torch.arange(40 * 6, dtype=torch.float32).reshape(40, 6).to(torch.bfloat16)  # exact in bf16
    packed = pack_vnni(w)
    assert packed.shape == (2, 3, 32, 2)
    assert packed[0, 1, 5].tolist() == [w[5, 2].item(), w[5, 3].item()]
    assert packed[1, 2, 7].tolist() == [w[39, 4].item(), w[39, 5].item()]
    assert packed[1, :, 8:].abs().sum().item() == 0  # columns 40..63 are padding


@needs_packed
def test_the_streamed_packed_rows_do_not_depend_on_the_rows_beside_them():
    x = torch.randn(7, 576).to(torch.bfloat16)
    packed = pack_vnni(torch.randn(100, 576).to(torch.bfloat16))
    batch = run_bf16("vnni_stream", x, packed, 100)
    for i in range(7):
        assert torch.equal(run_bf16("vnni_stream", x[i:i + 1], packed, 100)[0], batch[i])


@needs_packed
def test_the_packed_kernels_name_what_they_cannot_take():
    kernels = load_cpu_kernels()
    packed = pack_vnni(torch.zeros(40, 8, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="K must be even, got 5"):
        kernels.pack_vnni(torch.zeros(3, 5, dtype=torch.bfloat16))
    with pytest.raises(RuntimeError, match="n = 70 does not fit 2 blocks of 32 columns"):
        kernels.linear_vnni(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 70, "brgemm")
    with pytest.raises(RuntimeError, match=r"x must be bfloat16 \[rows, 8\]"):
        kernels.linear_vnni(torch.zeros(2, 8), packed, 40, "brgemm")
    with pytest.raises(RuntimeError, match="unknown packed kernel 'onednn'"):
        kernels.linear_vnni(torch.zeros(2, 8, dtype=torch.bfloat16), packed, 40, "onednn")


def test_a_choice_names_kernels_of_its_own_layout_only():
    with pytest.raises(ValueError, match="a plain layout's choice names another layout's kernel"):
        Bf16Choice(((4, "stream"), (64, "brgemm")))
    with pytest.raises(ValueError, match="a vnni layout's choice names another layout's kernel"):
        Bf16Choice(((4, "vnni_stream"), (64, "onednn")), "vnni")
    assert Bf16Choice(((4, "vnni_stream"), (64, "brgemm")), "vnni").describe() == (
        "vnni_stream <= 4, brgemm above (vnni weights)")


def test_a_choice_maps_every_row_count_to_its_bucket():
    choice = Bf16Choice(((2, "stream"), (4, "onednn"), (64, "gemm"), (256, "onednn")))
    assert [choice.kernel(r) for r in (1, 2, 3, 4, 5, 64, 65, 256, 5000)] == [
        "stream", "stream", "onednn", "onednn", "gemm", "gemm", "onednn", "onednn", "onednn"]
    assert choice.describe() == "stream <= 2, onednn <= 4, gemm <= 64, onednn above"


def test_every_kernel_here_agrees_with_float64():
    w = torch.randn(96, 64).to(torch.bfloat16)
    for kernel in candidates():
        assert kernel_choice._check(kernel, w) is None


def test_the_timing_is_cached_per_machine_and_shapes(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    weights = [torch.randn(48, 32).to(torch.bfloat16), torch.randn(32, 64).to(torch.bfloat16)]
    head = torch.randn(80, 32).to(torch.bfloat16)
    with caplog.at_level(logging.INFO, logger="llmaccel.ops.kernel_choice"):
        layers, lm_head = tune_bf16(weights, head)
    assert "timed in" in caplog.text
    assert [r for r, _ in layers.buckets] == list(kernel_choice.LAYER_BUCKETS)
    assert [r for r, _ in lm_head.buckets] == list(kernel_choice.HEAD_BUCKETS)
    assert {k for _, k in layers.buckets + lm_head.buckets} <= set(candidates())
    assert all(k not in ("stream", "vnni_stream") for r, k in layers.buckets if r > kernel_choice.STREAM_MAX_ROWS)
    (saved,) = (tmp_path / "kernel_choice").glob("bf16-*.json")
    record = json.loads(saved.read_text())
    assert record["layers"] == [list(b) for b in layers.buckets] and record["cpu"]
    assert record["layers_layout"] == layers.layout and record["lm_head_layout"] == lm_head.layout
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmaccel.ops.kernel_choice"):
        assert tune_bf16(weights, head) == (layers, lm_head)  # read back, not timed again
    assert "cached" in caplog.text and "timed in" not in caplog.text
    tune_bf16(weights[:1], head)  # other shapes: timed and cached apart
    assert len(list((tmp_path / "kernel_choice").glob("bf16-*.json"))) == 2


def test_the_decode_buckets_are_timed_over_every_layers_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    first = [torch.randn(48, 32).to(torch.bfloat16), torch.randn(32, 48).to(torch.bfloat16)]
    every = first + [torch.randn(48, 32).to(torch.bfloat16), torch.randn(32, 48).to(torch.bfloat16)]
    passes = []

    def one_pass(kernels, rows, weights):  # onednn reads a whole pass fastest; everything else is timed as it is
        passes.append((rows, [tuple(w.plain.shape) for w in weights], weights[0].plain is first[0]))
        return {kernel: 1e-6 if kernel == "onednn" else 1.0 for kernel in kernels}

    monkeypatch.setattr(kernel_choice, "_pass_seconds", one_pass)
    layers, _ = tune_bf16(first, None, every)
    decode = [rows for rows in kernel_choice.LAYER_BUCKETS if rows <= kernel_choice.DECODE_ROWS]
    assert {rows for rows, _, _ in passes} == set(decode) == {1, 2, 3, 4, 6, 8, 12, 16}
    assert all(shapes == [(48, 32), (32, 48)] * 2 and same for _, shapes, same in passes)  # every layer, in order
    # a millionth of a second a pass outweighs every other bucket: the plain layout, and onednn at 1-16 rows
    assert layers.layout == "plain" and {layers.kernel(r) for r in decode} == {"onednn"}
    assert list((tmp_path / "kernel_choice").glob("bf16-decode4-*.json"))  # cached apart from one layer's timing


def test_kernels_are_timed_taking_turns_and_each_gets_its_median(monkeypatch):
    """A bandwidth flip lands on every kernel alike: one warm-up call each, then rounds in rotated order."""
    clock, calls = [0.0], []
    cost = {"a": [9.0, 1.0, 2.0, 3.0], "b": [5.0, 5.0, 5.0, 50.0], "c": [7.0, 6.0, 8.0, 7.0]}  # each round's

    def run_once(kernel: str) -> None:
        calls.append(kernel)
        timed = [k for k in calls[3:] if k == kernel]  # after the three warm-up calls
        clock[0] += cost[kernel][len(timed) - 1] if timed else 0.01  # warm-ups far below MIN_TIMED_SECONDS

    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: clock[0])
    medians = kernel_choice._interleaved_seconds(("a", "b", "c"), run_once, rounds=4)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b", "a", "b", "c"]
    assert medians == pytest.approx({"a": 3.0, "b": 5.0, "c": 7.0})  # the upper median of four; no warm-up counted


def test_long_calls_are_timed_in_fewer_rounds(monkeypatch):
    """Rounds enough for MIN_TIMED_SECONDS a kernel by the slowest warm-up; none past the warm-up where the
    caller's last bucket was that long already."""
    clock, calls = [0.0], []
    seconds = {"a": 0.1, "b": 0.06}

    def run_once(kernel: str) -> None:
        calls.append(kernel)
        clock[0] += seconds[kernel]

    monkeypatch.setattr(kernel_choice.time, "perf_counter", lambda: clock[0])
    assert kernel_choice.MIN_TIMED_SECONDS == 0.25
    kernel_choice._interleaved_seconds(("a", "b"), run_once, rounds=5)  # ceil(0.25 / 0.1): three rounds
    assert calls == ["a", "b"] + ["a", "b", "b", "a", "a", "b"]
    calls.clear()
    seconds.update(a=0.5, b=0.3)
    assert kernel_choice._interleaved_seconds(("a", "b"), run_once, rounds=5) == pytest.approx({"a": 0.5, "b": 0.3})
    assert calls == ["a", "b", "a", "b"]  # the warm-up, then one round
    calls.clear()
    kernel_choice._interleaved_seconds(("a", "b"), run_once, rounds=5, warm_up=False)
    assert calls == ["a", "b"]


def test_a_bucket_after_long_calls_is_timed_without_warm_up(monkeypatch):
    warm_ups = []

    def interleaved(kernels, run_once, rounds, warm_up=True):
        warm_ups.append(warm_up)
        return {kernel: 0.3 if len(warm_ups) >= 3 else 0.01 for kernel in kernels}  # long from the third bucket

    monkeypatch.setattr(kernel_choice, "_interleaved_seconds", interleaved)
    w = kernel_choice._Weight(torch.randn(16, 64).to(torch.bfloat16))
    kernel_choice._fastest([w], (24, 32, 48, 64, 96), ("gemm", "onednn"), {}, ())
    assert warm_ups == [True, True, True, False, False]


def test_each_weight_gets_one_float64_reference_whatever_the_kernels(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(FORCE_ENV, raising=False)
    products = []
    real = kernel_choice._float64_product
    monkeypatch.setattr(kernel_choice, "_float64_product", lambda x, w: products.append(len(x)) or real(x, w))
    weights = [torch.randn(48, 64).to(torch.bfloat16), torch.randn(64, 128).to(torch.bfloat16)]
    tune_bf16(weights, torch.randn(80, 64).to(torch.bfloat16))
    assert len(candidates()) > 1 and products == [sum(kernel_choice.CHECK_ROWS)] * 3  # both row counts in one pass


def test_a_forced_kernel_this_cpu_lacks_is_named(monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "amx-magic")
    with pytest.raises(ValueError, match=r"\$LLMACCEL_BF16_KERNEL='amx-magic' is not a kernel this machine has"):
        tune_bf16([torch.zeros(8, 8, dtype=torch.bfloat16)], None)


def test_a_bfloat16_model_runs_its_tuned_choice_in_every_projection(tiny_model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    llm = LLM(str(tiny_model_dirs["llama-gqa"]), dtype="bfloat16")
    model = llm.engine.runner.model
    layers = model.layers[0].qkv.bf16_choice
    assert layers is not kernel_choice.DEFAULT_CHOICE
    assert all(m.bf16_choice is layers for layer in model.layers
               for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down))
    assert model.decode_stack.choice is layers
    assert model.lm_head.bf16_choice is not kernel_choice.DEFAULT_CHOICE
    o = model.layers[0].o
    weight = o.vnni if layers.layout == "vnni" else o.weight  # the one copy, in the choice's layout
    assert weight is not None and (o.weight is None) == (layers.layout == "vnni")
    x = torch.randn(5, o.in_features).to(torch.bfloat16)
    assert torch.equal(o(x), run_bf16(layers.kernel(5), x, weight, o.out_features))


@needs_packed
@pytest.mark.parametrize("name", ["llama-tied", "llama-gqa"])
def test_a_model_whose_weights_are_packed_holds_one_copy_and_reads_its_table_from_it(tiny_model_dirs, name,
                                                                                       monkeypatch):
    monkeypatch.setenv(FORCE_ENV, "brgemm")
    plain = LLM(str(tiny_model_dirs[name]), dtype="bfloat16").engine.runner.model
    monkeypatch.setenv(FORCE_ENV, "stream")
    reference = LLM(str(tiny_model_dirs[name]), dtype="bfloat16").engine.runner.model
    for module in (plain.layers[0].qkv, plain.layers[1].mlp.down, plain.lm_head):
        assert module.weight is None and module.vnni is not None and module.bf16_choice.layout == "vnni"
    ids = torch.tensor([0, 1, 31, 32, 33, reference.spec.vocab_size - 1])
    assert torch.equal(plain.embedding.rows(ids), reference.embedding.rows(ids))
    assert plain.layers[0].qkv.weight_bytes == reference.layers[0].qkv.weight_bytes  # 128 columns: no padding


def _quantized_module(kind: str, n: int, k: int, seed: int):
    from llmaccel.ops.quant_linear import quantized_linear
    from llmaccel.quantization.formats import Int8Weight, quantize

    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    if kind == "q8_0":  # a scale per 32 inputs, float16 as GGUF's Q8_0 holds it inside the blocks
        scale = (w.view(n, k // 32, 32).abs().amax(-1) / 127).half().float()
        q = torch.round(w / scale.repeat_interleave(32, dim=1)).clamp(-127, 127).to(torch.int8)
        weight = Int8Weight(q, scale, 32)
    else:
        weight = quantize(w, kind, 32 if kind == "int4" else None, "w")
    return quantized_linear(weight, None, torch.device("cpu"))


@needs_packed
@pytest.mark.parametrize("kind", ["int8", "q8_0", "int4"])
@pytest.mark.parametrize("rows", [1, 5, 33, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (96, 576), (576, 1536)])
def test_the_amx_kernel_for_quantized_weights_matches_float64(kind, rows, n, k):
    from llmaccel.ops.block_kernels import AMX_KERNEL

    module = _quantized_module(kind, n, k, rows + n)
    assert module.streams and (kind == "int4" or (module.row_scale is not None) == (kind == "int8"))
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(k)).to(torch.bfloat16)
    got = module.block_product(x, AMX_KERNEL)
    weight = module.dequantized().double()
    want = x.double() @ weight.T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    # bf16 activations as they are; each weight exact (INT8 with a scale a row) or rounded once to bf16
    # (2^-9 of it at most), the float32 sum rounded once to bf16 (2^-9 of it)
    bound = 2**-9 * (x.double().abs() @ weight.abs().T) + 2**-9 * want.abs() + 1e-6 * k
    assert ((got.double() - want).abs() <= bound).all()


@needs_packed
def test_the_quantized_timing_is_cached_and_names_its_kernels(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(kernel_choice.QUANT_FORCE_ENV, raising=False)
    layers = [_quantized_module("int8", 96, 64, 1), _quantized_module("int8", 64, 128, 2)]
    head = _quantized_module("int4", 80, 64, 3)
    with caplog.at_level(logging.INFO, logger="llmaccel.ops.kernel_choice"):
        choice, head_choice = kernel_choice.tune_quantized(layers, head)
    assert "quantized kernels timed in" in caplog.text
    assert {k for _, k in choice.buckets + head_choice.buckets} <= {"stream", "dequant_amx"}
    assert [r for r, _ in choice.buckets] == list(kernel_choice.LAYER_BUCKETS)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="llmaccel.ops.kernel_choice"):
        assert kernel_choice.tune_quantized(layers, head) == (choice, head_choice)
    assert "quantized kernels (cached" in caplog.text
    monkeypatch.setenv(kernel_choice.QUANT_FORCE_ENV, "onednn")
    with pytest.raises(ValueError, match=r"\$LLMACCEL_QUANT_KERNEL='onednn' is not a kernel for quantized weights"):
        kernel_choice.tune_quantized(layers, head)


def test_speculation_gives_up_to_one_plus_k_rows_the_one_row_kernel():
    from llmaccel.ops.kernel_choice import Bf16Choice

    tuned = Bf16Choice(((1, "vnni_stream"), (2, "brgemm"), (4, "brgemm"), (8, "vnni_stream"), (16, "brgemm")), "vnni")
    assert tuned.lone_kernel_to(3).buckets == ((3, "vnni_stream"), (4, "brgemm"), (8, "vnni_stream"), (16, "brgemm"))
    assert [tuned.lone_kernel_to(3).kernel(r) for r in (1, 3, 4, 5, 9, 100)] == [
        "vnni_stream", "vnni_stream", "brgemm", "vnni_stream", "brgemm", "brgemm"]
    assert tuned.lone_kernel_to(20).buckets == ((20, "vnni_stream"),)  # past the last bucket: the same kernel
