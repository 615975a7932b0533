"""Which kernel computes a bfloat16 projection at each row count, and in which weight layout: timed on
this machine, on the model's own weights, checked against a float64 reference, and cached.

The model holds one copy of each bf16 weight, in one of two layouts, each with its kernels:
- `plain` [N, K]: `stream` (csrc/linear_bf16.cpp: one weight row at a time; bandwidth-bound, the
  fastest at one or two rows, slow past a few), `gemm` (csrc/gemm_bf16.cpp: llmaccel's AVX512-BF16
  GEMM, where that was compiled) and `onednn` (F.linear: oneDNN's GEMM, called between the decode
  stack's phases);
- `vnni` (csrc/linear_vnni.cpp: blocks of 32 columns of input pairs, the layout AMX tiles read):
  `vnni_stream` (few rows) and `brgemm` (oneDNN's AMX micro-kernel inside llmaccel's own threads),
  where torch's brgemm can pack bf16 (an AMX CPU); and on any AVX512-BF16 CPU `ordered_stream` and
  `ordered_gemm`, which sum every output in the plain `gemm`'s order, so a row's bits do not depend on the
  rows beside it or on which of the two runs it: --batch-invariant times these two only (issue 50);
- `compact` (csrc/bf16_compact.cpp: 12 bits a weight, lossless): `compact_stream` and `compact_gemm`, the
  plain kernels' sums to the bit from 0.75 of the bytes, where AVX512-BF16 was compiled. Chosen within
  COMPACT_TOLERANCE of the fastest layout: it also holds the model in 0.75 of the memory.
Which wins depends on the CPU, the shape and the rows (a 2-core AMD EPYC Zen 4: the GEMM 1.1-1.25x oneDNN
at 64 rows; a 2-core Xeon with AMX: brgemm several times oneDNN from 4 rows up), so none is assumed:
`tune_bf16` times every candidate at every row bucket on the model's own weights, after checking its
output against float64, keeps each layout's fastest per bucket, then the layout that is faster over the
buckets (the geometric mean; `pick_layout`). The layers' projections take one choice (the
fastest in sum over qkv, o, gate_up and down), so the decode stack and the layer-by-layer path run the
same kernel at the same rows and agree to the bit; the LM head takes its own. Up to DECODE_ROWS rows
the layers are timed over one pass through every layer's projections, as a decode step reads them. The
result is cached per machine, torch, kernel build and shapes, so the next start reads it.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from llmaccel.config import default_cache_dir
from llmaccel.ops.cpu_kernels import kernels_id, load_cpu_kernels
from llmaccel.platform import cpu_features, cpu_model

logger = logging.getLogger(__name__)
FORCE_ENV = "LLMACCEL_BF16_KERNEL"  # one kernel at every row count, in its layout (tests, A/B runs)
# One layout's kernels only, still timed per row count: plain, vnni or compact (compact: 0.75 of the memory and
# the fastest lone request wherever the timing would pick plain for batches, e.g. the 3B and 8B shapes)
LAYOUT_ENV = "LLMACCEL_BF16_LAYOUT"
QUANT_FORCE_ENV = "LLMACCEL_QUANT_KERNEL"  # the same for INT8/INT4 weights: stream or dequant_amx
# Steps of 1.5x to 64 rows, where the fastest kernel changes, and of 2x past them, where a projection is compute-bound
# and the kernels' ratios move slowly (an 8B shape's layer and head timed on a Zen 4: the fastest kernel at 96 rows
# was the one at 128, and at 192 the one at 256, in 11 of 12 such pairs); the 96- and 192-row buckets took ~6 s of
# the 8B shape's first start.
LAYER_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128, 256, 512, 1024)
HEAD_BUCKETS = tuple(rows for rows in LAYER_BUCKETS if rows <= 256)  # the LM head sees one row a sequence
STREAM_MAX_ROWS = 16  # the streaming kernel is not timed past this (it reads every row in float32)
# Up to this many rows a decode step is bound by reading the weights, and which kernel reads fastest
# depends on where they come from: these buckets are timed over every layer's projections in turn, as a
# decode step reads them, not over one layer's, which stay in cache between repeats. On the AMX Xeon one
# layer's timing picked vnni_stream for one row (13% ahead of brgemm in cache) while brgemm decoded the
# lone request faster (69.6 against 65.8 tok/s), and the two kernels round differently. Up to 16 rows:
# the compact layout reads 0.75 of the bytes and decodes them, which loses in cache (4-16 rows of a 1B
# shape's layer: 1.0-1.3x the plain kernels' time on a Zen 4) and wins from memory, as a step reads.
DECODE_ROWS = 16
# A bucket's kernels are timed for about this long each: past ~100 rows a call is compute-bound and lasts a
# quarter second or more at the 8B shape (a 1,024-row pass of a layer 1.1-1.5 s), where repeats moved a kernel's
# time by 0-4%, against the 10-30% between kernels; four calls each there took 55 of the timing's 116 s.
MIN_TIMED_SECONDS = 0.25
MAX_RELATIVE_ERROR = 2e-2  # bf16 outputs carry ~4e-3; a wrong kernel is off by far more
PACKED_KERNELS = ("vnni_stream", "brgemm")  # the kernels that read the vnni layout with AMX's help
# the vnni layout's kernels on any AVX512-BF16 CPU, both summing in the plain `gemm` kernel's order: a row's output
# does not depend on the rows beside it or on which of them runs it (--batch-invariant runs only these)
ORDERED_KERNELS = ("ordered_stream", "ordered_gemm")
COMPACT_KERNELS = ("compact_stream", "compact_gemm")  # the kernels that read the compact layout; the rest plain


def kernel_layout(kernel: str) -> str:
    """The weight layout a kernel reads: plain, vnni or compact."""
    if kernel in PACKED_KERNELS or kernel in ORDERED_KERNELS:
        return "vnni"
    return "compact" if kernel in COMPACT_KERNELS else "plain"


@dataclass(frozen=True)
class Bf16Choice:
    """The kernel for each row count: `buckets` pairs (up to this many rows, kernel), ascending; rows
    past the last bucket take its kernel. `layout`: the weight layout every one of them reads."""

    buckets: tuple[tuple[int, str], ...]
    layout: str = "plain"

    def __post_init__(self) -> None:
        if any(kernel_layout(kernel) != self.layout for _, kernel in self.buckets):
            raise ValueError(f"a {self.layout} layout's choice names another layout's kernel: {self.buckets}")

    def kernel(self, rows: int) -> str:
        limits = [limit for limit, _ in self.buckets]
        return self.buckets[min(bisect.bisect_left(limits, rows), len(self.buckets) - 1)][1]

    def lone_kernel_to(self, rows: int) -> Bf16Choice:
        """This choice with every row count up to `rows` run by the kernel one row gets. Kernels round
        differently (each alone gives a row the same result at any row count), so a lone request's 1 + K
        verification rows then compute what its single decode row computes without drafts."""
        return Bf16Choice(((rows, self.kernel(1)), *((limit, k) for limit, k in self.buckets if limit > rows)),
                          self.layout)

    def describe(self) -> str:
        runs: list[tuple[int, str]] = []
        for limit, kernel in self.buckets:
            if runs and runs[-1][1] == kernel:
                runs[-1] = (limit, kernel)
            else:
                runs.append((limit, kernel))
        parts = [f"{kernel} <= {limit}" for limit, kernel in runs[:-1]] + [f"{runs[-1][1]} above"]
        return ", ".join(parts) + ("" if self.layout == "plain" else f" ({self.layout} weights)")


# Before tuning (and where tuning does not apply): the streaming kernel to two rows, oneDNN past them.
DEFAULT_CHOICE = Bf16Choice(((2, "stream"), (1 << 30, "onednn")))


def forced_choice() -> Bf16Choice | None:
    name = os.environ.get(FORCE_ENV)
    if not name:
        return None
    if name not in candidates():
        raise ValueError(f"${FORCE_ENV}={name!r} is not a kernel this machine has: {', '.join(candidates())}")
    return Bf16Choice(((1 << 30, name),), kernel_layout(name))


def candidates() -> tuple[str, ...]:
    kernels = load_cpu_kernels()
    if kernels is None:
        return ("onednn",)
    gemm = hasattr(kernels, "gemm_bf16_available") and kernels.gemm_bf16_available()
    packed = PACKED_KERNELS if hasattr(kernels, "vnni_available") and kernels.vnni_available() else ()
    compact = COMPACT_KERNELS if compact_available() else ()
    return ("stream", "gemm", "onednn", *packed, *ORDERED_KERNELS, *compact) if gemm else ("stream", "onednn", *packed)


def compact_available() -> bool:
    kernels = load_cpu_kernels()
    return kernels is not None and hasattr(kernels, "bf16_compact_available") and kernels.bf16_compact_available()


def pack_vnni(weight: torch.Tensor) -> torch.Tensor:
    """The vnni layout of a plain bf16 weight [N, K] (K even): [ceil(N / 32), K / 2, 32, 2]."""
    return load_cpu_kernels().pack_vnni(weight.contiguous())


def packable(weight: torch.Tensor) -> bool:
    return weight.dim() == 2 and weight.shape[1] % 2 == 0 and weight.dtype == torch.bfloat16


# How much slower over the row buckets (geometric mean) the compact layout may be and still be chosen: it
# holds the weights in 0.75 of the memory, and a lone request reads 0.75 of the bytes (a 1B shape's layers on
# a 2-core Zen 4: 1.5x the plain kernels' speed at 1-3 rows, 0.85-1.0x at 24-1024 rows in cache, 1.01x overall).
# On a 2-core Zen 5 the 1B shape's timing gives compact 0.93-0.95x over the buckets (1.05-1.17x at 1-6 rows),
# and served it decodes a lone request 1.31-1.35x OpenVINO's and llama.cpp's speed side by side against the plain
# layout's 1.14-1.16x, at 0.93-0.95x its 64-request batch (docs/benchmarks.md): 10%, not 5%, takes it there.
COMPACT_TOLERANCE = 0.10
# A compact weight keeps a block of 64 whole where a high byte is not among its 16 codes (224 bytes then,
# against 128 plain): past this share of such blocks the layout would save little, and it is not used.
MAX_WHOLE_SHARE = 0.1


def pack_compact(weight: torch.Tensor, into: torch.Tensor | None = None) -> torch.Tensor | None:
    """The compact layout of a plain bf16 weight [N, K] (csrc/bf16_compact.cpp: 12 bits a weight, lossless),
    or None where it does not apply (K not a multiple of 64, not bfloat16, or too few weights it codes).
    `into`: uint8 bytes to write it at the front of where it fits (a weight arena's free bytes)."""
    if not (weight.dim() == 2 and weight.shape[1] % 64 == 0 and weight.dtype == torch.bfloat16
            and weight.device.type == "cpu" and weight.numel() > 0 and compact_available()):
        return None
    packed = load_cpu_kernels().pack_bf16_compact(weight.contiguous(), into)
    whole_blocks = packed[32:40].view(torch.int64).item()  # the header's count (bf16_compact.cpp)
    return None if whole_blocks > MAX_WHOLE_SHARE * weight.numel() / 64 else packed


def layout_weight(weight: torch.Tensor, layout: str, into: torch.Tensor | None = None) -> torch.Tensor:
    """A plain bf16 weight in `layout` (plain: itself); ValueError where that layout cannot hold it. `into`: for
    the compact layout, uint8 bytes to write it at the front of where it fits (pack_compact)."""
    if layout == "vnni":
        return pack_vnni(weight)
    if layout == "compact":
        packed = pack_compact(weight, into)
        if packed is None:
            raise ValueError(f"a bf16 weight {tuple(weight.shape)} does not fit the compact layout")
        return packed
    return weight


def run_bf16(kernel: str, x: torch.Tensor, weight: torch.Tensor, n: int | None = None) -> torch.Tensor:
    """x @ weight.T in x's dtype by the named kernel (no bias): `weight` in the kernel's layout (packed
    for vnni_stream and brgemm, which also need the output count `n`)."""
    if kernel in PACKED_KERNELS or kernel in ORDERED_KERNELS:
        return load_cpu_kernels().linear_vnni(x, weight, n, kernel)
    if kernel in COMPACT_KERNELS:
        return load_cpu_kernels().linear_bf16_compact(x, weight, kernel == "compact_gemm").to(x.dtype)
    if kernel == "stream":
        return load_cpu_kernels().gemv_bf16(x, weight).to(x.dtype)
    if kernel == "gemm":
        return load_cpu_kernels().gemm_bf16(x, weight)
    return F.linear(x, weight)


CHECK_ROWS = (3, 37)  # a kernel's output is checked at a few rows and at many


class _Checked:
    """A weight to time (`plain`: its float values) with its check cases, made on first use and kept: inputs at
    CHECK_ROWS rows and their float64 products, one reference a weight whichever kernels are checked against it
    (made per kernel, the 8B shape's references took 27 s of a 116 s timing)."""

    plain: torch.Tensor
    _cases: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    def check_cases(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        if self._cases is None:
            generator = torch.Generator().manual_seed(0)
            xs = [torch.randn(rows, self.plain.shape[1], generator=generator).to(torch.bfloat16) for rows in CHECK_ROWS]
            references = _float64_product(torch.cat(xs), self.plain).split(CHECK_ROWS)  # one pass over the weight
            self._cases = list(zip(xs, references, strict=True))
        return self._cases


class _Weight(_Checked):
    """A plain weight and, made on first use, its copy in each other layout: each kernel reads its own."""

    def __init__(self, plain: torch.Tensor) -> None:
        self.plain, self._layouts = plain, {"plain": plain}

    def fits(self, layout: str) -> bool:
        """Whether this weight can be held in `layout` (made now, kept for the timing)."""
        if layout not in self._layouts:
            self._layouts[layout] = pack_compact(self.plain) if layout == "compact" else layout_weight(self.plain,
                                                                                                      layout)
        return self._layouts[layout] is not None

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        layout = kernel_layout(kernel)
        if not self.fits(layout):
            raise ValueError(f"a bf16 weight {tuple(self.plain.shape)} does not fit the {layout} layout")
        return run_bf16(kernel, x, self._layouts[layout], self.plain.shape[0])


class _QuantizedWeight(_Checked):
    """An INT8/INT4 module in llmaccel's blocks, run by the streaming or the AMX kernel; `plain` is its
    weight in float32 (the reference, and the shapes)."""

    def __init__(self, module) -> None:
        self.module, self.plain = module, module.dequantized()

    def run(self, kernel: str, x: torch.Tensor) -> torch.Tensor:
        return self.module.block_product(x, kernel)


def _interleaved_seconds(kernels: tuple[str, ...], run_once: Callable[[str], None], rounds: int,
                         warm_up: bool = True) -> dict[str, float]:
    """Each kernel's median time of `run_once(kernel)`, the kernels taking turns round by round (the order
    rotated each round) after one warm-up call each (oneDNN builds its primitive, caches fill). In turns, not
    one kernel's repeats after another's: this VM's read bandwidth flips between ~50 and ~83 GB/s within
    seconds (a 2-core Zen 5), and timed back to back a flip landed on one kernel's repeats alone (the compact
    layout's 4-row pass once read 0.58x the plain one's speed; taking turns, 0.9-1.25x).
    Only as many rounds as take MIN_TIMED_SECONDS a kernel by its warm-up call, one at least; `warm_up=False`
    (the caller's last bucket already took that long a call): one round, no warm-up."""
    slowest = 0.0
    for kernel in kernels if warm_up else ():
        start = time.perf_counter()
        run_once(kernel)
        slowest = max(slowest, time.perf_counter() - start)
    rounds = max(1, min(rounds, math.ceil(MIN_TIMED_SECONDS / slowest))) if slowest > 0 else 1
    times: dict[str, list[float]] = {kernel: [] for kernel in kernels}
    for r in range(rounds):
        for kernel in kernels[r % len(kernels):] + kernels[:r % len(kernels)]:
            start = time.perf_counter()
            run_once(kernel)
            times[kernel].append(time.perf_counter() - start)
    return {kernel: sorted(t)[len(t) // 2] for kernel, t in times.items()}


def _check(kernel: str, weight: torch.Tensor | _Weight | _QuantizedWeight) -> str | None:
    """None if the kernel matches float64 at a few and at many rows, else what it got wrong."""
    weight = weight if isinstance(weight, _Checked) else _Weight(weight)
    for x, reference in weight.check_cases():
        error = (weight.run(kernel, x).double() - reference).abs().max().item()
        scale = reference.abs().max().item() or 1.0
        if not error <= MAX_RELATIVE_ERROR * scale:
            return f"{kernel} at {len(x)} rows x {tuple(weight.plain.shape)}: error {error:.3g} against {scale:.3g}"
    return None


def _float64_product(x: torch.Tensor, weight: torch.Tensor, rows_at_once: int = 8192) -> torch.Tensor:
    """x @ weight.T in float64, a slice of the weight's rows at a time: widened whole, an 8B shape's LM head
    would take 4.2 GB beside the model at load."""
    x = x.double()
    return torch.cat([x @ weight[i:i + rows_at_once].double().T for i in range(0, weight.shape[0], rows_at_once)],
                     dim=1)


def _run_all(calls: list[tuple], kernel: str) -> None:
    for weight, x in calls:
        weight.run(kernel, x)


def _pass_seconds(kernels: tuple[str, ...], rows: int, weights: list) -> dict[str, float]:
    """Each kernel's median time of one pass over every weight in turn at `rows` rows, as a decode step makes
    one, the kernels taking turns."""
    xs = {w.plain.shape[1]: torch.randn(rows, w.plain.shape[1]).to(torch.bfloat16) for w in weights}
    return _interleaved_seconds(kernels, functools.partial(_run_all, [(w, xs[w.plain.shape[1]]) for w in weights]), 4)


def _fastest(weights: list, buckets: tuple[int, ...], kernels: tuple[str, ...], timings: dict,
             few_rows_only: tuple[str, ...], decode_weights: list | None = None) -> Bf16Choice:
    """The layout, and in it the kernel with the least total time over `weights` at each bucket (the
    `few_rows_only` kernels are not timed past STREAM_MAX_ROWS). With `decode_weights` (every layer's),
    the buckets up to DECODE_ROWS are timed over a pass through all of them instead."""
    best: dict[str, list[tuple[int, str, float]]] = {"plain": [], "vnni": [], "compact": []}
    long_calls = False  # whether every kernel's call at the last bucket took MIN_TIMED_SECONDS: warm, and no noise
    for rows in buckets:
        usable = [k for k in kernels if k not in few_rows_only or rows <= STREAM_MAX_ROWS]
        if decode_weights and rows <= DECODE_ROWS:
            totals = _pass_seconds(tuple(usable), rows, decode_weights)
        else:  # one layer's projections (or the head), each once a turn
            repeats = 5 if rows * sum(w.plain.numel() for w in weights) < 64 * 4_000_000 else 3
            calls = [(w, torch.randn(rows, w.plain.shape[1]).to(torch.bfloat16)) for w in weights]
            totals = _interleaved_seconds(tuple(usable), functools.partial(_run_all, calls), repeats,
                                          warm_up=not long_calls)
        long_calls = min(totals.values()) >= MIN_TIMED_SECONDS
        timings[str(rows)] = {k: round(v * 1e6, 1) for k, v in totals.items()}
        for layout in best:
            names = [k for k in totals if kernel_layout(k) == layout]
            if names:
                kernel = min(names, key=totals.get)
                best[layout].append((rows, kernel, totals[kernel]))
    layout = pick_layout({name: [t for _, _, t in runs] for name, runs in best.items()}, len(buckets))
    return Bf16Choice(tuple((rows, kernel) for rows, kernel, _ in best[layout]), layout)


def pick_layout(seconds: dict[str, list[float]], buckets: int) -> str:
    """The layout whose fastest kernels take the least time over the buckets (the geometric mean), among those
    timed at every bucket; the compact one where it is within COMPACT_TOLERANCE of that, as it holds the
    weights in 0.75 of the memory."""
    timed = [name for name, times in seconds.items() if len(times) == buckets and buckets > 0]
    if not timed:
        return "plain"
    mean_log = {name: sum(math.log(t) for t in seconds[name]) / buckets for name in timed}
    layout = min(timed, key=mean_log.get)
    if "compact" in mean_log and mean_log["compact"] <= mean_log[layout] + math.log1p(COMPACT_TOLERANCE):
        return "compact"
    return layout


def cached_bf16_choice(layer_shapes: list[tuple[int, int]], head_shape: tuple[int, int] | None, decode_count: int,
                       invariant: bool = False, layout: str | None = None
                       ) -> tuple[Bf16Choice | None, Bf16Choice | None] | None:
    """What `tune_bf16` would give for weights of these shapes (a layer's projections, the head's or None;
    `decode_count`: how many projections it would time as a decode step reads them, len(model_weights)) without
    timing anything: the forced kernel, or the cached timing; None where the weights would have to be timed. A
    load that knows the choice before it reads the weights writes each straight into the chosen layout."""
    forced = _forced_choice(invariant)
    if forced is not None:
        return forced if layer_shapes else None, forced if head_shape is not None else None
    shapes = [tuple(s) for s in layer_shapes] + ([tuple(head_shape)] if head_shape is not None else [])
    return _from_cache("bf16", _bf16_cache(shapes, decode_count, invariant, layout)[0])


def _forced_choice(invariant: bool) -> Bf16Choice | None:
    """${FORCE_ENV}'s kernel at every row count (forced_choice), or None where none is forced; a ValueError where
    --batch-invariant rules it out."""
    forced = forced_choice()
    if forced is None:
        return None
    _check_invariant_possible(invariant)
    if invariant and forced.buckets[0][1] not in ORDERED_KERNELS:
        raise ValueError(f"${FORCE_ENV}={forced.buckets[0][1]!r} is not batch-invariant: with --batch-invariant "
                         f"force one of {', '.join(ORDERED_KERNELS)}")
    return forced


def _check_invariant_possible(invariant: bool) -> None:
    if invariant and not set(ORDERED_KERNELS) <= set(candidates()):
        raise ValueError("--batch-invariant in bfloat16 runs the ordered kernels, which need AVX512-BF16; this CPU "
                         "lacks it: use --dtype float32")


def _bf16_cache(shapes: list[tuple[int, ...]], decode_count: int, invariant: bool,
                layout: str | None) -> tuple[Path, tuple[str, ...]]:
    """(where the timing of bf16 weights of these shapes is cached, the kernels it offers): `decode_count`
    projections timed as a decode step reads them (0: none); ValueError for a batch-invariant or layout request
    this machine has no kernels for."""
    _check_invariant_possible(invariant)
    wanted = layout or os.environ.get(LAYOUT_ENV) or None

    # the ordered kernels run with --batch-invariant, or where the vnni layout is asked for: by default the timing
    # keeps to the kernels it chose before them (at 135M on a Zen 4 they decode within noise of those: 1.02x alone,
    # 1.03x at 64 rows, paired; not yet measured at the 1-8B shapes, where the compact layout holds 0.75 of the bytes)
    def offered_here(kernel: str) -> bool:
        if invariant:
            return kernel in ORDERED_KERNELS
        return kernel_layout(kernel) == wanted if wanted is not None else kernel not in ORDERED_KERNELS

    offered = tuple(k for k in candidates() if offered_here(k))
    if not offered:
        layouts = sorted({kernel_layout(k) for k in candidates()})
        asked = f"--bf16-layout {wanted}" if layout else f"${LAYOUT_ENV}={wanted!r}"
        raise ValueError(f"{asked} is not a bf16 layout this machine has kernels for: {', '.join(layouts)}")
    kind = "bf16" if not decode_count else f"bf16-decode{decode_count}"
    return _cache_path(shapes, "invariant-" + kind if invariant else kind if wanted is None else f"{kind}-{wanted}",
                       offered), offered


def _cache_path(shapes: list[tuple[int, ...]], kind: str, offered: tuple[str, ...] = ()) -> Path:
    """Where a timing is cached: per machine, torch, kernel build, weight kind, shapes and the kernels timed."""
    kernels = load_cpu_kernels()
    key = json.dumps([cpu_model(), sorted(cpu_features()), torch.__version__, torch.get_num_threads(),
                      kernels_id(kernels), shapes, LAYER_BUCKETS, DECODE_ROWS, "layouts-compact", COMPACT_TOLERANCE,
                      "interleaved", sorted(offered)])
    return default_cache_dir() / "kernel_choice" / f"{kind}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


def _read_cached(path: Path) -> tuple[Bf16Choice | None, Bf16Choice | None] | None:
    try:
        saved = json.loads(path.read_text())
        layers = (Bf16Choice(tuple((int(r), k) for r, k in saved["layers"]), saved["layers_layout"])
                  if saved["layers"] else None)
        head = (Bf16Choice(tuple((int(r), k) for r, k in saved["lm_head"]), saved["lm_head_layout"])
                if saved["lm_head"] else None)
        return layers, head
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _from_cache(what: str, path: Path) -> tuple[Bf16Choice | None, Bf16Choice | None] | None:
    """The timing cached at `path` (logged where found), or None."""
    cached = _read_cached(path)
    if cached is not None:
        logger.info("%s kernels (cached, %s): layers %s; LM head %s", what, path, *map(_describe, cached))
    return cached


def _write_cache(path: Path, layers: Bf16Choice | None, head: Bf16Choice | None, seconds: float,
                 timings: dict) -> None:
    record = {"cpu": cpu_model(), "threads": torch.get_num_threads(), "seconds": round(seconds, 2),
              "layers": [list(b) for b in layers.buckets] if layers else None,
              "layers_layout": layers.layout if layers else None,
              "lm_head": [list(b) for b in head.buckets] if head else None,
              "lm_head_layout": head.layout if head else None,
              "microseconds": timings}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(path)
    except OSError as exc:
        logger.warning("could not cache the kernel choice at %s (%s)", path, exc)


def _describe(choice: Bf16Choice | None) -> str:
    return choice.describe() if choice else "-"


def _cached_or_timed(what: str, path: Path, wrap: Callable[[], tuple[list, object | None, list | None]],
                     usable: Callable[[list], tuple[str, ...]],
                     few_rows_only: tuple[str, ...]) -> tuple[Bf16Choice | None, Bf16Choice | None]:
    """(the layers' choice, the LM head's) from the cache at `path`, or timed now and cached: `wrap` gives
    the weights to time (each with `plain` and `run`; and every layer's, for the decode buckets, or None),
    `usable` the kernels that passed their checks."""
    cached = _from_cache(what, path)
    if cached is not None:
        return cached
    start = time.perf_counter()
    timings: dict = {"layers": {}, "lm_head": {}}
    with torch.inference_mode():
        weights, head, decode_weights = wrap()
        kernels = usable(weights + ([head] if head is not None else []))
        layers = (_fastest(weights, LAYER_BUCKETS, kernels, timings["layers"], few_rows_only, decode_weights)
                  if weights else None)
        head_choice = _fastest([head], HEAD_BUCKETS, kernels, timings["lm_head"], few_rows_only) if head else None
    seconds = time.perf_counter() - start
    logger.info("%s kernels timed in %.1f s: layers %s; LM head %s", what, seconds, _describe(layers),
                _describe(head_choice))
    _write_cache(path, layers, head_choice, seconds, timings)
    return layers, head_choice


def _kind_name(module) -> str:
    """A quantized module's format, for the cache key: its class, row scales, K-quant layout, fused parts."""
    parts = getattr(module, "parts", None)
    if parts is not None:
        return "+".join(_kind_name(p) for p in parts)
    name = f"{type(module).__name__}:{getattr(module, 'row_scale', None) is not None}"
    layout = getattr(module, "layout", None)
    return f"{name}:{layout}" if layout else name


def tune_quantized(layer_modules: list, head) -> tuple[Bf16Choice | None, Bf16Choice | None]:
    """(the layers' choice, the LM head's) between the streaming kernel and the AMX one for INT8/INT4/K-quant
    modules in llmaccel's blocks in a bfloat16 model (a layer's projections, or none; the head or None):
    from the cache, or timed now. (None, None) where this machine has no AMX kernel."""
    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, "quant_amx_available") or not kernels.quant_amx_available():
        return None, None
    from llmaccel.ops.block_kernels import AMX_KERNEL

    forced = os.environ.get(QUANT_FORCE_ENV)
    if forced:
        if forced not in ("stream", AMX_KERNEL):
            raise ValueError(f"${QUANT_FORCE_ENV}={forced!r} is not a kernel for quantized weights: "
                             f"stream, {AMX_KERNEL}")
        choice = Bf16Choice(((1 << 30, forced),))
        return choice if layer_modules else None, choice if head is not None else None
    modules = layer_modules + ([head] if head is not None else [])
    kinds = [_kind_name(m) for m in modules]
    path = _cache_path([(m.out_features, m.in_features) for m in modules],
                       "quant-" + hashlib.sha256(",".join(kinds).encode()).hexdigest()[:8])

    def usable(weights: list[_QuantizedWeight]) -> tuple[str, ...]:
        failed = next(filter(None, (_check(AMX_KERNEL, w) for w in weights)), None)
        if failed:
            logger.warning("quantized kernel %s; not used", failed)
        return ("stream",) if failed else ("stream", AMX_KERNEL)

    return _cached_or_timed("quantized", path, lambda: ([_QuantizedWeight(m) for m in layer_modules],
                                                         _QuantizedWeight(head) if head is not None else None,
                                                         None),
                            usable, ())


def tune_bf16(layer_weights: list[torch.Tensor], head: torch.Tensor | None,
              model_weights: list[torch.Tensor] | None = None,
              invariant: bool = False, layout: str | None = None) -> tuple[Bf16Choice | None, Bf16Choice | None]:
    """(the layers' choice, the LM head's) for these bf16 weights (a layer's projections, or none; the
    head or None; every layer's projections, for the decode buckets, or None): from the cache, or timed.
    `invariant`: among ORDERED_KERNELS only (--batch-invariant); ValueError where this machine has none.
    `layout` (--bf16-layout; else $LLMACCEL_BF16_LAYOUT; None: the fastest): only that layout's kernels."""
    forced = _forced_choice(invariant)
    if forced is not None:
        return forced if layer_weights else None, forced if head is not None else None
    shapes = [tuple(w.shape) for w in layer_weights + ([head] if head is not None else [])]
    path, offered = _bf16_cache(shapes, len(model_weights or ()), invariant, layout)

    def usable(weights: list[_Weight]) -> tuple[str, ...]:
        kernels = []
        for kernel in offered:
            if kernel_layout(kernel) == "vnni" and not all(packable(w.plain) for w in weights):
                continue
            if kernel in COMPACT_KERNELS and not all(w.fits("compact") for w in weights):
                continue
            failed = next(filter(None, (_check(kernel, w) for w in weights)), None)
            if failed:
                logger.warning("bf16 kernel %s; not used", failed)
            else:
                kernels.append(kernel)
        return tuple(kernels) or ("onednn",)

    def wrap() -> tuple[list[_Weight], _Weight | None, list[_Weight] | None]:
        mine = {id(w): _Weight(w) for w in layer_weights}  # the first layer's, timed once either way
        every = [mine.get(id(w)) or _Weight(w) for w in model_weights] if model_weights else None
        return list(mine.values()), _Weight(head) if head is not None else None, every

    return _cached_or_timed("bf16", path, wrap, usable, ("stream", "vnni_stream", "compact_stream"))
