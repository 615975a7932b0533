"""`llmaccel bench load-memory`: what `llmaccel serve` costs in memory and time to start, per model, against
issue 42's bound (peak RSS <= weight bytes + KV pool + 15%).

Each model is served in its own process, started afresh (`--cold`: with an empty kernel-choice cache, so the
start times its kernels as a first start on a machine does); the peak (VmHWM) and the resident set are read
the moment /health answers, and the weight and KV pool bytes from /metrics. The page cache is left as it is
(a file read from disk slows the start, not the memory), unless `--drop-page-cache` empties it before each start:
the start of a file not read since boot, which the disk's speed then bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm.auto import tqdm

from llmaccel.bench.provenance import provenance
from llmaccel.bench.servers import free_port, peak_rss_bytes, start_server, stop_server
from llmaccel.platform import cpu_model
from llmaccel.server.metrics import PREFIX, parse_metrics

BOUND_MARGIN = 0.15  # issue 42: peak RSS <= weights + KV pool + 15%
DROP_CACHES = Path("/proc/sys/vm/drop_caches")  # the kernel's control: "1" drops the clean page cache


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("models", nargs="+", help="models to serve, one after another (alias, .gguf file or HF "
                                                  "directory)")
    parser.add_argument("--serve-args", default="",
                        help="further `llmaccel serve` flags for every model, one quoted string "
                             "(e.g. \"--quantization gguf\")")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="every server's KV pool (counted in the bound)")
    parser.add_argument("--repeats", type=int, default=1, help="starts per model; the median start is reported")
    parser.add_argument("--cold", action="store_true",
                        help="each start with an empty kernel-choice cache (LLMACCEL_CACHE_DIR in a temporary "
                             "directory): the first start's kernel timing included")
    parser.add_argument("--serve-command", default=f"{shlex.quote(sys.executable)} -m llmaccel.cli serve",
                        help="the command that serves (another checkout's, to measure it the same way)")
    parser.add_argument("--drop-page-cache", action="store_true",
                        help="empty the kernel's page cache before each start (needs root: writes "
                             f"{DROP_CACHES}), so the model file is read from disk as after a reboot")
    parser.add_argument("--result-json", type=Path, default=None, help="also write the figures here")


def drop_page_cache(control: Path = DROP_CACHES) -> None:
    """Writes dirty pages out, then drops the clean page cache; ValueError naming the fix where not permitted."""
    os.sync()
    try:
        control.write_text("1\n")
    except OSError as exc:
        raise ValueError(f"--drop-page-cache cannot write {control} ({exc.strerror}): run as root, or leave the flag "
                         "out to start with the page cache as it is") from exc


def _memory(port: int) -> tuple[dict[str, float], float]:
    """(the engine's memory parts by name, the process's resident bytes), from /metrics."""
    samples = parse_metrics(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text)
    parts = {labels[0][1]: value for labels, value in samples.get(PREFIX + "memory_bytes", {}).items()}
    return parts, samples.get("process_resident_memory_bytes", {}).get((), 0.0)


def start_once(model: str, args: argparse.Namespace) -> dict:
    """One start of `model`: seconds to /health, peak and resident bytes then, weight and KV pool bytes."""
    command = [*shlex.split(args.serve_command), "--model", model, "--kv-cache-memory", args.kv_cache_memory,
               *shlex.split(args.serve_args)]
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="llmaccel-load-") as scratch:
        env = dict(os.environ)
        if args.cold:
            env["LLMACCEL_CACHE_DIR"] = scratch
        if args.drop_page_cache:
            drop_page_cache()
        began = time.monotonic()
        proc = start_server(command, port, Path(scratch) / "server.log", env=env)
        try:
            ready = time.monotonic() - began
            parts, resident = _memory(port)
            peak = peak_rss_bytes(proc.pid) or 0  # read after the resident set: the peak so far includes it
        finally:
            stop_server(proc)
    weights, pool = int(parts.get("weights", 0)), int(parts.get("kv_pool", 0))
    bound = int((weights + pool) * (1 + BOUND_MARGIN))
    return {"ready_s": round(ready, 1), "peak_bytes": peak, "rss_bytes": int(resident), "weights_bytes": weights,
            "kv_pool_bytes": pool, "bound_bytes": bound, "peak_over_bound": round(peak / bound, 3) if bound else None}


def run(args: argparse.Namespace) -> int:
    rows = []
    for model in tqdm(args.models, desc="bench load-memory"):
        starts = [start_once(model, args) for _ in range(args.repeats)]
        median = sorted(starts, key=lambda s: s["peak_bytes"])[len(starts) // 2]
        rows.append({"model": model, **median, "ready_s": statistics.median(s["ready_s"] for s in starts),
                     "starts": starts})
    kind = "first starts (kernels timed)" if args.cold else "starts with the kernel choice cached"
    kind += ", page cache dropped before each" if args.drop_page_cache else ""
    print(f"{cpu_model()}; {kind}; serve {args.serve_args or '(defaults)'}, KV pool {args.kv_cache_memory}; "
          f"median of {args.repeats}; GB = 1e9 bytes")
    print("| model | weights GB | KV pool GB | peak GB at /health | bound GB (+15%) | peak / bound | RSS GB "
          "| ready s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        gb = {name: r[f"{name}_bytes"] / 1e9 for name in ("weights", "kv_pool", "peak", "bound", "rss")}
        print(f"| {Path(r['model']).name} | {gb['weights']:.2f} | {gb['kv_pool']:.2f} | {gb['peak']:.2f} | "
              f"{gb['bound']:.2f} | {r['peak_over_bound']} | {gb['rss']:.2f} | {r['ready_s']:.1f} |")
    if args.result_json is not None:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({"machine": cpu_model(), "cold": args.cold,
                                                "drop_page_cache": args.drop_page_cache,
                                                "serve_args": args.serve_args, "kv_cache_memory": args.kv_cache_memory,
                                                "serve_command": args.serve_command, **provenance(), "rows": rows},
                                               indent=1) + "\n")
    return 0
