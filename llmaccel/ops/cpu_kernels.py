"""Builds the C++ CPU kernels once (torch cpp_extension) and caches the build by source hash.

The first build takes about a minute (torch's headers are heavy); later processes load the cached library
in well under a second. If no compiler is available, callers fall back to the torch reference.
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
from llmaccel.platform import cpu_features

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = sorted(_CSRC.glob("*.cpp"))
_HEADERS = sorted(_CSRC.glob("*.h"))  # part of the cache key, not compiled on their own
_BUILD_FLAGS_VERSION = b"openmp"  # part of the cache key: a flag change rebuilds
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
    """The compiled kernel module, or None (with the reason logged once) if it cannot be built."""
    global _module, _failed
    if os.environ.get("LLMACCEL_DISABLE_KERNELS") == "1":
        return None
    with _lock:
        if _module is not None or _failed is not None:
            return _module
        try:
            _module = _build("native")
        except Exception as exc:  # no compiler, no ninja, ...: the torch reference still works
            _failed = f"{type(exc).__name__}: {exc}"
            logger.warning("CPU kernels unavailable, using the torch reference attention (%s)", _failed[:300])
        return _module


def build_for_arch(march: str) -> ModuleType:
    """The kernels compiled for another CPU, e.g. `haswell` (AVX2 + FMA + F16C, no AVX-512): how the
    tests check, on an AVX-512 machine, the code paths an AVX2-only one runs. Cached like the native
    build; raises if the build fails."""
    with _lock:
        return _build(march)


def _build(march: str) -> ModuleType:
    """Compile (or load the cached build of) the kernels with -march=`march`; raises on failure."""
    import torch
    from torch.utils.cpp_extension import load

    source = b"".join(path.read_bytes() for path in _SOURCES + _HEADERS)
    # the sources' directory too: torch's builder writes their absolute paths into the build file,
    # so two checkouts sharing one build directory recompiled each other's kernels (~100 s a start)
    target = _cpu_signature() if march == "native" else march
    key = (source + _BUILD_FLAGS_VERSION + target.encode() + torch.__version__.encode()
           + str(_CSRC.resolve()).encode())
    digest = hashlib.sha256(key).hexdigest()[:16]
    build_dir = default_cache_dir() / "kernels" / digest
    build_dir.mkdir(parents=True, exist_ok=True)
    _put_ninja_on_path()
    if not any(build_dir.glob("*.so")):
        logger.warning("compiling llmaccel's CPU kernels%s (once per machine, ~1 min)",
                       "" if march == "native" else f" for -march={march}")
    name = f"llmaccel_cpu_{digest}"
    with _build_guard(build_dir):
        module = _import_built(name, build_dir)
        if module is None:
            module = load(name=name, sources=[str(path) for path in _SOURCES], build_directory=str(build_dir),
                          extra_cflags=["-O3", f"-march={march}", "-ffast-math", "-fno-finite-math-only",
                                        "-fopenmp"],
                          extra_ldflags=["-fopenmp"], verbose=False)
            (build_dir / _BUILT).touch()
    return module
