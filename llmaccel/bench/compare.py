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
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from llmaccel.bench import datasets
from llmaccel.bench.ceiling import ceiling_share, lone_requests, served_weight_bytes
from llmaccel.bench.provenance import provenance
from llmaccel.bench.serve import benchmark_args, run_benchmark, tokenizer_for
from llmaccel.bench.servers import free_port, peak_rss_bytes, start_server, stop_server
from llmaccel.platform import available_memory_bytes, machine_record, total_memory_bytes

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
                        help="deal the peer commands out to the variants (peer j to variant j mod the number of "
                             "variants) and run each variant right before its peers, so a machine whose speed drifts "
                             "weighs on both sides alike")
    parser.add_argument("--paired", action="store_true",
                        help="with --interleave: start each variant's group (it and its peers) side by side and let "
                             "their lone requests take turns (A B, B A, ...), so the group's W1 ratios are measured "
                             "within minutes on this machine's bandwidth, not across its drift; a server that would "
                             "not fit in memory beside the others runs after them")
    parser.add_argument("--memory-bytes", action="append", default=[], metavar="LABEL=BYTES",
                        help="with --paired: the peak memory server LABEL needs (OpenVINO widens an fp16 file to "
                             "twice its size at its first request), to decide whether it fits beside the others; "
                             "default: about the group's first server again (repeatable)")
    parser.add_argument("--serve-args", default="", help="extra flags for `llmaccel serve`, e.g. '--max-num-seqs 64'")
    parser.add_argument("--result-json", type=Path, help="write every figure here")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _labelled(value: str) -> tuple[str, str]:
    label, sep, rest = value.partition("=")
    if not sep or not label:
        raise ValueError(f"{value!r}: write LABEL=...")
    return label, rest


def _labelled_bytes(value: str, flag: str = "--weight-bytes") -> tuple[str, int]:
    label, number = _labelled(value)
    try:
        count = int(float(number))
    except ValueError:
        count = 0
    if count <= 0:
        raise ValueError(f"{flag} {value!r}: BYTES must be a positive number, e.g. {label}=1.35e8")
    return label, count


def _bench(url: str, label: str, extra_body: dict | None, tokenizer) -> argparse.Namespace:
    """bench serve's own defaults, so both commands measure alike; one short warm-up request sent."""
    bench = benchmark_args(url, label)
    bench.extra_body = extra_body
    warm = datasets.SampleRequest("Hello!", 0, 8)
    asyncio.run(run_benchmark(bench, [warm], tokenizer, float("inf"), 1, progress=False))
    return bench


def _measure(benches: list[argparse.Namespace], args: argparse.Namespace, tokenizer,
             weight_bytes: dict[str, int]) -> list[dict]:
    """W1 on every server (taking turns where there are several) and then W2 on each, one after another."""
    progress = not args.no_progress
    single_prompt = datasets.SampleRequest(SINGLE_PROMPT, 0, args.single_output_len)
    singles = lone_requests(benches, single_prompt, args.single_repeat, tokenizer, progress)
    figures = []
    for bench, single in zip(benches, singles, strict=True):
        single["ceiling_share"] = ceiling_share(single, weight_bytes.get(bench.label)
                                                or served_weight_bytes(bench.base_url))
        burst = datasets.builtin_requests(tokenizer, args.num_prompts, args.output_len)
        loaded = asyncio.run(run_benchmark(bench, burst, tokenizer, float("inf"), args.concurrency,
                                           progress=progress))
        figures.append({"label": bench.label, "single": single, "concurrent": loaded})
    return figures


def _room_for(started: list[tuple], label: str, weight_bytes: dict[str, int], memory_bytes: dict[str, int]) -> bool:
    """Whether server `label` fits beside the ones started: the memory it needs (--memory-bytes, else about the
    first one's resident size again, or its weight bytes if larger, plus 30% and a 2 GiB KV cache) against
    what is left once the started servers' resident memory (a mapped file's pages included, which
    MemAvailable counts as free) and 1 GiB for the rest are taken."""
    first_rss = peak_rss_bytes(started[0][1].pid) or 0
    need = memory_bytes.get(label) or max(first_rss, weight_bytes.get(label, 0)) * 1.3 + 2 * 2**30
    total, available = total_memory_bytes(), available_memory_bytes()
    if total is None or available is None:
        return True
    held = sum(peak_rss_bytes(proc.pid) or 0 for _, proc, *_ in started)
    return min(available, total - held) - 2**30 > need


def _run_group(group: list[tuple[str, list[str]]], args: argparse.Namespace, tokenizer, logs: Path,
               weight_bytes: dict[str, int], memory_bytes: dict[str, int], peer_labels: set[str]) -> list[dict]:
    """Start the group's servers side by side (one where memory would not hold the next), measure, stop."""
    started: list[tuple[str, subprocess.Popen, str, float, int | None]] = []  # label, process, url, start s, load RSS
    systems: list[dict] = []
    try:
        for label, command in group:
            if started and not _room_for(started, label, weight_bytes, memory_bytes):
                print(f"{label} does not fit beside {started[0][0]}: measured after it", file=sys.stderr)
                systems += _measure_started(started, args, tokenizer, weight_bytes, peer_labels)
                _stop_all(started)
                started = []
            port = free_port()
            print(f"starting {label} on port {port} (log: {logs / label}.log)", file=sys.stderr)
            began = time.monotonic()
            try:
                proc = start_server(command, port, logs / f"{label}.log")
            except RuntimeError as exc:  # one server that dies at start costs the run its column, not the others
                print(f"{label} did not start; measuring the others (log: {logs / label}.log)", file=sys.stderr)
                systems.append({"label": label, "failed_to_start": str(exc)[-2000:]})
                continue
            # the peak up to serving (the load's), and the start time
            started.append((label, proc, f"http://127.0.0.1:{port}", round(time.monotonic() - began, 1),
                            peak_rss_bytes(proc.pid)))
        systems += _measure_started(started, args, tokenizer, weight_bytes, peer_labels)
    finally:
        _stop_all(started)
    order = [label for label, _ in group]
    return sorted(systems, key=lambda s: order.index(s["label"]))


def _measure_started(started: list, args: argparse.Namespace, tokenizer, weight_bytes: dict[str, int],
                     peer_labels: set[str]) -> list[dict]:
    """Measure the servers that are up (their peak memory read while they still run)."""
    benches = [_bench(url, label, args.peer_extra_body if label in peer_labels else None, tokenizer)
               for label, _, url, *_ in started]
    figures = _measure(benches, args, tokenizer, weight_bytes) if benches else []
    for figure, (_, proc, _, start_seconds, load_rss) in zip(figures, started, strict=True):
        figure.update(start_seconds=start_seconds, load_rss_bytes=load_rss, peak_rss_bytes=peak_rss_bytes(proc.pid),
                      paired_with=[label for label, *_ in started if label != figure["label"]])
    return figures


def _stop_all(started: list) -> None:
    for _, proc, *_ in started:
        stop_server(proc)


def run(args: argparse.Namespace) -> int:
    weight_bytes = dict(_labelled_bytes(value) for value in args.weight_bytes)  # bad input fails before any work
    memory_bytes = dict(_labelled_bytes(value, "--memory-bytes") for value in args.memory_bytes)
    if args.paired and not args.interleave:
        raise ValueError("--paired takes its pairs from --interleave: give both")
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
    groups = [[server] for server in servers]
    if args.interleave and variants:  # peer j is dealt to variant j mod len(variants)
        dealt = [[variant, *peers[i::len(variants)]] for i, variant in enumerate(variants)]
        groups += dealt if args.paired else [[server] for group in dealt for server in group]
    else:
        groups += [[server] for server in variants + peers]
    for group in groups:
        systems += _run_group(group, args, tokenizer, logs, weight_bytes, memory_bytes,
                              {label for label, _ in peer_commands})
    for peer in args.peer:
        label, url = _labelled(peer)
        bench = _bench(url, label, args.peer_extra_body, tokenizer)
        systems += [{**figure, "peak_rss_bytes": None} for figure in _measure([bench], args, tokenizer, weight_bytes)]
    print(format_table(systems, args))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        record = {"model": args.model, **provenance(), "machine": machine_record(), "systems": systems,
                  "commands": {label: command for group in groups for label, command in group}}
        args.result_json.write_text(json.dumps(record, indent=1))
        print(f"wrote {args.result_json}", file=sys.stderr)
    return 0


def format_table(systems: list[dict], args: argparse.Namespace) -> str:
    """Markdown: one column per server, plus llmaccel's improvement over the first (the baseline)."""
    rows = [
        (f"mean latency, 1 request x {args.single_output_len} tokens (s)",
         lambda s: s["single"]["mean_e2el_ms"] / 1000, "lower"),
        ("output tokens/s, 1 request", lambda s: s["single"]["output_throughput"], "higher"),
        ("output tokens/s, 1 request, median repeat", median_lone_rate, "higher"),
        ("1 request side by side: the first of its group over this (median of each round's ratio)",
         lambda s: leads.get(s["label"]), None),
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
    leads = paired_leads(systems)
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


def median_lone_rate(system: dict) -> float | None:
    """The median of a server's lone requests' rates (tokens / latency), or None where none succeeded."""
    rates = [rate for rate in system["single"].get("request_output_throughput") or [] if rate]
    return statistics.median(rates) if rates else None


def paired_leads(systems: list[dict]) -> dict[str, float]:
    """For each server measured side by side (--paired): its group's first server's lone-request rate over
    its own, round by round (the two requests of a round were minutes apart at most), the median over the
    rounds; e.g. llmaccel-Q8_0 against llama.cpp-Q8_0 = 1.25 means llmaccel is 1.25x as fast."""
    leads: dict[str, float] = {}
    for system in systems:
        group = {system["label"], *system.get("paired_with", [])}
        first = next(s for s in systems if s["label"] in group)
        mine = system["single"].get("request_output_throughput") or []
        theirs = first["single"].get("request_output_throughput") or []
        ratios = [a / b for a, b in zip(theirs, mine, strict=False) if a and b]
        if first is not system and ratios:
            leads[system["label"]] = statistics.median(ratios)
    return leads


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
