"""Every common GGUF tensor type read natively: dequantization bit-equal to the gguf package's, the kernels on
the repacked blocks against the dequantized weights, a tiny Llama saved as each type against its dequantized
reference, the half-precision panels against float32 ones, and the named error for a type llmaccel does not read.
"""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch

from llmaccel.errors import UnsupportedModelError
from llmaccel.llm import LLM
from llmaccel.model.gguf import quants
from llmaccel.model.loader import hf_dir_for
from llmaccel.ops.cpu_kernels import load_cpu_kernels, load_level
from llmaccel.ops.gemv import pack_int8_blocks
from llmaccel.platform import cpu_features
from llmaccel.sampling_params import SamplingParams
from tests.tiny_gguf import make_llama256, write_gguf
from tests.tiny_models import hf_greedy

Q = gguf.GGMLQuantizationType
K_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
BLOCK_TYPES = (Q.Q8_0, Q.Q4_0, Q.Q4_1, *K_TYPES)
kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(kernels is None or not hasattr(kernels, "gemv_kq"),
                                   reason="C++ kernels unavailable on this machine")
# llama.cpp's Q4_K_M as it treats a llama model: Q4_K, with Q6_K for attn_v / ffn_down in some layers and the head
Q4_K_M = {"": Q.Q4_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q6_K, "output.weight": Q.Q6_K}


def _encode(values: np.ndarray, qtype: Q) -> np.ndarray:
    """float32 [R, K] -> the type's bytes [R, row bytes]."""
    if qtype in K_TYPES:
        return quants.quantize_k(values, int(qtype))
    if qtype == Q.F16:
        return values.astype(np.float16).view(np.uint8)
    if qtype == Q.F32:
        return values.view(np.uint8)
    return gguf.quants.quantize(values, qtype).reshape(values.shape[0], -1)


def _random_k_blocks(qtype: Q, rows: int, rng: np.random.Generator) -> np.ndarray:
    """Raw K-quant rows of random bytes (every scale and bit pattern), their float16 fields made finite."""
    block_bytes = quants.BLOCKS[int(qtype)][1]
    raw = rng.integers(0, 256, (rows * 2, block_bytes), dtype=np.uint8)
    halves = rng.uniform(-0.05, 0.05, (rows * 2, 2)).astype(np.float16).view(np.uint8)
    if qtype == Q.Q6_K:
        raw[:, 208:210] = halves[:, 0:2]
    else:
        raw[:, 0:4] = halves
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.BF16, *BLOCK_TYPES])
def test_dequantization_is_bit_equal_to_the_gguf_packages(qtype):
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((6, 512)) * 0.05).astype(np.float32)
    values[1] = 0.0
    values[2, :256] = 3.0
    raw = _encode(values, qtype)
    ours = quants.dequantize(torch.from_numpy(np.ascontiguousarray(raw)), int(qtype), 512).numpy()
    reference = gguf.quants.dequantize(raw.view(np.float16) if qtype == Q.F16 else raw, qtype).reshape(6, 512)
    np.testing.assert_array_equal(ours, reference)
    if qtype in K_TYPES:  # and on bytes no quantizer wrote: every 6-bit scale and min, every high bit
        raw = _random_k_blocks(qtype, 6, rng)
        np.testing.assert_array_equal(quants.dequantize(torch.from_numpy(raw), int(qtype), 512).numpy(),
                                      gguf.quants.dequantize(raw, qtype).reshape(6, 512))


@pytest.mark.parametrize("qtype", K_TYPES)
def test_the_k_quant_writer_round_trips_within_its_step(qtype):
    values = (np.random.default_rng(3).standard_normal((4, 256)) * 0.05).astype(np.float32)
    back = gguf.quants.dequantize(quants.quantize_k(values, int(qtype)), qtype).reshape(4, 256)
    levels = {Q.Q4_K: 15, Q.Q5_K: 31, Q.Q6_K: 62}[qtype]
    step = (values.max() - values.min()) / levels
    assert np.abs(back - values).max() <= step


def _quantized_activations(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels see it: INT8 per 32 inputs, d = max|x| / 127, round to nearest."""
    blocks = x.view(x.shape[0], -1, 32).double()
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.where(d > 0, torch.round(blocks / d), torch.zeros_like(blocks)) * d).view_as(x)


@needs_kernels
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
def test_the_kernels_multiply_by_the_files_own_weights(qtype):
    """Repacked (rows reordered as q/k are) and multiplied at 1 to 70 rows, 40 outputs (the last group of 16 part
    full): the float64 product of the quantized activations and the dequantized weights, to float32 rounding;
    random K-quant bytes included."""
    rng = np.random.default_rng(7)
    n, k = 40, 512
    raw = (_random_k_blocks(qtype, n, rng) if qtype in K_TYPES
           else _encode(rng.standard_normal((n, k)).astype(np.float32), qtype))
    raw_t = torch.from_numpy(np.ascontiguousarray(raw))
    order = torch.from_numpy(rng.permutation(n))
    weight = quants.dequantize(raw_t, int(qtype), k).double()[order]
    blocks = kernels.gguf_repack(raw_t, int(qtype), order, k)

    def product(x: torch.Tensor) -> torch.Tensor:
        if qtype in K_TYPES:
            return kernels.gemv_kq(x, blocks, int(qtype), n)
        return kernels.gemv_i8(x, blocks, None, n) if qtype == Q.Q8_0 else kernels.gemv_i4(x, blocks, n)

    for rows in (1, 3, 6, 70):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        got = product(x)
        want = _quantized_activations(x) @ weight.t()
        assert (got.double() - want).abs().max() <= 2e-6 * want.abs().max(), rows
        for i in (0, rows - 1):  # a row's result does not depend on the rows beside it (passes of 4, 2, 1)
            assert torch.equal(product(x[i:i + 1])[0], got[i])


@pytest.mark.skipif("avx512_vnni" not in cpu_features(), reason="no AVX512-VNNI on this CPU")
@pytest.mark.parametrize("qtype", K_TYPES)
def test_the_avx512_k_quant_kernel_gives_the_avx2_kernels_bits(qtype):
    """16 rows a vpdpbusd against 8 rows a maddubs, madd and add: the same integer sums and float steps, in the
    AVX-512 build's passes of 1-2 rows and its 4-row x 2-group tiles from 3 rows on (261: past a 256-row sweep)."""
    rng = np.random.default_rng(11)
    n, k = 40, 512
    raw_t = torch.from_numpy(np.ascontiguousarray(_random_k_blocks(qtype, n, rng)))
    wide, narrow = load_level("avx512_bf16"), load_level("avx2")
    blocks = wide.gguf_repack(raw_t, int(qtype), torch.arange(n), k)
    for rows in (1, 2, 3, 4, 6, 9, 13, 261):  # tiles with spare rows, whole ones, an odd group
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(wide.gemv_kq(x, blocks, int(qtype), n), narrow.gemv_kq(x, blocks, int(qtype), n)), rows


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_panels_give_the_float32_panels_sums_to_the_bit(dtype):
    from llmaccel.ops.gemv import to_panels

    weight = torch.randn(40, 96).to(dtype)
    for rows in (1, 6, 37):
        x = torch.randn(rows, 96)
        half = kernels.linear_f32(x, to_panels(weight), 40)
        assert torch.equal(half, kernels.linear_f32(x, to_panels(weight.float()), 40))


# ---- a tiny Llama as a GGUF file of each type ------------------------------------------------------------------

@pytest.fixture(scope="module")
def llama256(tmp_path_factory, tiny_tokenizer):
    return make_llama256(tmp_path_factory.mktemp("llama256"), tiny_tokenizer)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))


def _write(source, tmp_path, qtype, tokenizer, name="tiny"):
    config = json.loads((source / "config.json").read_text())
    return write_gguf(source, tmp_path / f"{name}.gguf", qtype, config, tokenizer)


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K, "Q4_K_M"])
def test_a_tiny_llama_saved_as_each_type_matches_its_dequantized_reference(llama256, tmp_path, tiny_tokenizer, qtype):
    """Read in place with its own tensors (--quantization gguf), the file scores text as the dense model of its
    dequantized weights does (the kernels' INT8 activations aside); read dense, it is that model, HF's greedy
    tokens on the converted directory. No converted copy is made for llmaccel itself."""
    from llmaccel.model.gguf.weights import GGUFRows
    from llmaccel.ops.kquant_linear import ConcatLinear, KQuantLinear

    path = _write(llama256, tmp_path, Q4_K_M if qtype == "Q4_K_M" else qtype, tiny_tokenizer)
    native = LLM(str(path), quantization="gguf")
    cache = tmp_path / "cache"
    assert not (cache / "gguf").exists()  # read in place: only the small files directory
    model = native.engine.runner.model
    if qtype in (Q.F16, Q.BF16):
        assert model.layers[0].qkv.panels.dtype == {Q.F16: torch.float16, Q.BF16: torch.bfloat16}[qtype]
    else:
        assert isinstance(model.embedding, GGUFRows)
    if qtype in K_TYPES:
        assert all(isinstance(m, KQuantLinear) for m in model.layers[0].projections)
    if qtype == "Q4_K_M":
        assert isinstance(model.layers[0].qkv, ConcatLinear) and isinstance(model.lm_head, KQuantLinear)
        assert model.lm_head.layout == "q6_k"
    ids = tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好，世界", add_special_tokens=False)
    dense = LLM(str(path), quantization=None)
    native_scores, dense_scores = torch.tensor(native.engine.score(ids)), torch.tensor(dense.engine.score(ids))
    tolerance = 0 if qtype in (Q.F16, Q.BF16) else 0.05  # half panels widen exactly: the same sums
    assert (native_scores - dense_scores).abs().max() <= tolerance
    prompt = tiny_tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    assert dense.generate([prompt], params)[0].outputs[0].token_ids == hf_greedy(hf_dir_for(str(path)), prompt, 16)


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q5_K, Q.Q6_K])
def test_without_the_cpu_kernels_the_files_tensors_run_on_torchs(llama256, tmp_path, tiny_tokenizer, qtype,
                                                                  monkeypatch):
    """Where llmaccel's CPU kernels are not (CUDA): Q8_0 as INT8, Q4_0 / Q4_1 / Q4_K as INT4 groups of 32 with every
    code the file's, Q5_K / Q6_K dense; each scores text as the dense read of the same file does."""
    import llmaccel.model.gguf.weights as gguf_weights
    from llmaccel.ops.quant_linear import Int4Linear, Int8Linear

    monkeypatch.setattr(gguf_weights, "_kernels", lambda: None)
    path = _write(llama256, tmp_path, qtype, tiny_tokenizer)
    native, dense = LLM(str(path), quantization="gguf", use_kernel=False), LLM(str(path), use_kernel=False)
    expected = {Q.Q8_0: Int8Linear, Q.Q4_0: Int4Linear, Q.Q4_1: Int4Linear, Q.Q4_K: Int4Linear}.get(qtype)
    layer = native.engine.runner.model.layers[0].projections[0]
    assert isinstance(layer, expected) if expected else not isinstance(layer, (Int4Linear, Int8Linear))
    ids = tiny_tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好，世界", add_special_tokens=False)
    difference = torch.tensor(native.engine.score(ids)) - torch.tensor(dense.engine.score(ids))
    assert difference.abs().max() <= 0.05


@needs_kernels
def test_the_files_matrices_are_repacked_once_into_the_mapping_a_step_streams(llama256, tmp_path, tiny_tokenizer):
    """Each matrix is written where the decode stack reads it, in the order a step reads them (the layers, then the
    head): q, k and v lie back to back and are one tensor without a concatenated copy, and the decode weights are
    not copied again."""
    from llmaccel.model.weight_arena import _weight_attribute
    from llmaccel.platform import HUGE_PAGE

    path = _write(llama256, tmp_path, Q.Q4_K, tiny_tokenizer)
    model = LLM(str(path), quantization="gguf").engine.runner.model
    assert model.decode_stack is not None
    streamed = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    tensors = [getattr(m, _weight_attribute(m)) for m in [*streamed, model.lm_head]]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    starts = [t.data_ptr() for t in tensors]
    assert starts[0] % HUGE_PAGE == 0
    # back to back with no page padding: the decode stack's WeightArena (which pads to pages) copied nothing
    assert all(t.data_ptr() + t.nbytes == following for t, following in zip(tensors, starts[1:], strict=False))
    assert any(t.nbytes % 4096 for t in tensors)
    assert model.layers[0].qkv.blocks.shape[0] == (256 + 2 * 128) // 16  # q, k, v: 16-row groups in one tensor


@needs_kernels
@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_1, "Q4_K_M"])
def test_repacking_a_slice_of_rows_at_a_time_gives_the_whole_matrixs_blocks(llama256, tmp_path, tiny_tokenizer,
                                                                            qtype, monkeypatch):
    """Slices of 16 rows (q and k reordered within each head, as a slice of whole heads) give the blocks one
    pass over the matrix gives."""
    from llmaccel.model.gguf import weights as gguf_weights
    from llmaccel.model.loader import load_checkpoint

    path = _write(llama256, tmp_path, Q4_K_M if qtype == "Q4_K_M" else qtype, tiny_tokenizer)
    whole = load_checkpoint(str(path)).weights.packed()
    expected = {name: whole[name].blocks.clone() for name in whole}
    monkeypatch.setattr(gguf_weights, "REPACK_ROWS", 16)
    sliced = load_checkpoint(str(path)).weights.packed()
    assert len(expected) > 10
    for name, blocks in expected.items():
        assert torch.equal(sliced[name].blocks, blocks), name


needs_amx = pytest.mark.skipif(
    kernels is None or not hasattr(kernels, "quant_amx_available") or not kernels.quant_amx_available(),
    reason="no AMX kernels on this CPU")


def _amx_product(blocks: torch.Tensor, qtype: Q, x: torch.Tensor, n: int) -> torch.Tensor:
    if qtype in K_TYPES:
        return kernels.kquant_linear_amx(x, blocks, int(qtype), n)
    return kernels.quant_linear_amx(x, blocks, None, n, qtype != Q.Q8_0)


@needs_amx
@pytest.mark.parametrize("qtype", BLOCK_TYPES)
@pytest.mark.parametrize(("rows", "k"), [(1, 512), (5, 512), (64, 512), (300, 512), (150, 8192)])
def test_the_amx_kernel_reads_each_block_format_as_the_file_holds_it(qtype, rows, k):
    """Random K-quant bytes (every scale, min and high bit), Q8_0 and Q4_0/Q4_1 blocks dequantized a block at a time
    into AMX tiles: the float64 product with the file's own weights, each weight rounded once to bfloat16 and the
    sum once; 72 outputs (the last group of 16 half full), rows in passes of 64 (the last one part full) and, at
    8,192 inputs, in chunks of 64 rows (x's tiles kept to 1 MB), each chunk's group tiles dequantized again."""
    rng = np.random.default_rng(11)
    n = 72
    raw = (_random_k_blocks(qtype, n * k // 512, rng).reshape(n, -1) if qtype in K_TYPES
           else _encode(rng.standard_normal((n, k)).astype(np.float32), qtype))
    raw = torch.from_numpy(np.ascontiguousarray(raw))
    weight = quants.dequantize(raw, int(qtype), k).double()
    blocks = kernels.gguf_repack(raw, int(qtype), torch.arange(n), k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
    got = _amx_product(blocks, qtype, x, n)
    want = x.double() @ weight.T
    assert got.dtype == torch.bfloat16 and got.shape == (rows, n)
    bound = 2**-9 * (x.double().abs() @ weight.abs().T) + 2**-9 * want.abs() + 1e-6 * k
    assert ((got.double() - want).abs() <= bound).all()
    for i in (0, rows - 1):  # a row's result does not depend on the rows beside it or on its place in a pass
        assert torch.equal(_amx_product(blocks, qtype, x[i:i + 1], n)[0], got[i])


@needs_amx
def test_the_amx_kernel_applies_int8_row_scales_to_the_sums():
    """INT8 with one scale a row (llmaccel's own int8 quantization): the integers go into the tiles as they are
    (exact in bfloat16) and the row scale multiplies the float32 sums, so the result is the scaled bf16 product."""
    gen = torch.Generator().manual_seed(5)
    n, k = 40, 256
    q = torch.randint(-127, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, generator=gen) * 0.01 + 1e-3
    blocks, row_scale = pack_int8_blocks(q, scale)
    x = torch.randn(37, k, generator=gen).to(torch.bfloat16)
    want = (x.double() @ q.double().T) * scale.double()
    got = kernels.quant_linear_amx(x, blocks, row_scale, n, False)
    bound = 2**-8 * want.abs() + 1e-6 * (x.double().abs() @ q.double().abs().T) * scale.double()
    assert ((got.double() - want).abs() <= bound).all()


@needs_kernels
def test_the_decode_stack_runs_k_quants_and_mixed_projections_as_the_layers_do(llama256, tmp_path, tiny_tokenizer):
    from tests.test_decode_stack import _prompts, _stack_against_layers

    path = _write(llama256, tmp_path, {**Q4_K_M, "ffn_up.weight": Q.Q5_K}, tiny_tokenizer)
    _stack_against_layers(LLM(str(path), quantization="gguf", enable_prefix_caching=False), _prompts(), tokens=12)


@needs_amx
@pytest.mark.parametrize("kernel", ["stream", "dequant_amx"])
def test_a_bfloat16_stack_takes_k_quants_and_fused_parts_to_amx_as_the_layers_do(llama256, tmp_path, tiny_tokenizer,
                                                                                   kernel, monkeypatch):
    """Q4_K q/k beside a Q6_K v in one fused projection, Q5_K and Q6_K in the MLP: with every quantized
    projection on the AMX kernel (or all streaming), the stack and the layers agree to the bit."""
    from llmaccel.ops.kernel_choice import QUANT_FORCE_ENV
    from tests.test_decode_stack import _prompts, _stack_against_layers

    monkeypatch.setenv(QUANT_FORCE_ENV, kernel)
    path = _write(llama256, tmp_path, {**Q4_K_M, "attn_v.weight": Q.Q6_K, "ffn_up.weight": Q.Q5_K}, tiny_tokenizer)
    llm = LLM(str(path), quantization="gguf", dtype="bfloat16", enable_prefix_caching=False)
    model = llm.engine.runner.model
    assert model.decode_stack is not None and model.layers[0].qkv.batch_choice.kernel(64) == kernel
    _stack_against_layers(llm, _prompts(), tokens=12)


def test_an_unsupported_tensor_type_is_a_named_error(llama256, tmp_path, tiny_tokenizer):
    path = _write(llama256, tmp_path, {"": Q.Q8_0, "ffn_gate.weight": Q.Q5_0}, tiny_tokenizer)
    with pytest.raises(UnsupportedModelError, match=r"blk\.0\.ffn_gate\.weight is Q5_0.*Q4_K_M"):
        LLM(str(path), quantization="gguf")


def test_asking_whether_a_tensor_is_in_the_file_reads_none(llama256, tmp_path, tiny_tokenizer, monkeypatch):
    """`name in weights` looks at the tensor table: Mapping's own `in` would dequantize the tensor (1.4 s of a
    1B model's start went there) and hand its pages back before the model reads it."""
    from llmaccel.model.gguf.checkpoint import gguf_model

    path = _write(llama256, tmp_path, Q.Q8_0, tiny_tokenizer)
    _, _, weights = gguf_model(path, tmp_path / "cache")
    monkeypatch.setattr(weights.file, "release", lambda tensor: pytest.fail(f"read {tensor.name}"))
    assert "model.layers.0.mlp.down_proj.weight" in weights
    assert "model.layers.0.self_attn.q_proj.bias" not in weights and 7 not in weights
