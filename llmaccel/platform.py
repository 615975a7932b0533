"""What the machine is: the CPU and its instruction-set features, the cores, the GPU. Every result
file records it, since figures from one kind of machine say little of another."""

from __future__ import annotations

import os
import platform as _platform
from pathlib import Path

FEATURES = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def cpu_features() -> set[str]:
    """The instruction-set flags /proc/cpuinfo lists (empty where it cannot be read)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return _platform.processor() or _platform.machine()


def describe() -> dict[str, object]:
    """The machine, for result files: CPU model, usable cores, the features that decide kernel speed,
    torch's version and the GPU if any."""
    import torch

    flags = cpu_features()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": cpu_model(), "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count(), "features": [f for f in FEATURES if f in flags], "torch": torch.__version__,
            "gpu": gpu}
