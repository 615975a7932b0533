"""A cascade as served: `llmaccel serve --cascade-small` against the large model served alone, both up at
once (an idle server costs nothing), each built-in chat prompt sent alone to one then the other (the
order alternating, so both see the same machine; greedy, up to --max-tokens). Reports the share routed
to the large model (the x-llmaccel-route header), the mean latency of a request against large-only, by
route, and the share of answers identical to large-only.

    .venv/bin/python tools/cascade_served.py --small students/smollm2-8l --threshold -0.942 \\
        --result-json docs/results/issue15/cascade-served-zen4.json
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmaccel.bench.servers import free_port, start_server, stop_server  # noqa: E402
from llmaccel.data.prompts import builtin_prompts  # noqa: E402
from llmaccel.platform import machine_record  # noqa: E402


def ask(client: httpx.Client, url: str, text: str, max_tokens: int) -> dict:
    """One prompt alone: its answer, route header and seconds."""
    began = time.perf_counter()
    response = client.post(url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, "temperature": 0,
        "result_cache": False})
    response.raise_for_status()
    return {"text": response.json()["choices"][0]["message"]["content"],
            "route": response.headers.get("x-llmaccel-route"), "seconds": time.perf_counter() - began}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="the large model")
    parser.add_argument("--small", required=True, help="the cascade's small model")
    parser.add_argument("--threshold", type=float, required=True, help="--cascade-threshold")
    parser.add_argument("--decide-tokens", type=int, default=32, help="--cascade-decide-tokens")
    parser.add_argument("--num-prompts", type=int, default=40, help="built-in chat prompts sent")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer length limit (EOS honoured)")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")
    args = parser.parse_args()
    prompts = [p.prompt for p in builtin_prompts()[:args.num_prompts]]
    serve = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache"]
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
    routed = statistics.fmean(r["route"] == "large" for r in served)
    latency = statistics.fmean(r["seconds"] for r in served) / statistics.fmean(r["seconds"] for r in large)
    by_route = {route: [(a["seconds"], b["seconds"]) for a, b in zip(served, large, strict=True) if a["route"] == route]
                for route in ("small", "large")}
    by_route = {route: statistics.fmean(a for a, _ in pairs) / statistics.fmean(b for _, b in pairs)
                for route, pairs in by_route.items() if pairs}
    same = statistics.fmean(a["text"] == b["text"] for a, b in zip(served, large, strict=True))
    same_routed = [a["text"] == b["text"] for a, b in zip(served, large, strict=True) if a["route"] == "large"]
    print(f"{len(prompts)} prompts one at a time: {routed:.0%} routed to the large model; mean latency "
          f"{latency:.2f}x large-only (" + ", ".join(f"{k}-routed {v:.2f}x" for k, v in by_route.items()) + f"); "
          f"{same:.0%} of answers identical to large-only "
          f"({statistics.fmean(same_routed) if same_routed else 0:.0%} of the routed ones)")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "machine": machine_record(), "args": {k: str(v) for k, v in vars(args).items()},
            "routed_to_large": routed, "latency_vs_large_only": latency, "latency_by_route": by_route,
            "identical_to_large_only": same,
            "requests": {"cascade": served, "large-only": large}}, indent=1, ensure_ascii=False) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
