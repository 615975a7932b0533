"""`llmaccel bench compare`: the headline table in one command.

It starts the HF transformers baseline server (one request at a time) and then llmaccel's server on
the same model, one after the other so neither competes for the cores, and measures on each:
(a) a lone request of 300 generated tokens, repeated (mean end-to-end latency), and (b) a burst of
prompts at concurrency 64 (requests per second). Peak memory is the server process's peak RSS
(VmHWM, with its child processes': vLLM serves from an engine process), at serving time (the load's peak)
and at the end. `--variant LABEL=FLAGS` adds llmaccel configurations (int8, int4, a dtype);
`--peer-command LABEL=COMMAND` adds peer servers (vLLM, llama.cpp) that compare starts itself, in turn,
each alone on the machine (tools/peers.sh has each peer's best settings); `--peer LABEL=URL` adds
servers that are already running. Each lone request's share of the machine's bandwidth ceiling
(bench/ceiling.py) needs the weight bytes a token reads: llmaccel servers report theirs on /metrics,
`--weight-bytes LABEL=BYTES` gives a peer's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmaccel.bench import datasets
from llmaccel.bench.ceiling import ceiling_share, lone_requests, served_weight_bytes
from llmaccel.bench.serve import benchmark_args, run_benchmark, tokenizer_for
from llmaccel.platform import machine_record

SINGLE_PROMPT = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--num-prompts", type=int, default=64, help="built-in prompts in the concurrency run")
    parser.add_argument("--concurrency", type=int, default=64, help="requests in flight in the concurrency run")
    parser.add_argument("--output-len", type=int, default=64, help="tokens per request in the concurrency run")
    parser.add_argument("--single-output-len", type=int, default=300, help="tokens of the lone request")
    parser.add_argument("--single-repeat", type=int, default=3, help="how often the lone request runs (mean taken)")
    parser.add_argument("--peer", action="append", default=[], metavar="LABEL=URL",
                        help="also measure a server that is already running (repeatable)")
    parser.add_argument("--peer-command", action="append", default=[], metavar="LABEL=COMMAND",
                        help="start this server command (compare appends --port N), wait for its /health, measure "
                             "it, stop it; one at a time (repeatable)")
    parser.add_argument("--variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="also measure `llmaccel serve FLAGS` as LABEL, e.g. 'llmaccel-int8=--quantization "
                             "int8' (repeatable)")
    parser.add_argument("--skip-llmaccel", action="store_true",
                        help="do not start llmaccel's default configuration (variants still run)")
    parser.add_argument("--peer-extra-body", type=json.loads, default=None, metavar="JSON",
                        help='fields added to requests sent to --peer servers, e.g. \'{"logit_bias": {"2": -100}}\' '
                             "where a peer ignores ignore_eos")
    parser.add_argument("--weight-bytes", action="append", default=[], metavar="LABEL=BYTES",
                        help="weight bytes a decode step of LABEL reads (a peer's model file size), for the lone "
                             "request's share of the bandwidth ceiling; llmaccel servers report theirs (repeatable)")
    parser.add_argument("--skip-baseline", action="store_true", help="do not start the HF baseline")
    parser.add_argument("--interleave", action="store_true",
                        help="run the i-th variant, then the i-th peer command, then the next pair (a machine whose "
                             "speed drifts then weighs on both sides of each pair alike)")
    parser.add_argument("--serve-args", default="", help="extra flags for `llmaccel serve`, e.g. '--max-num-seqs 64'")
    parser.add_argument("--result-json", type=Path, help="write every figure here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_tree(pid: int) -> list[int]:
    """pid and every live process below it (vLLM serves from an engine process its server starts)."""
    tree, todo = [], [pid]
    while todo:
        current = todo.pop()
        tree.append(current)
        for children in Path(f"/proc/{current}/task").glob("*/children"):
            try:
                todo += [int(child) for child in children.read_text().split()]
            except OSError:
                continue
    return tree


def peak_rss_bytes(pid: int) -> int | None:
    """The peak resident set (VmHWM) of the process and its live children, summed (an upper bound where
    their peaks fell at different times), Linux only."""
    total = None
    for member in _process_tree(pid):
        try:
            lines = Path(f"/proc/{member}/status").read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith("VmHWM:"):
                total = (total or 0) + int(line.split()[1]) * 1024
    return total


def start_server(command: list[str], port: int, log: Path, timeout: float = 900,
                 env: dict[str, str] | None = None) -> subprocess.Popen:
    """Start `command --port PORT` with its output in `log`; return once /health answers 200."""
    proc = subprocess.Popen(command + ["--port", str(port)], stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError(f"{' '.join(command)} did not come up; its log:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM (the server drains), then kill if it has not exited within a minute."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()


def _labelled(value: str) -> tuple[str, str]:
    label, sep, rest = value.partition("=")
    if not sep or not label:
        raise ValueError(f"{value!r}: write LABEL=...")
    return label, rest


def _weight_bytes(value: str) -> tuple[str, int]:
    label, number = _labelled(value)
    try:
        count = int(float(number))
    except ValueError:
        count = 0
    if count <= 0:
        raise ValueError(f"--weight-bytes {value!r}: BYTES must be a positive number, e.g. {label}=1.35e8")
    return label, count


def _measure(url: str, label: str, args: argparse.Namespace, tokenizer, extra_body: dict | None = None,
             weight_bytes: dict[str, int] | None = None) -> dict:
    began = time.monotonic()
    bench = benchmark_args(url, label)  # bench serve's own defaults, so both commands measure alike
    bench.extra_body = extra_body
    single_prompt = datasets.SampleRequest(SINGLE_PROMPT, 0, args.single_output_len)
    warm = datasets.SampleRequest("Hello!", 0, 8)
    progress = not args.no_progress
    asyncio.run(run_benchmark(bench, [warm], tokenizer, float("inf"), 1, progress=False))
    weight_bytes = weight_bytes or {}
    single = lone_requests(bench, single_prompt, args.single_repeat, tokenizer, progress)
    single["ceiling_share"] = ceiling_share(single, weight_bytes.get(label) or served_weight_bytes(url))
    burst = datasets.builtin_requests(tokenizer, args.num_prompts, args.output_len)
    loaded = asyncio.run(run_benchmark(bench, burst, tokenizer, float("inf"), args.concurrency,
                                       progress=progress))
    return {"label": label, "single": single, "concurrent": loaded, "measure_seconds": time.monotonic() - began}


def run(args: argparse.Namespace) -> int:
    weight_bytes = dict(_weight_bytes(value) for value in args.weight_bytes)  # bad input fails before any work
    tokenizer = tokenizer_for(argparse.Namespace(tokenizer=args.model, model=args.model))
    systems: list[dict] = []
    logs = Path(tempfile.mkdtemp(prefix="llmaccel-compare-"))
    servers = [] if args.skip_baseline else [("hf-baseline", [sys.executable, "-m", "llmaccel.cli", "bench",
                                                               "hf-server", "--model", args.model])]
    # no result cache: repeated prompts across rates would be answered without the engine
    serve = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache"]
    if not args.skip_llmaccel:
        servers.append(("llmaccel", [*serve, *args.serve_args.split()]))
    variants = [(label, [*serve, *shlex.split(flags)]) for label, flags in map(_labelled, args.variant)]
    peer_commands = [_labelled(value) for value in args.peer_command]
    peers = [(label, shlex.split(command)) for label, command in peer_commands]
    if args.interleave:
        pairs = [server for pair in zip(variants, peers, strict=False) for server in pair]
        servers += pairs + variants[len(peers):] + peers[len(variants):]
    else:
        servers += variants + peers
    for label, command in servers:
        port = free_port()
        print(f"starting {label} on port {port} (log: {logs / label}.log)", file=sys.stderr)
        started = time.monotonic()
        try:
            proc = start_server(command, port, logs / f"{label}.log")
            load_rss = peak_rss_bytes(proc.pid)  # the peak up to serving: the load's
        except RuntimeError as exc:  # one server that dies at start costs the run its column, not the others
            print(f"{label} did not start; measuring the others (log: {logs / label}.log)", file=sys.stderr)
            systems.append({"label": label, "failed_to_start": str(exc)[-2000:]})
            continue
        try:
            extra = args.peer_extra_body if any(label == peer for peer, _ in peer_commands) else None
            figures = _measure(f"http://127.0.0.1:{port}", label, args, tokenizer, extra, weight_bytes)
            figures["start_seconds"] = round(time.monotonic() - started - figures.pop("measure_seconds"), 1)
            figures["load_rss_bytes"] = load_rss
            figures["peak_rss_bytes"] = peak_rss_bytes(proc.pid)
        finally:
            stop_server(proc)
        systems.append(figures)
    for peer in args.peer:
        label, url = _labelled(peer)
        systems.append({**_measure(url, label, args, tokenizer, args.peer_extra_body, weight_bytes),
                        "peak_rss_bytes": None})
    print(format_table(systems, args))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, "machine": machine_record(), "systems": systems,
                  "commands": {label: command for label, command in servers}}
        args.result_json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.result_json}", file=sys.stderr)
    return 0


def format_table(systems: list[dict], args: argparse.Namespace) -> str:
    """Markdown: one column per server, plus llmaccel's improvement over the first (the baseline)."""
    rows = [
        (f"mean latency, 1 request x {args.single_output_len} tokens (s)",
         lambda s: s["single"]["mean_e2el_ms"] / 1000, "lower"),
        ("output tokens/s, 1 request", lambda s: s["single"]["output_throughput"], "higher"),
        ("1 request: share of the bandwidth ceiling (%, median repeat)",
         lambda s: 100 * s["single"]["ceiling_share"]["median"] if s["single"].get("ceiling_share") else None,
         "higher"),
        ("peak memory of the server process (GiB)",
         lambda s: s["peak_rss_bytes"] / 2**30 if s["peak_rss_bytes"] else None, "lower"),
        ("peak memory up to serving, the load's (GiB)",
         lambda s: s["load_rss_bytes"] / 2**30 if s.get("load_rss_bytes") else None, "lower"),
        (f"QPS at concurrency {args.concurrency} ({args.num_prompts} x {args.output_len} tokens)",
         lambda s: s["concurrent"]["request_throughput"], "higher"),
        (f"output tokens/s at concurrency {args.concurrency}", lambda s: s["concurrent"]["output_throughput"],
         "higher"),
        (f"median TTFT at concurrency {args.concurrency} (s)", lambda s: s["concurrent"]["median_ttft_ms"] / 1000,
         "lower"),
        ("seconds from start to serving", lambda s: s.get("start_seconds"), "lower"),
        ("failed requests", lambda s: s["single"]["failed"] + s["concurrent"]["failed"], None),
    ]
    failed = [s["label"] for s in systems if "failed_to_start" in s]
    systems = [s for s in systems if "failed_to_start" not in s]
    ours = next((s for s in systems if s["label"] == "llmaccel"), None)
    base = systems[0] if systems and systems[0] is not ours else None
    head = "| | " + " | ".join(s["label"] for s in systems) + (" | improvement |" if base and ours else " |")
    lines = [head, "|---" * (len(systems) + 1 + bool(base and ours)) + "|"]
    for name, get, better in rows:
        cells = [_fmt(get(s)) for s in systems]
        extra = ""
        if base and ours:
            b, o = get(base), get(ours)
            extra = f" {_ratio(b, o, better)} |" if better else " |"
        lines.append(f"| {name} | " + " | ".join(cells) + " |" + extra)
    if failed:
        lines.append(f"\ndid not start (see the result JSON): {', '.join(failed)}")
    return "\n".join(lines)


def _fmt(value: float | int | None) -> str:
    if value is None:
        return "n/a"
    return f"{value}" if isinstance(value, int) else f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _ratio(base: float | None, ours: float | None, better: str) -> str:
    """llmaccel against the baseline, in words that cannot be misread (a loss reads as a loss)."""
    if not base or not ours:
        return "n/a"
    higher = ours / base
    if higher >= 1:
        return f"{higher:.2f}x higher" + (" (better)" if better == "higher" else " (worse)")
    return f"{1 / higher:.2f}x lower" + (" (better)" if better == "lower" else " (worse)")
