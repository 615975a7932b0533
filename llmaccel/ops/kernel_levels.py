"""The instruction-set levels llmaccel's CPU kernels are compiled for, and which one a CPU runs.

A wheel holds one build of the kernels per level (setup.py); at start cpu_kernels.py loads the best
level the CPU's flags allow. The levels are the x86-64 psABI's (x86-64-v3: AVX2, FMA, F16C, BMI;
x86-64-v4: AVX-512 F/BW/CD/DQ/VL), which name exactly what the compiler may emit, so a level never
runs an instruction its CPU lacks, plus v4 with AVX512-VNNI and AVX512-BF16 (AMD Zen 4/5, Intel Cooper
Lake and later). The sources' `#if defined(__AVX512BF16__)`-style guards pick their code paths per level.
AMX has no level of its own: the avx512_bf16 build also compiles csrc/quant_amx.cpp's AMX tile code
(-mamx-tile -mamx-bf16), which runs only where the CPU has AMX (a compiler never emits AMX unasked), and the
bf16 kernels reach AMX through oneDNN's brgemm, which dispatches at run time.

Only the standard library here: setup.py reads this file before anything is installed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

CSRC = Path(__file__).parent / "csrc"
# Flags every build takes, the JIT fallback's included; -fno-finite-math-only keeps inf and NaN
# meaningful (masked attention scores are -inf) under -ffast-math.
COMMON_FLAGS = ("-O3", "-ffast-math", "-fno-finite-math-only", "-fopenmp")
BUILD_FLAGS_VERSION = "levels-2"  # part of the digest: a change of flags rebuilds

_V3 = frozenset({"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "abm", "movbe", "xsave"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}


@dataclass(frozen=True)
class KernelLevel:
    """One build of the kernels: its name, its compiler flags, the /proc/cpuinfo flags it needs."""

    name: str
    flags: tuple[str, ...]
    features: frozenset[str]

    @property
    def module(self) -> str:
        return f"llmaccel.ops._kernels_{self.name}"


LEVELS = (  # best first
    KernelLevel("avx512_bf16", ("-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
                _V4 | {"avx512_vnni", "avx512_bf16"}),
    KernelLevel("avx512", ("-march=x86-64-v4",), _V4),
    KernelLevel("avx2", ("-march=x86-64-v3",), _V3),
)


def level_named(name: str) -> KernelLevel:
    for level in LEVELS:
        if level.name == name:
            return level
    raise ValueError(f"unknown kernel level {name!r}: one of {', '.join(level.name for level in LEVELS)} or native")


def supported_levels(features: set[str] | frozenset[str]) -> list[KernelLevel]:
    """The levels a CPU with these flags runs, best first."""
    return [level for level in LEVELS if level.features <= features]


def sources() -> list[Path]:
    """The kernels' C++ files (the headers beside them are included, not compiled)."""
    return sorted(CSRC.glob("*.cpp"))


def source_digest() -> str:
    """Names the kernels' sources (and the build flags): a prebuilt library whose build_id differs was
    built from other sources (an editable checkout whose C++ changed since `make setup`)."""
    digest = hashlib.sha256(BUILD_FLAGS_VERSION.encode())
    for path in sources() + sorted(CSRC.glob("*.h")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]
