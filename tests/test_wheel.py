"""Installed as users install it: a wheel built from the repository carries the C++ kernel sources,
and llmaccel installed from it (not from this checkout) loads the fast kernels."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CHECK = """
import llmaccel, torch
from llmaccel.ops.attention import PagedAttention
from llmaccel.ops.gemv import gemv_kernels
print(llmaccel.__file__)
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
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    # The installed copy first (its dependencies from this venv); a cache of its own, so it builds its kernels
    # from the sources it carries and leaves this checkout's build alone.
    env = {**os.environ, "PYTHONPATH": str(target), "LLMACCEL_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("LLMACCEL_DISABLE_KERNELS", None)
    result = subprocess.run([sys.executable, "-c", CHECK], cwd=tmp_path, env=env, capture_output=True, text=True,
                            check=True)
    where, loaded = result.stdout.strip().splitlines()[-2:]
    assert where.startswith(str(target))
    assert loaded == "True True", result.stderr[-2000:]
