"""Builds llmaccel's C++ CPU kernels with the package, once per instruction-set level.

`pip install .` (and so `make setup`) compiles llmaccel/ops/csrc into one library per level of
llmaccel/ops/kernel_levels.py; at start llmaccel loads the best one the CPU runs, so a wheel built on one
kind of machine runs at full speed on another. Where the build fails (no compiler) the install goes on
and llmaccel compiles at the first start instead (the JIT fallback of llmaccel/ops/cpu_kernels.py).

torch's own builder (cpp_extension) compiles each extension alone with one set of flags: the three levels
compiled bindings.cpp, the one file that includes pybind11 and torch's Python headers, three times, one
level at a time. Here one ninja file holds every level with torch's flags for a CPU extension: each
level's kernel files with its -march, bindings.cpp once, each level's module.cpp (the name Python imports
it by), a link per level; ninja runs them in parallel and, on a rebuild, only what changed. The libraries
are then kept in a machine-wide cache keyed by the sources' digest: a second clone or venv with the same
sources copies them and compiles nothing.

The package's metadata is in pyproject.toml; this file only adds the kernels.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import shlex
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).parent
SKIP_ENV = "LLMACCEL_SKIP_KERNEL_BUILD"  # 1: build no kernels (the first start compiles them instead)
BINDINGS, MODULE = "bindings.cpp", "module.cpp"


def _kernel_levels():
    """llmaccel/ops/kernel_levels.py, by path: importing the package would import what is not installed yet."""
    spec = importlib.util.spec_from_file_location("_llmaccel_kernel_levels", ROOT / "llmaccel/ops/kernel_levels.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


levels = _kernel_levels()


def _cache_dir() -> Path:
    """Where built libraries are kept for the next clone (where llmaccel.config.default_cache_dir says)."""
    root = os.environ.get("LLMACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmaccel")
    return Path(root) / "builds"


def _torch_flags() -> tuple[list[str], list[str]]:
    """(compile flags, link flags) as torch's cpp_extension gives a CPU extension."""
    from torch.utils.cpp_extension import include_paths, library_paths

    includes = [*include_paths(), sysconfig.get_paths()["include"]]
    compile_flags = ["-DNDEBUG", "-fwrapv", "-fPIC", "-std=c++20", "-DTORCH_API_INCLUDE_EXTENSION_H", "-g0",
                     "-Wno-maybe-uninitialized", *(f"-I{path}" for path in includes)]
    link_flags = [*(f"-L{path}" for path in library_paths()), "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python",
                  "-fopenmp", "-Wl,-Bsymbolic-functions"]  # a level's calls stay inside its own library
    return compile_flags, link_flags


def _ninja_file(outputs: dict[str, Path], digest: str) -> str:
    """The build of each level's library at outputs[level name]."""
    compile_flags, link_flags = _torch_flags()
    lines = [
        f"cxx = {os.environ.get('CXX', 'c++')}",
        f"cflags = {shlex.join(compile_flags)}",
        f"ldflags = {shlex.join(link_flags)}",
        "rule compile",
        "  command = $cxx -MMD -MF $out.d $cflags $flags -c $in -o $out",
        "  depfile = $out.d",
        "  deps = gcc",
        "  description = $what",
        "rule link",
        "  command = $cxx -shared $in $ldflags -o $out",
        "  description = linking $out",
        f"build bindings.o: compile {levels.CSRC / BINDINGS}",
        "  flags = -O2",  # glue, the same for every level: no -march
        "  what = the Python bindings (every level)",
    ]
    kernels = [path for path in levels.sources() if path.name not in (BINDINGS, MODULE)]
    for level in levels.LEVELS:
        if level.name not in outputs:
            continue
        objects = []
        for source in [*kernels, levels.CSRC / MODULE]:
            objects.append(f"{level.name}/{source.stem}.o")
            flags = [*levels.COMMON_FLAGS, *level.flags]
            if source.name == MODULE:
                flags = ["-O2", f"-DLLMACCEL_MODULE={level.module.rsplit('.', 1)[1]}",
                         f"-DLLMACCEL_KERNEL_LEVEL={level.name}", f"-DLLMACCEL_BUILD_ID={digest}"]
            lines += [f"build {objects[-1]}: compile {source}", f"  flags = {shlex.join(flags)}",
                      f"  what = {level.name}: {source.name}"]
        lines.append(f"build {outputs[level.name]}: link {' '.join(objects)} bindings.o")
    return "\n".join(lines) + "\n"


def _ninja() -> str:
    try:
        import ninja

        return str(Path(ninja.BIN_DIR) / "ninja")
    except ImportError:
        return "ninja"


class BuildKernels(build_ext):
    """Every level's library: from the machine-wide cache where the same sources were built before,
    else compiled in one ninja run (and then cached)."""

    def build_extensions(self) -> None:
        import torch

        digest = levels.source_digest()
        cache = _cache_dir() / f"{digest}-torch{torch.__version__}-{sys.implementation.cache_tag}"
        targets = {ext.name.rsplit("_kernels_", 1)[1]: Path(self.get_ext_fullpath(ext.name))
                   for ext in self.extensions}
        missing = {name: cache / target.name for name, target in targets.items()
                   if not (cache / target.name).exists()}
        if missing:
            began = time.perf_counter()
            print(f"llmaccel: compiling the CPU kernels for {', '.join(missing)} (a few minutes on 2 cores; "
                  "once per machine and set of sources)", file=sys.stderr, flush=True)
            temp = Path(self.build_temp) / "llmaccel-kernels"
            temp.mkdir(parents=True, exist_ok=True)
            staged = {name: temp / "out" / path.name for name, path in missing.items()}
            (temp / "build.ninja").write_text(_ninja_file({n: p.resolve() for n, p in staged.items()}, digest))
            try:  # ninja's progress lines ([12/40] avx2: gemv.cpp) go where pip -v shows them
                subprocess.run([_ninja(), "-C", str(temp), f"-j{os.cpu_count() or 1}"], check=True,
                               stdout=sys.stderr)
            except (OSError, subprocess.CalledProcessError) as exc:
                print(f"llmaccel: WARNING: could not compile the CPU kernels ({exc}); llmaccel will compile "
                      "them at the first start instead", file=sys.stderr)
                return
            cache.mkdir(parents=True, exist_ok=True)
            for name, built in staged.items():
                partial = missing[name].with_suffix(f".{os.getpid()}.partial")
                shutil.copyfile(built, partial)
                partial.replace(missing[name])  # whole or absent, if two installs race
            print(f"llmaccel: compiled in {time.perf_counter() - began:.0f} s, kept in {cache}", file=sys.stderr)
        else:
            print(f"llmaccel: CPU kernels reused from {cache}", file=sys.stderr)
        for target in targets.values():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(cache / target.name, target)


def _extensions() -> list[Extension]:
    if os.environ.get(SKIP_ENV) == "1" or platform.machine() not in ("x86_64", "AMD64"):
        return []
    # BuildKernels compiles them all at once; setuptools needs an entry per library to ship
    return [Extension(level.module, sources=[]) for level in levels.LEVELS]


setup(ext_modules=_extensions(), cmdclass={"build_ext": BuildKernels})
