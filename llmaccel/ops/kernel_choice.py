"""Which kernel computes a bfloat16 projection at each row count: timed on this machine, on the model's
own weights, checked against a float64 reference, and cached.

Three kernels read the same plain bf16 weight [N, K] (the model holds one copy):
- `stream` (csrc/linear_bf16.cpp): one weight row at a time in float32; bandwidth-bound, so the fastest at
  one or two rows everywhere, and slow past a few;
- `gemm` (csrc/gemm_bf16.cpp): llmaccel's AVX512-BF16 GEMM (only where that was compiled);
- `onednn` (F.linear): oneDNN's GEMM, the only one that uses AMX.
Which wins depends on the CPU, the shape and the rows (measured on a 2-core AMD EPYC Zen 4: the GEMM
1.1-1.25x oneDNN at 64 rows, oneDNN ahead at some prefill shapes; on an AMX Xeon oneDNN should win every
batch), so none is assumed: `tune_bf16` times each candidate at every row bucket on the model's own
weights, after checking its output against float64, and keeps the fastest. The layers' projections take
one choice a bucket (the fastest in sum over qkv, o, gate_up and down), so the decode stack and the
layer-by-layer path run the same kernel at the same rows and agree to the bit; the LM head takes its
own. The result is cached per machine, torch, kernel build and shapes, so the next start reads it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmaccel.config import default_cache_dir
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.platform import cpu_features, cpu_model

logger = logging.getLogger(__name__)
FORCE_ENV = "LLMACCEL_BF16_KERNEL"  # stream, gemm or onednn: every row count (tests, A/B runs)
LAYER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024)
HEAD_BUCKETS = LAYER_BUCKETS[:16]  # the LM head sees one row a sequence: up to 256
STREAM_MAX_ROWS = 16  # the streaming kernel is not timed past this (it reads every row in float32)
MAX_RELATIVE_ERROR = 2e-2  # bf16 outputs carry ~4e-3; a wrong kernel is off by far more


@dataclass(frozen=True)
class Bf16Choice:
    """The kernel for each row count: `buckets` pairs (up to this many rows, kernel), ascending; rows
    past the last bucket take its kernel."""

    buckets: tuple[tuple[int, str], ...]

    def kernel(self, rows: int) -> str:
        limits = [limit for limit, _ in self.buckets]
        return self.buckets[min(bisect.bisect_left(limits, rows), len(self.buckets) - 1)][1]

    def describe(self) -> str:
        runs: list[tuple[int, str]] = []
        for limit, kernel in self.buckets:
            if runs and runs[-1][1] == kernel:
                runs[-1] = (limit, kernel)
            else:
                runs.append((limit, kernel))
        parts = [f"{kernel} <= {limit}" for limit, kernel in runs[:-1]] + [f"{runs[-1][1]} above"]
        return ", ".join(parts)


# Before tuning (and where tuning does not apply): the streaming kernel to two rows, oneDNN past them.
DEFAULT_CHOICE = Bf16Choice(((2, "stream"), (1 << 30, "onednn")))


def forced_choice() -> Bf16Choice | None:
    name = os.environ.get(FORCE_ENV)
    if not name:
        return None
    if name not in candidates():
        raise ValueError(f"${FORCE_ENV}={name!r} is not a kernel this machine has: {', '.join(candidates())}")
    return Bf16Choice(((1 << 30, name),))


def candidates() -> tuple[str, ...]:
    kernels = load_cpu_kernels()
    if kernels is None:
        return ("onednn",)
    gemm = hasattr(kernels, "gemm_bf16_available") and kernels.gemm_bf16_available()
    return ("stream", "gemm", "onednn") if gemm else ("stream", "onednn")


def run_bf16(kernel: str, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x @ weight.T in x's dtype by the named kernel (no bias)."""
    if kernel == "stream":
        return load_cpu_kernels().gemv_bf16(x, weight).to(x.dtype)
    if kernel == "gemm":
        return load_cpu_kernels().gemm_bf16(x, weight)
    return F.linear(x, weight)


def _median_seconds(kernel: str, x: torch.Tensor, weight: torch.Tensor) -> float:
    run_bf16(kernel, x, weight)  # warm: oneDNN builds its primitive, caches fill
    repeats = 5 if x.shape[0] * weight.numel() < 64 * 4_000_000 else 3
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run_bf16(kernel, x, weight)
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _check(kernel: str, weight: torch.Tensor) -> str | None:
    """None if the kernel matches float64 at a few and at many rows, else what it got wrong."""
    generator = torch.Generator().manual_seed(0)
    for rows in (3, 37):
        x = torch.randn(rows, weight.shape[1], generator=generator).to(torch.bfloat16)
        reference = x.double() @ weight.double().T
        error = (run_bf16(kernel, x, weight).double() - reference).abs().max().item()
        scale = reference.abs().max().item() or 1.0
        if not error <= MAX_RELATIVE_ERROR * scale:
            return f"{kernel} at {rows} rows x {tuple(weight.shape)}: error {error:.3g} against {scale:.3g}"
    return None


def _fastest(weights: list[torch.Tensor], buckets: tuple[int, ...], kernels: tuple[str, ...],
             timings: dict) -> Bf16Choice:
    """The kernel with the least total time over `weights` at each bucket."""
    chosen = []
    for rows in buckets:
        xs = [torch.randn(rows, w.shape[1]).to(torch.bfloat16) for w in weights]
        totals = {kernel: sum(_median_seconds(kernel, x, w) for x, w in zip(xs, weights, strict=True))
                  for kernel in kernels if kernel != "stream" or rows <= STREAM_MAX_ROWS}
        timings[str(rows)] = {k: round(v * 1e6, 1) for k, v in totals.items()}
        chosen.append((rows, min(totals, key=totals.get)))
    return Bf16Choice(tuple(chosen))


def _cache_path(layer_weights: list[torch.Tensor], head: torch.Tensor | None) -> Path:
    kernels = load_cpu_kernels()
    shapes = [tuple(w.shape) for w in layer_weights] + ([tuple(head.shape)] if head is not None else [])
    key = json.dumps([cpu_model(), sorted(cpu_features()), torch.__version__, torch.get_num_threads(),
                      getattr(kernels, "__name__", ""), shapes, LAYER_BUCKETS])
    return default_cache_dir() / "kernel_choice" / f"bf16-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def tune_bf16(layer_weights: list[torch.Tensor],
              head: torch.Tensor | None) -> tuple[Bf16Choice | None, Bf16Choice | None]:
    """(the layers' choice, the LM head's) for these bf16 weights (a layer's projections, or none; the
    head or None): from the cache, or timed now."""
    forced = forced_choice()
    if forced is not None:
        return forced if layer_weights else None, forced if head is not None else None
    path = _cache_path(layer_weights, head)
    try:
        saved = json.loads(path.read_text())
        layers = Bf16Choice(tuple((int(r), k) for r, k in saved["layers"])) if saved["layers"] else None
        head_choice = Bf16Choice(tuple((int(r), k) for r, k in saved["lm_head"])) if saved["lm_head"] else None
        logger.info("bf16 kernels (cached, %s): layers %s; LM head %s", path, layers.describe() if layers else "-",
                    head_choice.describe() if head_choice else "-")
        return layers, head_choice
    except (OSError, ValueError, KeyError, TypeError):
        pass
    start = time.perf_counter()
    timings: dict = {"layers": {}, "lm_head": {}}
    with torch.inference_mode():
        usable = []
        for kernel in candidates():
            failed = next(filter(None, (_check(kernel, w) for w in layer_weights + [head] if w is not None)), None)
            if failed:
                logger.warning("bf16 kernel %s; not used", failed)
            else:
                usable.append(kernel)
        usable = tuple(usable) or ("onednn",)
        layers = _fastest(layer_weights, LAYER_BUCKETS, usable, timings["layers"]) if layer_weights else None
        head_choice = _fastest([head], HEAD_BUCKETS, usable, timings["lm_head"]) if head is not None else None
    seconds = time.perf_counter() - start
    logger.info("bf16 kernels timed in %.1f s: layers %s; LM head %s", seconds, layers.describe() if layers else "-",
                head_choice.describe() if head_choice else "-")
    record = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "seconds": round(seconds, 2),
              "layers": [list(b) for b in layers.buckets] if layers else None,
              "lm_head": [list(b) for b in head_choice.buckets] if head_choice else None,
              "microseconds": timings}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the kernel choice at %s (%s)", path, exc)
    return layers, head_choice
