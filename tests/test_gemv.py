"""The weight-streaming kernels (ops/csrc/gemv.cpp) against float references, and their layouts."""

from __future__ import annotations

import pytest
import torch

from llmaccel.ops.gemv import BLOCK, gemv_kernels, pack_int4_rows

kernels = gemv_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable or without AVX2 on this machine")


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("rows", [1, 2, 5, 64])
@pytest.mark.parametrize(("n", "k"), [(4, 32), (37, 96), (300, 576)])
def test_float32_matches_matmul(rows, n, k):
    gen = torch.Generator().manual_seed(rows * n)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n, k, generator=gen)
    assert relative_error(kernels.gemv_f32(x, w), x @ w.t()) < 1e-6
    assert kernels.gemv_f32(x.bfloat16(), w).dtype == torch.float32  # bf16 input is read as float


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("grouped", [False, True])
def test_int8_is_the_q8_activation_product(rows, grouped):
    """Exactly what the kernel promises: activations rounded to INT8 per 32 inputs, integer products."""
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 192
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=gen)
    scale = torch.rand(n, k // BLOCK, generator=gen) if grouped else torch.rand(n, generator=gen)
    blocks = x.view(rows, k // BLOCK, BLOCK)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    xq = (torch.round(blocks / d) * d).view(rows, k)  # the activations as the kernel sees them
    full = scale.repeat_interleave(BLOCK, 1) if grouped else scale[:, None]
    want = xq.double() @ (q.double() * full.double()).t()
    assert relative_error(kernels.gemv_i8(x, q, scale).double(), want) < 1e-5
    assert relative_error(kernels.gemv_i8(x, q, scale), x @ (q.float() * full).t()) < 2e-2


def test_int4_packing_order_and_product():
    q = torch.arange(64).remainder(16).view(1, 64)
    packed = pack_int4_rows(q)
    assert packed.tolist() == [[j | (j << 4) for j in range(16)] * 2]  # byte j: input j low, j + 16 high
    gen = torch.Generator().manual_seed(1)
    n, k = 33, 128
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // BLOCK, generator=gen).half()
    offset = torch.randn(n, k // BLOCK, generator=gen).half()
    w = q.float() * scale.float().repeat_interleave(BLOCK, 1) + offset.float().repeat_interleave(BLOCK, 1)
    for rows in (1, 4, 17):
        x = torch.randn(rows, k, generator=gen)
        assert relative_error(kernels.gemv_i4(x, pack_int4_rows(q), scale, offset), x @ w.t()) < 2e-2


def test_shapes_are_checked():
    with pytest.raises(RuntimeError, match="multiple of 32"):
        kernels.gemv_i8(torch.randn(1, 40), torch.zeros(3, 40, dtype=torch.int8), torch.ones(3))
    with pytest.raises(RuntimeError, match=r"x must be \[rows, 64\]"):
        kernels.gemv_f32(torch.randn(1, 32), torch.randn(3, 64))
    with pytest.raises(RuntimeError, match="scale must be"):
        kernels.gemv_i8(torch.randn(1, 64), torch.zeros(3, 64, dtype=torch.int8), torch.ones(4))
