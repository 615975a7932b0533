"""What the machine is: the CPU and its instruction-set features, the cores, the GPU. Every result
file records it, since figures from one kind of machine say little of another."""

from __future__ import annotations

import functools
import os
import platform as _platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _first_cpu() -> dict[str, str]:
    """The first processor's fields in /proc/cpuinfo ('flags', 'model name', 'cpu family', ...), or
    none where it cannot be read."""
    fields: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip():
                if fields:
                    break
                continue
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_features() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    return set(_first_cpu().get("flags", "").split())


def cpu_family_model() -> str | None:
    """'family/model' of /proc/cpuinfo, e.g. '25/1' (AMD Zen 3) or '26/2' (Zen 5): "AMD EPYC" alone
    names both, and the two differ in AVX-512 and bfloat16 hardware."""
    fields = _first_cpu()
    if "cpu family" not in fields or "model" not in fields:
        return None
    return f"{fields['cpu family']}/{fields['model']}"


def amd_generation(cpu: str, family_model: str | None) -> str | None:
    """'Zen 3', 'Zen 4' or 'Zen 5' from an AMD CPU's family/model ('25/17'), by AMD's published model ranges
    (family 0x19: Zen 3 at models 0x00-0x0f and 0x20-0x5f, Zen 4 at 0x10-0x1f, 0x60-0x7f and 0xa0-0xaf;
    family 0x1a: Zen 5); None for other CPUs or numbers."""
    try:
        family, model = (int(part) for part in str(family_model).split("/"))
    except ValueError:
        return None
    if "AMD" not in cpu:
        return None
    if family == 0x1A:
        return "Zen 5"
    if family == 0x19:
        if model < 0x10 or 0x20 <= model < 0x60:
            return "Zen 3"
        if model < 0x20 or 0x60 <= model < 0x80 or 0xA0 <= model < 0xB0:
            return "Zen 4"
    return None


def cpu_model() -> str:
    return _first_cpu().get("model name") or _platform.processor() or _platform.machine()


BF16_HARDWARE = ("amx_bf16", "avx512_bf16")  # CPU features that compute bfloat16 natively
AUTO_DTYPE_ENV = "LLMACCEL_AUTO_DTYPE"


def auto_dtype(device: str, features: set[str] | None = None) -> str:
    """What `--dtype auto` means: bfloat16 where the hardware computes it natively (CUDA; a CPU with AMX
    or AVX512-BF16, where bf16 matmuls ran ~7x faster than float32), float32 elsewhere (on an AVX2-only
    CPU bf16 is emulated and ran ~5x slower). $LLMACCEL_AUTO_DTYPE pins the answer (the test suite pins
    float32, so its exact comparisons with HF float32 hold on every machine)."""
    pinned = os.environ.get(AUTO_DTYPE_ENV)
    if pinned:
        return pinned
    if device.startswith("cuda"):
        return "bfloat16"
    flags = cpu_features() if features is None else features
    return "bfloat16" if any(f in flags for f in BF16_HARDWARE) else "float32"


HUGE_PAGE = 2 * 2**20


def _meminfo(field: str) -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux), or None."""
    return _meminfo("MemAvailable")


def total_memory_bytes() -> int | None:
    """MemTotal from /proc/meminfo (Linux), or None."""
    return _meminfo("MemTotal")


def peak_rss_bytes() -> int:
    """This process's peak resident set so far (0 where the OS does not say)."""
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    except (ImportError, OSError):
        return 0


KEEP_FREED_MEMORY_ENV = "LLMACCEL_KEEP_FREED_MEMORY"  # 0: leave glibc's malloc as it is
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8  # glibc's mallopt parameters (malloc.h)


@functools.cache
def keep_freed_memory() -> bool:
    """Have glibc's malloc keep the memory a step frees for the next step's tensors (whether it took).

    By default glibc serves every allocation over 32 MiB with a fresh mmap and unmaps it when freed, so each
    chunk of a long prefill faulted in its activations page by page again (a 2,048-token chunk's MLP output
    at the 1B shape is 64-128 MB): 3.7 million page faults and 7.9 s of kernel time in an 8k-token prompt's
    prefill, whose first token came 11% sooner without them (Q8_0 1B shape, 2-core Zen 4). With mmap off
    and the heap trimmed only past 1 GiB free, freed blocks are reused; peak RSS is unchanged, and memory
    freed after a peak stays with the process (up to 1 GiB at the heap's top) for the next one. One arena:
    a thread's own (the server's engine thread) kept faulting its pages in as before. Called first thing by
    the CLI, before any thread has an arena, and by the engine. vLLM's and IPEX's CPU guides preload tcmalloc
    or jemalloc for the same reason; this needs no preload."""
    if os.environ.get(KEEP_FREED_MEMORY_ENV, "1") == "0" or _platform.system() != "Linux":
        return False
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    return all(mallopt(parameter, value) for parameter, value in ((_M_ARENA_MAX, 1), (_M_MMAP_MAX, 0),
                                                                (_M_TRIM_THRESHOLD, 1 << 30)))


def huge_page_buffer(nbytes: int) -> tuple[torch.Tensor, bool]:
    """(`nbytes` of zeroed anonymous memory as a uint8 tensor that starts on a 2 MiB boundary, advised
    MADV_HUGEPAGE; whether the advice was taken). Where it is not (not Linux, a kernel without
    transparent huge pages) the memory is plain pages. The tensor keeps its mapping alive."""
    import mmap

    import torch

    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = True
    try:
        region.madvise(mmap.MADV_HUGEPAGE)
    except (AttributeError, OSError):
        advised = False
    whole = torch.frombuffer(region, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + nbytes], advised


def read_bandwidth_gbps(megabytes: int = 512, repeats: int = 5) -> float:
    """Measured memory read bandwidth (GB/s): the best of `repeats` sums over a buffer far larger than
    the caches, with torch's threads, on transparent huge pages where the kernel gives them (as the
    decode weights are, model/weight_arena.py; 4 KiB pages read ~20% slower here). Batch-1 decode
    cannot stream weights faster than this."""
    import time

    import torch

    nbytes = megabytes * 2**20
    buffer = huge_page_buffer(nbytes)[0].view(torch.float32)
    torch.arange(buffer.numel(), out=buffer)  # no two pages alike: none can be served from a merged page
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        buffer.sum()
        best = min(best, time.perf_counter() - began)
    return nbytes / best / 1e9


def describe() -> dict[str, object]:
    """The machine, for result files: CPU model, usable cores, the features that decide kernel speed,
    torch's version and the GPU if any."""
    import torch

    flags = cpu_features()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu_model(), "cpu_family_model": cpu_family_model(), "cores": cores,
            "features": [f for f in FEATURES if f in flags], "torch": torch.__version__, "gpu": gpu}


def machine_record() -> dict[str, object]:
    """`describe()` plus the read bandwidth measured now: what every benchmark result file records."""
    return {**describe(), "read_bandwidth_gbps": round(read_bandwidth_gbps(), 1)}
