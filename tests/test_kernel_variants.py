"""The kernels as an AVX2-only CPU builds them (-march=haswell), checked on this machine.

The build uses -march=native, so a machine with AVX-512 never runs the AVX2 paths its tests cover on an
AVX2-only machine (Kind A, the AMD EPYC Zen 3 of docs/benchmarks.md). Here the same sources compiled
for Haswell run the same products against float references: it found the INT8 kernel's AVX2 sign trick
misreading the weight -128 (relative error 0.7-1.8 with many of them)."""

from __future__ import annotations

import pytest
import torch

from llmaccel.ops.gemv import BLOCK, gemv_kernels, pack_int4_blocks, pack_int8_blocks, to_panels
from llmaccel.platform import cpu_features
from tests.test_gemv import q8_rounded

pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    gemv_kernels() is None or not {"avx2", "fma"} <= set(cpu_features()),
    reason="needs the C++ kernels and an x86 CPU that runs AVX2 code")]


@pytest.fixture(scope="module")
def avx2():
    from llmaccel.ops.cpu_kernels import build_for_arch

    return build_for_arch("haswell")  # ~3 min the first time, cached after


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm())


@pytest.mark.parametrize("rows", [1, 3, 64])
@pytest.mark.parametrize("grouped", [False, True])
def test_avx2_int8_product_over_the_whole_int8_range(avx2, rows, grouped):
    gen = torch.Generator().manual_seed(rows)
    n, k = 70, 192
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q[:, :8] = -128  # many weights -128, meeting activations of both signs
    scale = torch.rand(n, k // BLOCK, generator=gen) if grouped else torch.rand(n, generator=gen)
    xq = q8_rounded(x)  # the activations as the kernel sees them
    full = scale.repeat_interleave(BLOCK, 1) if grouped else scale[:, None]
    want = xq.double() @ (q.double() * full.double()).t()
    assert relative_error(avx2.gemv_i8(x, *pack_int8_blocks(q, scale), n), want) < 1e-6


@pytest.mark.parametrize("rows", [1, 5, 64])
def test_avx2_int4_and_float32_products(avx2, rows):
    gen = torch.Generator().manual_seed(10 + rows)
    n, k = 48, 96
    x = torch.randn(rows, k, generator=gen)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scale = torch.rand(n, k // BLOCK, generator=gen).half()  # w = q * scale + offset, both float16 per block
    offset = torch.randn(n, k // BLOCK, generator=gen).half()
    weight = q * scale.float().repeat_interleave(BLOCK, 1) + offset.float().repeat_interleave(BLOCK, 1)
    xq = q8_rounded(x)  # the activations as the kernel sees them
    got = avx2.gemv_i4(x, pack_int4_blocks(q, scale, offset), n)
    assert relative_error(got, xq.double() @ weight.double().t()) < 1e-5
    w = torch.randn(n, k, generator=gen)
    assert relative_error(avx2.linear_f32(x, to_panels(w), n), x.double() @ w.double().t()) < 1e-6
