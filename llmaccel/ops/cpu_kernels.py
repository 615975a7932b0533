"""Loads the C++ CPU kernels: the prebuilt library of the best instruction-set level this CPU runs.

`pip install` compiles one library per level (setup.py, llmaccel/ops/kernel_levels.py). Where none fits
(another architecture, an install that built none, an editable checkout whose C++ changed since) the
kernels are compiled here for this CPU (-march=native, torch cpp_extension) at the first start and
cached by the sources' content: the JIT fallback, about a minute on 2 cores. If that fails too (no
compiler), callers fall back to the torch reference.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

from llmaccel.config import default_cache_dir
from llmaccel.ops.kernel_levels import (
    COMMON_FLAGS,
    CSRC,
    KernelLevel,
    level_named,
    source_digest,
    sources,
    supported_levels,
)
from llmaccel.platform import cpu_features

logger = logging.getLogger(__name__)
# -mtune=generic, as the prebuilt levels are tuned: under -ffast-math the tuning changes how the compiler
# vectorises a loop's sums, and the best level must compute what this build computes, to the bit
NATIVE_FLAGS = ("-march=native", "-mtune=generic")
LEVEL_ENV = "LLMACCEL_KERNEL_LEVEL"  # a level's name (avx2, avx512, avx512_bf16) or native: that build only
_BUILT = "built"  # written in a build directory once its module has loaded
_lock = threading.Lock()
_module: ModuleType | None = None
_failed: str | None = None


def _cpu_signature() -> str:
    """Identify the CPU's instruction set, since the build uses -march=native."""
    return platform.machine() + " ".join(sorted(cpu_features()))


def _put_ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; the PyPI package's binary sits in the venv, which is not
    on PATH unless the venv is activated."""
    try:
        import ninja
    except ImportError:
        return
    bin_dir = getattr(ninja, "BIN_DIR", None)
    if bin_dir and bin_dir not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = bin_dir + os.pathsep + os.environ.get("PATH", "")


def checked_kernels(required: str, self_check: Callable[[ModuleType], str | None],
                    what: str) -> ModuleType | None:
    """The kernel module if it has `required` and passes `self_check` (which names what failed, or
    returns None), else None, the failure logged."""
    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, required):
        return None
    failed = self_check(kernels)
    if failed:
        logger.warning("%s %s failed its check against the reference; not used", what, failed)
        return None
    return kernels


@contextlib.contextmanager
def _build_guard(build_dir: Path) -> Iterator[None]:
    """One build or load of a build directory at a time, across processes. torch's builder marks a
    build with a `lock` file that it waits on forever: a first start stopped during the compile (Ctrl-C,
    a timeout) left it behind, and every later start hung at "starting". An flock dies with its process,
    so whoever holds it knows a `lock` file it finds is stale and removes it."""
    with open(build_dir / "build.flock", "w") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build_dir / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """The module a finished build left in `build_dir`, imported as it is, or None if there is none.
    The directory is named by the sources' content, so nothing in it can be stale; torch's builder runs
    ninja instead, which goes by file times: a `git checkout` or `git stash` that rewrote a source with
    the same bytes recompiled it at the next start (40-50 s on 2 cores, measured)."""
    library = build_dir / f"{name}.so"
    if not (build_dir / _BUILT).exists() or not library.exists():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[name] = module
    return module


def load_cpu_kernels() -> ModuleType | None:
    """The kernel module, or None (with the reason logged once) if there is none and none can be built."""
    global _module, _failed
    if os.environ.get("LLMACCEL_DISABLE_KERNELS") == "1":
        return None
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            _module = _best_kernels()
        except Exception as exc:  # no compiler, no ninja, ...: the torch reference still works
            _failed = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU kernels unavailable, using the torch reference attention (%s)", _failed[:300])
        return _module


def _best_kernels() -> ModuleType:
    forced = os.environ.get(LEVEL_ENV)
    if forced:
        logger.info("CPU kernels: the %s build ($%s)", forced, LEVEL_ENV)
        return _build_native() if forced == "native" else load_level(forced)
    levels = supported_levels(cpu_features())
    reasons = []
    for level in levels:
        module, reason = _prebuilt(level)
        if module is not None:
            logger.info("CPU kernels: the prebuilt %s build%s", level.name,
                        f" ({'; '.join(reasons)})" if reasons else "")
            return module
        reasons.append(reason)
    if not levels:
        reasons.append(f"no prebuilt level runs on this CPU ({platform.machine()}; the levels need x86-64 with AVX2)")
    logger.warning("%s: compiling llmaccel's CPU kernels for this CPU (the JIT fallback, once per machine, "
                   "~1 min)", "; ".join(reasons))
    return _build_native()


def _prebuilt(level: KernelLevel) -> tuple[ModuleType | None, str]:
    """(the installed library of `level`, "") or (None, why it cannot be used)."""
    try:
        module = importlib.import_module(level.module)
    except ImportError as exc:
        return None, f"the {level.name} build is not installed ({exc})"
    if getattr(module, "build_id", None) != source_digest():
        return None, (f"the installed {level.name} build is older than the sources in {CSRC} "
                      "(`make setup` or `pip install -e .` rebuilds it)")
    return module, ""


def load_level(name: str) -> ModuleType:
    """One build of the kernels, beside any other already loaded: a prebuilt level (avx2, avx512,
    avx512_bf16), or native (the JIT build for this CPU). Raises if this CPU cannot run it or it is
    not installed (tests compare the levels with each other)."""
    if name == "native":
        with _lock:
            return _build_native()
    level = level_named(name)
    missing = level.features - cpu_features()
    if missing:
        raise RuntimeError(f"this CPU cannot run the {name} kernels: it lacks {', '.join(sorted(missing))}")
    module, reason = _prebuilt(level)
    if module is None:
        raise RuntimeError(reason)
    return module


def kernels_id(kernels: ModuleType | None) -> str:
    """Names a build in caches of what was timed with it: a prebuilt level by its level and sources,
    so a second clone or venv of the same sources reuses the first's timings."""
    if kernels is None:
        return ""
    build_id = getattr(kernels, "build_id", "jit")
    return kernels.__name__ if build_id == "jit" else f"{kernels.level}-{build_id}"


def _build_native() -> ModuleType:
    """Compile (or load the cached build of) the kernels with -march=native: the JIT fallback, and the
    tests' reference for the prebuilt levels. Raises on failure."""
    import torch
    from torch.utils.cpp_extension import load

    # the sources' directory too: torch's builder writes their absolute paths into the build file,
    # so two checkouts sharing one build directory recompiled each other's kernels (~100 s a start)
    flags = [*COMMON_FLAGS, *NATIVE_FLAGS]
    key = (source_digest() + _cpu_signature() + torch.__version__ + str(CSRC.resolve()) + " ".join(flags)).encode()
    digest = hashlib.sha256(key).hexdigest()[:16]
    build_dir = default_cache_dir() / "kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    if not any(build_dir.glob("*.so")):
        logger.warning("compiling llmaccel's CPU kernels for this CPU (-march=native; once per machine, ~1 min)")
    name = f"llmaccel_cpu_{digest}"
    with _build_guard(build_dir):
        module = _import_built(name, build_dir)
        if module is None:
            module = load(name=name, sources=[str(path) for path in sources()],
                          build_directory=str(build_dir), extra_cflags=flags,
                          extra_ldflags=["-fopenmp"], verbose=False)
            (build_dir / _BUILT).touch()
    return module
