"""A cascade as served (`llmaccel bench cascade-served`): `llmaccel serve --cascade-small` against the large model
served alone, both up at once (an idle server costs nothing), each built-in chat prompt sent alone to one then the
other (the order alternating, so both see the same machine; greedy, up to --max-tokens). Reports the share routed to
the large model (the x-llmaccel-route header), the mean latency of a request against large-only, by route, and the
share of answers identical to large-only. `llmaccel bench cascade` chooses the threshold offline; this checks it
served.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
from tqdm import tqdm

from llmaccel.bench.servers import free_port, start_server, stop_server
from llmaccel.data.prompts import builtin_prompts
from llmaccel.platform import machine_record


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the large model")
    parser.add_argument("--small", required=True, help="the cascade's small model")
    parser.add_argument("--threshold", type=float, required=True, help="--cascade-threshold of the served cascade")
    parser.add_argument("--decide-tokens", type=int, default=32, help="--cascade-decide-tokens")
    parser.add_argument("--num-prompts", type=int, default=40, help="built-in chat prompts sent")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer length limit (EOS honoured)")
    parser.add_argument("--serve-args", default="", help="more `llmaccel serve` flags for both servers, e.g. "
                        "'--dtype float32'")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")


def ask(client: httpx.Client, url: str, text: str, max_tokens: int) -> dict:
    """One prompt alone: its answer, route header and seconds."""
    began = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
        "result_cache": False})
    response.raise_for_status()
    return {"text": response.json()["choices"][0]["message"]["content"],
            "route": response.headers.get("x-llmaccel-route"), "seconds": time.perf_counter() - began}


def summarize(served: list[dict], large: list[dict]) -> dict:
    """The cascade's requests against the large model's on the same prompts: share routed to the large model, mean
    latency over large-only's (all, and by route), answers identical to large-only's (all, and of those routed)."""
    pairs = list(zip(served, large, strict=True))
    by_route = {}
    for route in ("small", "large"):
        chosen = [(a["seconds"], b["seconds"]) for a, b in pairs if a["route"] == route]
        if chosen:
            by_route[route] = statistics.fmean(a for a, _ in chosen) / statistics.fmean(b for _, b in chosen)
    routed_same = [a["text"] == b["text"] for a, b in pairs if a["route"] == "large"]
    return {"routed_to_large": statistics.fmean(a["route"] == "large" for a in served),
            "latency_vs_large_only": statistics.fmean(a["seconds"] for a in served)
            / statistics.fmean(b["seconds"] for b in large),
            "latency_by_route": by_route,
            "identical_to_large_only": statistics.fmean(a["text"] == b["text"] for a, b in pairs),
            "identical_when_routed_to_large": statistics.fmean(routed_same) if routed_same else None}


def run(args: argparse.Namespace) -> int:
    prompts = [p.prompt for p in builtin_prompts()[:args.num_prompts]]
    serve = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache",
             *args.serve_args.split()]
    cascade = serve + ["--cascade-small", args.small, "--cascade-threshold", str(args.threshold),
                       "--cascade-decide-tokens", str(args.decide_tokens)]
    served, large, procs = [], [], []
    with tempfile.TemporaryDirectory() as logs, httpx.Client(timeout=600) as client:
        try:
            urls = []
            for label, command in (("cascade", cascade), ("large-only", serve)):
                port = free_port()
                procs.append(start_server(command, port, Path(logs) / f"{label}.log"))
                urls.append(f"http://127.0.0.1:{port}")
                ask(client, urls[-1], "Hi", 4)  # warm-up
            for i, text in enumerate(tqdm(prompts, desc="prompts")):
                for side in ((0, 1) if i % 2 == 0 else (1, 0)):
                    (served, large)[side].append(ask(client, urls[side], text, args.max_tokens))
        finally:
            for proc in procs:
                stop_server(proc)
    summary = summarize(served, large)
    routed = summary["identical_when_routed_to_large"]
    print(f"{len(prompts)} prompts one at a time: {summary['routed_to_large']:.0%} routed to the large model; mean "
          f"latency {summary['latency_vs_large_only']:.2f}x large-only ("
          + ", ".join(f"{k}-routed {v:.2f}x" for k, v in summary["latency_by_route"].items()) + "); "
          f"{summary['identical_to_large_only']:.0%} of answers identical to large-only "
          f"({routed or 0:.0%} of the routed ones)")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "machine": machine_record(), "args": {k: str(v) for k, v in vars(args).items()
                                                  if k != "func"},
            **summary, "requests": {"cascade": served, "large-only": large}}, indent=1, ensure_ascii=False) + "\n")
    return 0
