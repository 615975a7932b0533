"""`llmaccel bench kv-restore`: one conversation's KV saved to disk and brought back, llmaccel's disk tier against
llama.cpp's slot save/restore (`llama-server --slot-save-path`), on the same GGUF file at the same prompt lengths.

For each length, a prompt of that many random tokens is computed once (the cold time to first token). Then:
- llama.cpp saves slot 0 to a file, erases the slot and restores it (`POST /slots/0?action=save|erase|restore`,
  each call's own timing);
- llmaccel's server is stopped (it writes what RAM holds to `--kv-offload-dir` at shutdown) and started again on
  the same directory, so the prompt's KV is on disk only.
Each server then gets the prompt again with 16 new tokens after it: the time to first token from disk, against the
cold one. The servers run one after the other, each alone, one slot / one sequence, chunked prefill off the table
(llama.cpp's batch of 2048, llmaccel's --max-num-batched-tokens 2048). llama.cpp's save and restore are calls a
client makes; llmaccel's writes happen off the step and its reads when a prompt arrives, so its figures are the
tier's own counters (mean time a block, bytes) and the time to first token. With --drop-caches the OS page cache
is emptied before each restore, so both read their files from the device.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmaccel.bench.provenance import provenance

DEFAULT_LLAMA_SERVER = (Path.home() / ".cache/llmaccel/peers/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin"
                        / "llama-server")
NEW_TOKENS = 16
VOCAB = 49152  # the default model's vocabulary: prompts are random ids in [100, VOCAB - 100)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="a GGUF file (or the default model's alias)")
    parser.add_argument("--lengths", default="2000,4000,8000", help="prompt lengths in tokens, comma-separated")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER,
                        help="llama.cpp's server binary (tools/peers.sh builds it)")
    parser.add_argument("--threads", type=int, help="llama.cpp's threads (default: every core)")
    parser.add_argument("--drop-caches", action="store_true",
                        help="empty the OS page cache before each restore (root only), so the saved KV is read "
                             "from the device, not from memory")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")


def drop_page_cache() -> bool:
    """Write dirty pages out and drop the page cache; False where this process may not."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
    except OSError:
        return False
    return True


def _prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, VOCAB - 100) for _ in range(length)]


def _timed(client: httpx.Client, path: str, body: dict) -> tuple[float, dict]:
    began = time.perf_counter()
    response = client.post(path, json=body, timeout=1800)
    response.raise_for_status()
    return time.perf_counter() - began, response.json()


def measure_llama_cpp(args: argparse.Namespace, gguf: Path, prompts: dict[int, list[int]], workdir: Path) -> dict:
    from llmaccel.bench.servers import free_port, start_server, stop_server

    threads = args.threads or os.cpu_count()
    context = max(prompts) + 2 * NEW_TOKENS + 64
    (workdir / "slots").mkdir()
    port = free_port()
    proc = start_server([str(args.llama_server), "-m", str(gguf), "-t", str(threads), "-np", "1", "-c", str(context),
                         "-fa", "on", "--slot-save-path", str(workdir / "slots"), "--host", "127.0.0.1"], port,
                        workdir / "llama-server.log")
    rows = {}
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for length, ids in prompts.items():
                cold, _ = _timed(client, "/completion", {"prompt": ids, "n_predict": 1, "cache_prompt": True})
                _, saved = _timed(client, "/slots/0?action=save", {"filename": f"n{length}.bin"})
                _timed(client, "/slots/0?action=erase", {})
                if args.drop_caches:
                    drop_page_cache()
                _, restored = _timed(client, "/slots/0?action=restore", {"filename": f"n{length}.bin"})
                extra = _prompt(NEW_TOKENS, length + 1)
                warm, answer = _timed(client, "/completion", {"prompt": ids + extra, "n_predict": 1,
                                                              "cache_prompt": True})
                rows[length] = {"cold_ttft_s": cold, "save_ms": saved["timings"]["save_ms"],
                                "restore_ms": restored["timings"]["restore_ms"], "file_bytes": saved["n_written"],
                                "restored_ttft_s": warm, "prompt_tokens_computed": answer["timings"]["prompt_n"]}
                print(f"llama.cpp {length}: {rows[length]}", file=sys.stderr)
    finally:
        stop_server(proc)
    return rows


def measure_llmaccel(args: argparse.Namespace, gguf: Path, prompts: dict[int, list[int]], workdir: Path) -> dict:
    from llmaccel.bench.servers import free_port, start_server, stop_server

    command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", str(gguf), "--no-result-cache",
               "--no-input-filter", "--semantic-guard", "off", "--max-num-seqs", "1",
               "--max-model-len", str(max(prompts) + 2 * NEW_TOKENS + 64), "--kv-offload-dir", str(workdir / "kv"),
               "--host", "127.0.0.1"]

    def tier(client: httpx.Client) -> dict:  # /metrics, read at the call (/v1/llmaccel/stats may be 0.5 s old)
        from llmaccel.server.metrics import parse_metrics

        samples = parse_metrics(client.get("/metrics").text)
        read = {name: samples[f"llmaccel_kv_tier_{name}"][(("tier", "disk"),)]
                for name in ("loaded_blocks_total", "load_seconds_total", "files", "disk_bytes")}
        return {"loaded_blocks": read["loaded_blocks_total"], "load_seconds": read["load_seconds_total"],
                "files": read["files"], "disk_bytes": read["disk_bytes"]}

    cold: dict[int, float] = {}
    port = free_port()
    proc = start_server(command, port, workdir / "llmaccel-first.log")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            for length, ids in prompts.items():
                cold[length], _ = _timed(client, "/v1/completions", {"prompt": ids, "max_tokens": 1})
    finally:
        stop_server(proc)  # writes the prefix cache's blocks at shutdown
    written = re.search(r"KV disk tier: wrote ([\d.]+) MB of blocks at shutdown in ([\d.]+) s",
                        (workdir / "llmaccel-first.log").read_text())
    if args.drop_caches:
        drop_page_cache()
    rows = {}
    port = free_port()
    proc = start_server(command, port, workdir / "llmaccel-restarted.log")
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}") as client:
            on_disk = tier(client)
            _timed(client, "/v1/completions", {"prompt": _prompt(32, 7), "max_tokens": 1})  # a first step
            for length, ids in prompts.items():
                before = tier(client)
                extra = _prompt(NEW_TOKENS, length + 1)
                warm, answer = _timed(client, "/v1/completions", {"prompt": ids + extra, "max_tokens": 1})
                after = tier(client)
                loaded = after["loaded_blocks"] - before["loaded_blocks"]
                cached = (answer["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                rows[length] = {"cold_ttft_s": cold[length], "restored_ttft_s": warm, "loaded_blocks": loaded,
                                "file_bytes": loaded * (on_disk["disk_bytes"] / max(1, on_disk["files"])),
                                "load_s": after["load_seconds"] - before["load_seconds"],
                                "shutdown_write_mb": float(written[1]) if written else None,
                                "shutdown_write_s": float(written[2]) if written else None,
                                "prompt_tokens_computed": len(ids) + NEW_TOKENS - cached}
                print(f"llmaccel {length}: {rows[length]}", file=sys.stderr)
    finally:
        stop_server(proc)
    return rows


def run(args: argparse.Namespace) -> int:
    from llmaccel.model.loader import resolve_model_path
    from llmaccel.platform import describe

    gguf = resolve_model_path(args.model)
    if gguf.suffix != ".gguf":
        raise SystemExit(f"--model must name a GGUF file (llama.cpp reads only those): {gguf}")
    if not args.llama_server.is_file():
        raise SystemExit(f"no llama-server at {args.llama_server}: build it with tools/peers.sh or pass --llama-server")
    lengths = [int(x) for x in args.lengths.split(",")]
    prompts = {length: _prompt(length, length) for length in lengths}
    with tempfile.TemporaryDirectory(prefix="llmaccel-kv-restore-") as scratch:
        workdir = Path(scratch)
        servers = {"llmaccel": measure_llmaccel(args, gguf, prompts, workdir),
                   "llama.cpp": measure_llama_cpp(args, gguf, prompts, workdir)}
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({**provenance(), "machine": describe(), "model": str(gguf),
                                                "new_tokens": NEW_TOKENS, "page_cache_dropped": args.drop_caches,
                                                "servers": servers}, indent=1))
    print(format_table(servers, lengths))
    return 0


def format_table(servers: dict, lengths: list[int]) -> str:
    lines = ["| prompt tokens | server | cold TTFT | bytes on disk | saved in | restored in | TTFT after restore "
             "| tokens computed |", "|---|---|---|---|---|---|---|---|"]
    for length in lengths:
        ours, theirs = servers["llmaccel"][length], servers["llama.cpp"][length]
        load = ours["load_s"] * 1000
        lines.append(f"| {length} | llmaccel | {ours['cold_ttft_s']:.2f} s | {ours['file_bytes'] / 2**20:.1f} MiB | "
                     f"off the step | {load:.0f} ms, in the request's TTFT | {ours['restored_ttft_s']:.3f} s | "
                     f"{ours['prompt_tokens_computed']} |")
        lines.append(f"| {length} | llama.cpp | {theirs['cold_ttft_s']:.2f} s | {theirs['file_bytes'] / 2**20:.1f} MiB "
                     f"| {theirs['save_ms']:.0f} ms | {theirs['restore_ms']:.0f} ms | "
                     f"{theirs['restored_ttft_s']:.3f} s | {theirs['prompt_tokens_computed']} |")
    return "\n".join(lines)
