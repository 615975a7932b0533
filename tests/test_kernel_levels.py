"""The prebuilt kernel levels (setup.py, llmaccel/ops/kernel_levels.py): which one a CPU loads, and that
each level this machine runs computes what the kernels compiled for this very CPU compute.

The native build (-march=native, the JIT fallback) is the reference: the best level a CPU runs compiles
the same code paths (the sources choose them by AVX2 / AVX-512 / AVX512-BF16 alone), so its outputs must
be identical to the bit; a lower level runs other paths (an AVX-512 machine running the AVX2 library)
and must agree to float precision. The AVX2 level also runs on an AVX-512 machine the products an
AVX2-only CPU runs: it found the INT8 kernel's AVX2 sign trick misreading the weight -128."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from llmaccel.ops import cpu_kernels
from llmaccel.ops.gemv import BLOCK, pack_int4_blocks, pack_int8_blocks, to_panels
from llmaccel.ops.kernel_levels import LEVELS, level_named, source_digest, supported_levels
from llmaccel.platform import cpu_features
from tests.test_gemv import q8_rounded

ZEN3 = {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave", "sse4_2"}
SKYLAKE_SERVER = ZEN3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
ZEN4 = SKYLAKE_SERVER | {"avx512_vnni", "avx512_bf16", "avx512_vbmi"}
HERE = supported_levels(cpu_features())
needs_levels = pytest.mark.skipif(not HERE, reason="this CPU runs no prebuilt level (not x86-64 with AVX2)")


@pytest.mark.parametrize(("features", "want"), [
    (ZEN3, ["avx2"]),
    (SKYLAKE_SERVER, ["avx512", "avx2"]),
    (ZEN4, ["avx512_bf16", "avx512", "avx2"]),
    (ZEN3 - {"fma"}, []),
    (ZEN4 - {"avx512vl"}, ["avx2"]),  # every flag of a level, not most of them
])
def test_a_cpu_runs_the_levels_whose_flags_it_has_best_first(features, want):
    assert [level.name for level in supported_levels(features)] == want


def test_an_unknown_level_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown kernel level 'sse4'.*avx512_bf16, avx512, avx2 or native"):
        level_named("sse4")


def test_a_level_this_cpu_cannot_run_is_refused_by_name():
    unsupported = [level for level in LEVELS if level not in HERE]
    if not unsupported:
        pytest.skip("this CPU runs every level")
    missing = sorted(unsupported[0].features - cpu_features())
    with pytest.raises(RuntimeError, match=f"cannot run the {unsupported[0].name} kernels: it lacks {missing[0]}"):
        cpu_kernels.load_level(unsupported[0].name)


@needs_levels
def test_the_best_level_is_loaded_and_names_its_sources():
    kernels = cpu_kernels.load_cpu_kernels()
    if os.environ.get(cpu_kernels.LEVEL_ENV):
        pytest.skip(f"${cpu_kernels.LEVEL_ENV} forces a level")
    assert (kernels.level, kernels.build_id) == (HERE[0].name, source_digest())
    assert cpu_kernels.kernels_id(kernels) == f"{HERE[0].name}-{source_digest()}"


@needs_levels
def test_a_build_of_other_sources_is_not_used(monkeypatch):
    monkeypatch.setattr(cpu_kernels, "source_digest", lambda: "0123456789abcdef")
    module, reason = cpu_kernels._prebuilt(HERE[0])
    assert module is None
    assert f"the installed {HERE[0].name} build is older than the sources" in reason


# --- every level against the native build ---

def _battery(kernels) -> dict[str, torch.Tensor]:
    """One call of each kernel family on fixed inputs."""
    gen = torch.Generator().manual_seed(0)
    n, k, rows = 96, 256, 5
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    q8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=gen)
    q4 = torch.randint(0, 16, (n, k), generator=gen)
    group_scale = torch.rand(n, k // BLOCK, generator=gen).half().float()  # as the blocks hold them
    offset = torch.randn(n, k // BLOCK, generator=gen).half()
    heads, kv_heads, dim, block, blocks = 4, 2, 64, 16, 6
    q = torch.randn(3, heads, dim, generator=gen)
    k_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen)
    v_cache = torch.randn(blocks * block, kv_heads, dim, generator=gen)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0], [5, 0, 0]], dtype=torch.int32)
    lens = torch.tensor([40, 17, 3], dtype=torch.int32)
    norm = torch.rand(k, generator=gen) + 0.5
    gate_up = torch.randn(rows, 2 * n, generator=gen)
    logits = torch.randn(4, 1000, generator=gen)
    return {
        "gemv_i8": kernels.gemv_i8(x, *pack_int8_blocks(q8, group_scale), n),
        "gemv_i4": kernels.gemv_i4(x, pack_int4_blocks(q4, group_scale.half(), offset), n),
        "linear_f32": kernels.linear_f32(x, to_panels(w), n),
        "gemv_bf16": kernels.gemv_bf16(x[:2], w.bfloat16()),
        "attention": kernels.paged_decode_attention(q, k_cache, v_cache, tables, lens, block, 0, dim ** -0.5, 0.0),
        "attention_bf16": kernels.paged_decode_attention(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(),
                                                         tables, lens, block, 8, dim ** -0.5, 0.0),
        "rms_norm": kernels.rms_norm(x, None, norm, 1e-6),
        "silu_mul": kernels.silu_mul(gate_up),
        "argmax": kernels.argmax_rows(logits),
    }


@pytest.fixture(scope="module")
def native():
    return cpu_kernels.load_level("native")  # compiled once per machine and sources (~1 min on 2 cores)


@pytest.mark.slow
@needs_levels
@pytest.mark.parametrize("level", [level.name for level in LEVELS])
def test_each_level_computes_what_the_native_build_computes(native, level):
    if level not in [supported.name for supported in HERE]:
        pytest.skip(f"this CPU cannot run the {level} kernels")
    got, want = _battery(cpu_kernels.load_level(level)), _battery(native)
    for name in want:
        if level == HERE[0].name:  # the same code paths as -march=native: to the bit
            assert torch.equal(got[name], want[name]), f"{level} {name} differs from the native build"
        else:
            torch.testing.assert_close(got[name], want[name], rtol=2e-5, atol=2e-5, msg=f"{level} {name}")


GENERATE = """
import json, sys
from llmaccel import LLM, SamplingParams
from llmaccel.ops.cpu_kernels import load_cpu_kernels
prompts = [{"prompt_token_ids": p} for p in ([5, 9, 13, 2, 7], list(range(20, 57)))]
params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=2)
out = {"level": load_cpu_kernels().level}
for dtype, quantization in [("float32", None), ("float32", "int8"), ("float32", "int4"), ("bfloat16", None)]:
    llm = LLM(sys.argv[1], dtype=dtype, quantization=quantization)
    out[f"{dtype} {quantization}"] = [(o.outputs[0].token_ids, [(lp.logprob, sorted(lp.top.items()))
                                       for lp in o.outputs[0].logprobs]) for o in llm.generate(prompts, params)]
print(json.dumps(out))
"""


def _generate_with(level: str, model: str) -> dict:
    env = {**os.environ, cpu_kernels.LEVEL_ENV: level}
    done = subprocess.run([sys.executable, "-c", GENERATE, model], env=env, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@needs_levels
def test_the_best_level_generates_what_the_native_build_generates(native, llama_dir):
    """The whole model (the decode stack, prefill, sampling) in float32, INT8, INT4 and bfloat16: token
    ids, logprobs and the top alternatives identical."""
    best, reference = _generate_with(HERE[0].name, str(llama_dir)), _generate_with("native", str(llama_dir))
    assert (best.pop("level"), reference.pop("level")) == (HERE[0].name, "native")
    assert best == reference


# --- the AVX2 level's products on any machine that runs it ---

@pytest.fixture(scope="module")
def avx2():
    if "avx2" not in [level.name for level in HERE]:
        pytest.skip("this CPU cannot run AVX2 code")
    return cpu_kernels.load_level("avx2")


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
    scale = torch.rand(n, k // BLOCK, generator=gen).half().float() if grouped else torch.rand(n, generator=gen)
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
