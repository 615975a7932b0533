"""Installed as users install it: a wheel built from the repository carries a compiled library of the
kernels per instruction-set level (and their sources, for the JIT fallback), and llmaccel installed from
it (not from this checkout) loads the best prebuilt level this CPU runs, compiling nothing. (.ci/run
also installs the wheel into a fresh venv with no compiler on PATH and serves a request:
.ci/check_wheel.)"""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from llmaccel.ops.kernel_levels import LEVELS, supported_levels
from llmaccel.platform import cpu_features

ROOT = Path(__file__).resolve().parent.parent
CHECK = """
import llmaccel, torch
from llmaccel.ops.attention import PagedAttention
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.gemv import gemv_kernels
print(llmaccel.__file__)
print(load_cpu_kernels().__file__)
print(PagedAttention(4, 2, 16, torch.device("cpu")).uses_kernel, gemv_kernels() is not None)
"""


@pytest.mark.slow
def test_the_built_wheel_carries_and_loads_the_kernels(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path / "dist"), str(ROOT)], check=True)
    wheel = next((tmp_path / "dist").glob("llmaccel-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = {p.relative_to(ROOT).as_posix() for p in (ROOT / "llmaccel" / "ops" / "csrc").glob("*.cpp")}
    assert sources and sources <= names
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    assert {f"llmaccel/ops/_kernels_{level.name}{suffix}" for level in LEVELS} <= names
    assert len(LEVELS) >= 3
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    # The installed copy first (its dependencies from this venv); a cache of its own, empty: a JIT build
    # would show as a library under it.
    env = {**os.environ, "PYTHONPATH": str(target), "LLMACCEL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LLMACCEL_DISABLE_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=True)
    where, library, loaded = result.stdout.strip().splitlines()[-3:]
    assert where.startswith(str(target))
    best = supported_levels(cpu_features())
    if best:
        assert Path(library) == target / "llmaccel" / "ops" / f"_kernels_{best[0].name}{suffix}", result.stderr[-2000:]
        assert not (tmp_path / "cache" / "kernels").exists(), "the installed copy compiled its kernels"
    assert loaded == "True True", result.stderr[-2000:]
