"""The weight-streaming kernels (ops/csrc/gemv.cpp, gemv_int4.cpp, linear_f32.cpp) against float references,
and their layouts."""

from __future__ import annotations

import pytest
import torch

from llmaccel.model.layers import Linear
from llmaccel.ops.gemv import BLOCK, gemv_kernels, pack_int4_blocks, pack_int8_blocks, to_panels

kernels = gemv_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable or without AVX2 on this machine")


def q8_rounded(x: torch.Tensor) -> torch.Tensor:
    """The activations as the INT8 and INT4 kernels see them: rounded to INT8 with a scale per 32 inputs."""
    blocks = x.view(x.shape[0], -1, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / d) * d).view_as(x)


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 64, 300])
@pytest.mark.parametrize(("n", "k"), [(4, 32), (37, 96), (300, 576), (40, 600)])
def test_float32_panels_match_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(rows * n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    assert relative_error(kernels.linear_f32(x, to_panels(w), n), x @ w.t()) < 5e-6  # float rounding
    assert kernels.linear_f32(x.bfloat16(), to_panels(w), n).dtype == torch.float32  # bf16 input is read as float


def test_panel_layout():
    w = torch.arange(20 * 3, dtype=torch.float32).view(20, 3)
    panels = to_panels(w)
    assert panels.shape == (2, 3, 16)
    assert torch.equal(panels[0, :, 5], w[5]) and torch.equal(panels[1, :, 3], w[19])
    assert torch.equal(panels[1, :, 4:], torch.zeros(3, 12))  # padding rows


@pytest.mark.parametrize("k", [1, 3, 6, 257, 1536])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_panels_are_batch_invariant(k, dtype):
    """A row's output is bit-identical whatever rows share the call (one summation order everywhere: one row
    streams two panels at a time, up to six rows a panel whole, more go 256 inputs a pass and resume exactly)."""
    gen = torch.Generator().manual_seed(3)
    n = 100
    x, panels = torch.randn(300, k, generator=gen), to_panels(torch.randn(n, k, generator=gen).to(dtype))
    batch = kernels.linear_f32(x, panels, n)
    for first, count in ((0, 1), (7, 1), (299, 1), (10, 2), (10, 5), (100, 64), (0, 129), (0, 300)):
        assert torch.equal(kernels.linear_f32(x[first:first + count], panels, n), batch[first:first + count])


def test_tied_table_rows_come_from_the_panels():
    gen = torch.Generator().manual_seed(4)
    table = torch.randn(50, 64, generator=gen)
    linear = Linear(table.clone())
    assert linear.panels is not None and linear.weight is None and linear.has_rows
    ids = torch.tensor([0, 17, 49, 17])
    assert torch.equal(linear.rows(ids), table[ids])
    assert linear.weight_bytes == 64 * 64 * 4  # 50 rows padded to 64: the one copy it holds


@pytest.mark.parametrize("rows", [1, 3, 4, 64, 301])  # 1-2 rows a pass of their own, 3+ in 4 x 2 tiles (gemv.cpp)
@pytest.mark.parametrize("grouped", [False, True])
def test_int8_is_the_q8_activation_product(rows, grouped):
    """Exactly what the kernel promises: activations rounded to INT8 per 32 inputs, integer products
    (the stored +128 taken off exactly), each block's sum scaled once."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 192
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)  # the whole range, -128 too
    # per-32 scales are float16 in the blocks (GGUF Q8_0's d): given as float16 values, they are exact
    scale = torch.rand(n, k // BLOCK, generator=gen).half().float() if grouped else torch.rand(n, generator=gen)
    xq = q8_rounded(x)  # the activations as the kernel sees them
    full = scale.repeat_interleave(BLOCK, 1) if grouped else scale[:, None]
    want = xq.double() @ (q.double() * full.double()).t()
    got = kernels.gemv_i8(x, *pack_int8_blocks(q, scale), n)
    assert got.shape == (rows, n)
    assert relative_error(got.double(), want) < 1e-5
    assert relative_error(got, x @ (q.float() * full).t()) < 2e-2


@pytest.mark.parametrize("grouped", [False, True])
def test_int8_block_layout_and_rows(grouped):
    """Byte 4 r + j of chunk t: row r's input 4 t + j plus 128; per-32 scales after the weights (float16); the
    embedding lookup reads rows back from the blocks exactly."""
    gen = torch.Generator().manual_seed(7)
    n, k = 21, 64
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    # per-32 scales are float16 in the blocks (GGUF Q8_0's d): given as float16 values, they are exact
    scale = torch.rand(n, k // BLOCK, generator=gen).half().float() if grouped else torch.rand(n, generator=gen)
    blocks, row_scale = pack_int8_blocks(q, scale)
    assert blocks.shape == (2, 2, 544 if grouped else 512) and (row_scale is None) == grouped
    for g, b, t, r, j in ((0, 0, 0, 0, 0), (0, 1, 7, 15, 3), (1, 0, 2, 4, 1)):
        assert int(blocks[g, b, 64 * t + 4 * r + j]) == int(q[16 * g + r, 32 * b + 4 * t + j]) + 128
    if grouped:
        assert blocks[1, 1, 512:].view(torch.float16)[:5].tolist() == scale[16:, 1].tolist()
    else:
        assert row_scale[:n].tolist() == scale.tolist() and not row_scale[n:].any()
    full = scale.repeat_interleave(BLOCK, 1) if grouped else scale[:, None]
    ids = torch.tensor([0, 20, 17, 3, 20])
    assert torch.equal(kernels.int8_rows(blocks, row_scale, ids), (q.float() * full)[ids])
    with pytest.raises(RuntimeError, match="row 32 is outside the weight"):
        kernels.int8_rows(blocks, row_scale, torch.tensor([32]))


def test_bfloat16_activations_are_read_as_their_float32_values():
    """A bfloat16 input is quantized from its bits, split between threads (64 x 18 blocks): the same INT8
    activations, so the same sums, as its float32 widening gives."""
    gen = torch.Generator().manual_seed(8)
    n, k = 48, 576
    packed = pack_int8_blocks(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen),
                              torch.rand(n, k // BLOCK, generator=gen).half().float())
    x = torch.randn(64, k, generator=gen).bfloat16()
    assert torch.equal(kernels.gemv_i8(x, *packed, n), kernels.gemv_i8(x.float(), *packed, n))


@pytest.mark.parametrize("grouped", [False, True])
def test_int8_is_batch_invariant(grouped):
    """A row's sums are the same bits alone (1-2 rows: group_pass), in a 4-row tile beside others, past the
    256-row sweep or in a tile it fills alone (rows repeated); 7 groups: one thread's share ends on a lone group."""
    gen = torch.Generator().manual_seed(6)
    n, k = 100, 576
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // BLOCK, generator=gen).half().float() if grouped else torch.rand(n, generator=gen)
    packed = pack_int8_blocks(q, scale)
    x = torch.randn(301, k, generator=gen)
    batch = kernels.gemv_i8(x, *packed, n)
    for first, count in ((0, 1), (3, 1), (69, 1), (300, 1), (5, 2), (5, 3), (1, 64), (250, 11), (0, 258)):
        assert torch.equal(kernels.gemv_i8(x[first:first + count], *packed, n), batch[first:first + count])


def test_int4_block_layout():
    """Byte 4 r + j of chunk t: row r's input 8 t + j (low nibble) and 8 t + 4 + j (high); then the
    16 scales and 16 offsets as float16; rows past N are zero."""
    n, k = 20, 64
    q = (torch.arange(n)[:, None] + torch.arange(k)[None, :]).remainder(16)
    scale = torch.arange(n * 2, dtype=torch.float32).view(n, 2) + 1
    blocks = pack_int4_blocks(q, scale, -scale)
    assert blocks.shape == (2, 2, 320) and blocks.dtype == torch.uint8
    for g, b, t, r, j in ((0, 0, 0, 0, 0), (0, 1, 3, 15, 3), (1, 0, 2, 3, 1), (1, 1, 1, 2, 2)):
        row, col = 16 * g + r, 32 * b + 8 * t + j
        assert blocks[g, b, 64 * t + 4 * r + j] == q[row, col] | (q[row, col + 4] << 4)
    halves = blocks[1, 1, 256:].view(torch.float16)
    assert halves[:4].tolist() == scale[16:, 1].tolist() and halves[16:20].tolist() == (-scale[16:, 1]).tolist()
    assert not blocks[1, :, :256].reshape(-1, 16, 4)[:, 4:].any() and not halves[4:16].any()  # padding rows


@pytest.mark.parametrize("rows", [1, 3, 4, 17])  # (past a 256-row sweep: test_int4_is_batch_invariant)
@pytest.mark.parametrize(("n", "k"), [(33, 128), (64, 576), (5, 32)])
def test_int4_is_the_q8_activation_product(rows, n, k):
    """Exactly what the kernel promises: activations rounded to INT8 per 32 inputs, integer products,
    each block's sum scaled once; and within a float tolerance of the plain product."""
    gen = torch.Generator().manual_seed(rows * n)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // BLOCK, generator=gen).half()
    offset = torch.randn(n, k // BLOCK, generator=gen).half()
    w = q.float() * scale.float().repeat_interleave(BLOCK, 1) + offset.float().repeat_interleave(BLOCK, 1)
    x = torch.randn(rows, k, generator=gen)
    xq = q8_rounded(x)  # the activations as the kernel sees them
    got = kernels.gemv_i4(x, pack_int4_blocks(q, scale, offset), n)
    assert got.shape == (rows, n)
    assert relative_error(got.double(), xq.double() @ w.double().t()) < 1e-5
    assert relative_error(got, x @ w.t()) < 2e-2


def test_int4_is_batch_invariant():
    gen = torch.Generator().manual_seed(5)
    n, k = 100, 576
    q = torch.randint(0, 16, (n, k), generator=gen)
    blocks = pack_int4_blocks(q, torch.rand(n, k // BLOCK, generator=gen), torch.randn(n, k // BLOCK, generator=gen))
    x = torch.randn(301, k, generator=gen)  # as the INT8 test: 1-2 rows alone, tiles of 4 x 2 past a 256-row sweep
    batch = kernels.gemv_i4(x, blocks, n)
    for first, count in ((0, 1), (3, 1), (69, 1), (300, 1), (5, 2), (5, 3), (1, 64), (250, 11), (0, 258)):
        assert torch.equal(kernels.gemv_i4(x[first:first + count], blocks, n), batch[first:first + count])


def test_shapes_are_checked():
    with pytest.raises(RuntimeError, match=r"blocks must be contiguous uint8 \[ceil\(N / 16\), K / 32, 512\]"):
        kernels.gemv_i8(torch.randn(1, 64), torch.zeros(1, 2, 576, dtype=torch.uint8), torch.ones(16), 3)
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
        kernels.linear_f32(torch.randn(1, 32), to_panels(torch.randn(3, 64)), 3)
    with pytest.raises(RuntimeError, match="does not fit"):
        kernels.linear_f32(torch.randn(1, 64), to_panels(torch.randn(3, 64)), 17)
    with pytest.raises(RuntimeError, match="does not fit 2 groups"):
        kernels.gemv_i4(torch.randn(1, 64), torch.zeros(2, 2, 320, dtype=torch.uint8), 33)
    with pytest.raises(RuntimeError, match="row_scale must be"):
        kernels.gemv_i8(torch.randn(1, 64), torch.zeros(1, 2, 512, dtype=torch.uint8), torch.ones(4), 3)


@pytest.mark.parametrize("group_size", [32, 64])
def test_grouped_int8_layers_stream_and_read_rows(group_size):
    """GGUF Q8_0 (groups of 32), as a Q4_1 file's tied table is, goes through the streaming kernel; so
    do groups that are a multiple of 32. Its rows (an embedding lookup) are the dequantized rows."""
    from llmaccel.ops.quant_linear import Int8Linear
    from llmaccel.quantization.formats import Int8Weight

    gen = torch.Generator().manual_seed(group_size)
    n, k = 40, 128
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    weight = Int8Weight(q, (torch.rand(n, k // group_size, generator=gen) + 0.01).half().float(), group_size)
    layer = Int8Linear(weight, None, torch.device("cpu"))
    assert layer.streams
    x = torch.randn(3, k, generator=gen)
    want = x @ weight.dequantize().t()
    assert relative_error(layer(x), want) < 2e-2  # INT8 activations
    ids = torch.tensor([0, 39, 7])
    assert torch.equal(layer.rows(ids), weight.dequantize()[ids])
