"""What `--dtype auto` picks on each kind of machine, and the machine description result files carry."""

from __future__ import annotations

import pytest

from llmaccel.config import ModelConfig
from llmaccel.platform import AUTO_DTYPE_ENV, auto_dtype, describe, read_bandwidth_gbps

AMD_ZEN3 = {"avx2", "fma", "f16c"}  # kind A of FACTS.md
XEON_AMX = AMD_ZEN3 | {"avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8", "amx_tile"}  # kind B
AVX512_BF16_ONLY = AMD_ZEN3 | {"avx512f", "avx512_bf16"}  # e.g. Zen 4, Cooper Lake


@pytest.fixture
def unpinned(monkeypatch):
    monkeypatch.delenv(AUTO_DTYPE_ENV, raising=False)


@pytest.mark.parametrize(("features", "want"), [(AMD_ZEN3, "float32"), (XEON_AMX, "bfloat16"),
                                                 (AVX512_BF16_ONLY, "bfloat16"), (set(), "float32"),
                                                 ({"avx512f", "avx512_vnni"}, "float32")])
def test_auto_dtype_on_each_kind_of_cpu(unpinned, features, want):
    assert auto_dtype("cpu", features) == want


def test_auto_dtype_on_cuda_is_bfloat16(unpinned):
    assert auto_dtype("cuda", set()) == "bfloat16"
    assert auto_dtype("cuda:1", AMD_ZEN3) == "bfloat16"


def test_the_environment_pins_auto(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "float32")
    assert auto_dtype("cpu", XEON_AMX) == "float32"


def test_model_config_reads_the_choice(monkeypatch):
    monkeypatch.setenv(AUTO_DTYPE_ENV, "bfloat16")
    import torch

    assert ModelConfig(dtype="auto").torch_dtype == torch.bfloat16
    assert ModelConfig(dtype="float32").torch_dtype == torch.float32


def test_describe_names_the_cpu_and_its_features():
    machine = describe()
    assert machine["cpu"] and machine["cores"] >= 1 and machine["torch"].startswith("2.")
    assert set(machine["features"]) <= {"avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni",
                                        "amx_bf16", "amx_int8", "amx_tile"}


def test_read_bandwidth_is_a_positive_rate():
    assert read_bandwidth_gbps(megabytes=64, repeats=2) > 0.1


def test_memory_a_step_frees_is_reused_without_faulting_pages_in_again(monkeypatch):
    """A 64 MB tensor allocated again after being freed (a prefill chunk's MLP output, step after step)
    reuses the pages the first one faulted in: glibc would otherwise unmap and map it afresh."""
    import resource

    import torch

    from llmaccel.platform import KEEP_FREED_MEMORY_ENV, keep_freed_memory

    monkeypatch.setenv(KEEP_FREED_MEMORY_ENV, "0")
    assert keep_freed_memory.__wrapped__() is False  # the opt-out changes nothing
    monkeypatch.delenv(KEEP_FREED_MEMORY_ENV)
    if not keep_freed_memory():
        pytest.skip("not glibc's malloc")
    # 64 MB, freed at once, six times: glibc's default maps and unmaps it each time (16,384 page faults a round,
    # every round); kept, the heap reuses it. Which round first reuses it depends on what earlier tests left on
    # the heap (alone: the third; after some LLM tests, later), so the test asks for one round without faults.
    faults = []
    for _ in range(6):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(16 << 20)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    assert min(faults) < 1000, faults
