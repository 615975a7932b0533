"""`llmaccel bench soak`: identical passes of rough but ordinary traffic, and what each leaves behind.

Every pass sends the same mix of streamed chat requests at a fixed concurrency: most read to the end; a
share disconnects after a few chunks; a share gives up at a client timeout; and groups of identical
deterministic requests arrive together (the result cache serves each group with one engine request).
After each pass the tool waits for the server to go idle and records the requests by outcome, the lost
ones (accepted, not abandoned by their client, yet not answered in full, or answered with an error),
the gauges (running, waiting, KV-cache usage) and the server's RSS beside the engine's own memory parts
(weights, KV pool, the part of the pool ever written). The KV pool is mapped lazily and the prefix cache
keeps freed blocks' contents, handing out never-used blocks before it evicts a cached one, so RSS grows
until the pool has been written once, then stays: weights + KV pool + a constant.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from llmaccel.data.prompts import builtin_prompts
from llmaccel.server.metrics import PREFIX, parse_metrics

OUTCOMES = ("completed", "disconnected", "timed_out", "refused", "lost")
GAUGES = ("num_requests_running", "num_requests_waiting", "kv_cache_usage_ratio")  # all 0 once the server is idle


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 150  # per pass
    concurrency: int = 48
    disconnect_share: float = 0.33  # clients that close the stream after a few chunks
    timeout_share: float = 0.1  # clients that give up after client_timeout_s
    client_timeout_s: float = 0.5
    duplicate_groups: int = 5  # groups of identical deterministic requests sent at once
    duplicate_size: int = 4
    max_tokens: int = 64
    seed: int = 0


@dataclass
class PassResult:
    index: int
    seconds: float
    outcomes: dict[str, int]
    lost_details: list[str]
    settled: bool  # the gauges returned to zero after the pass
    gauges: dict[str, float]
    rss_bytes: float
    memory: dict[str, float] = field(default_factory=dict)  # llmaccel_memory_bytes by part


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="soak a server that is already running (default: start `llmaccel serve`)")
    parser.add_argument("--model", default="smollm2-135m", help="the model of the server this command starts")
    parser.add_argument("--serve-args", default="", help="extra flags for the server this command starts")
    parser.add_argument("--api-key", help="Bearer key for --url")
    parser.add_argument("--passes", type=int, default=6, help="identical passes to run")
    parser.add_argument("--requests", type=int, default=150, help="streamed chat requests per pass")
    parser.add_argument("--concurrency", type=int, default=48, help="requests in flight at once")
    parser.add_argument("--disconnect-share", type=float, default=0.33,
                        help="share of clients that disconnect after a few chunks")
    parser.add_argument("--timeout-share", type=float, default=0.1,
                        help="share of clients that give up after --client-timeout")
    parser.add_argument("--client-timeout", type=float, default=0.5, help="seconds those clients wait")
    parser.add_argument("--duplicate-groups", type=int, default=5,
                        help="groups of identical deterministic requests sent together per pass")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens per request (EOS ignored)")
    parser.add_argument("--seed", type=int, default=0, help="picks prompts and client behaviours")
    parser.add_argument("--result-json", type=Path, help="write every pass's figures here")
    parser.add_argument("--plot", type=Path, help="write a PNG of RSS per pass, split into its parts")


def plan(config: SoakConfig, pass_index: int) -> list[tuple[str, dict]]:
    """The requests of one pass: (behaviour, body). The same for every pass but for the duplicates'
    prompts, which name the pass so each group is new (in flight together, not a cache hit)."""
    rng = random.Random(config.seed)
    prompts = [p.prompt for p in builtin_prompts()]
    base = {"max_tokens": config.max_tokens, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    jobs = []
    for i in range(config.requests):
        draw = rng.random()
        kind = ("disconnect" if draw < config.disconnect_share else
                "timeout" if draw < config.disconnect_share + config.timeout_share else "read")
        body = {**base, "messages": [{"role": "user", "content": prompts[i % len(prompts)]}], "temperature": 0.8}
        jobs.append((kind, body))
    for g in range(config.duplicate_groups):
        question = f"{prompts[(g * 7) % len(prompts)]} (soak pass {pass_index}, group {g})"
        body = {**base, "messages": [{"role": "user", "content": question}], "temperature": 0}
        jobs += [(f"duplicate-{g}", body)] * config.duplicate_size
    rng.shuffle(jobs)
    return jobs


async def _one(client: httpx.AsyncClient, url: str, kind: str, body: dict, config: SoakConfig,
               rng: random.Random, texts: dict[str, list[str]]) -> tuple[str, str]:
    """Send one request as its client behaves; returns its outcome and, if lost, why."""
    stop_after = rng.randint(1, 4)

    async def consume() -> tuple[str, str]:
        async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")[:200]
                return ("refused", "") if response.status_code < 500 else ("lost", f"{response.status_code} {text}")
            chunks, pieces, usage, done = 0, [], None, False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    done = True
                    break
                data = json.loads(line[6:])
                if "error" in data:
                    return "lost", f"error event {data['error']}"
                usage = data.get("usage") or usage
                pieces += [c["delta"].get("content") or "" for c in data.get("choices", [])]
                chunks += 1
                if kind == "disconnect" and chunks >= stop_after:
                    return "disconnected", ""  # leaving the block closes the connection mid-stream
            if not done or usage is None or usage["completion_tokens"] != config.max_tokens:
                return "lost", f"incomplete: done={done} usage={usage}"
            if kind.startswith("duplicate"):
                texts.setdefault(kind, []).append("".join(pieces))
            return "completed", ""

    if kind != "timeout":
        return await consume()
    try:
        return await asyncio.wait_for(consume(), config.client_timeout_s)
    except TimeoutError:
        return "timed_out", ""


async def run_pass(url: str, config: SoakConfig, index: int, headers: dict | None = None,
                   settle_s: float = 120.0) -> PassResult:
    """One pass against the server at `url`; then wait (up to `settle_s`) for its gauges to reach zero."""
    jobs = plan(config, index)
    rng = random.Random(config.seed * 1000 + index)
    gate = asyncio.Semaphore(config.concurrency)
    texts: dict[str, list[str]] = {}
    start = time.perf_counter()
    limits = httpx.Limits(max_connections=config.concurrency, max_keepalive_connections=config.concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits, headers=headers) as client:
        async def gated(kind: str, body: dict) -> tuple[str, str]:
            async with gate:
                return await _one(client, url, kind, body, config, rng, texts)

        results = await asyncio.gather(*(gated(kind, body) for kind, body in jobs))
    seconds = time.perf_counter() - start
    outcomes = {name: 0 for name in OUTCOMES}
    lost = []
    for outcome, why in results:
        outcomes[outcome] += 1
        if why:
            lost.append(why)
    for group, answers in texts.items():  # identical deterministic requests get identical answers
        if len(set(answers)) > 1:
            outcomes["lost"] += 1
            lost.append(f"{group}: {len(set(answers))} different answers to one deterministic request")
    settled, samples = await _settle(url, headers, settle_s)
    gauges = {name: samples.get(PREFIX + name, {}).get((), float("nan")) for name in GAUGES}
    memory = {labels[0][1]: value for labels, value in samples.get(PREFIX + "memory_bytes", {}).items()}
    rss = samples.get("process_resident_memory_bytes", {}).get((), float("nan"))
    return PassResult(index, seconds, outcomes, lost, settled, gauges, rss, memory)


async def _settle(url: str, headers: dict | None, timeout_s: float) -> tuple[bool, dict]:
    """Poll /metrics until running, waiting and KV usage are all zero; returns whether they got there."""
    deadline = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=30, headers=headers) as client:
        while True:
            samples = parse_metrics((await client.get(url + "/metrics")).text)
            values = [samples.get(PREFIX + name, {}).get(()) for name in GAUGES]
            if all(v == 0 for v in values):
                return True, samples
            if time.monotonic() > deadline:
                return False, samples
            await asyncio.sleep(0.1)


def run(args: argparse.Namespace) -> int:
    from llmaccel.bench.servers import free_port, start_server, stop_server
    from llmaccel.platform import describe

    config = SoakConfig(args.requests, args.concurrency, args.disconnect_share, args.timeout_share,
                        args.client_timeout, args.duplicate_groups, max_tokens=args.max_tokens, seed=args.seed)
    proc, url = None, args.url
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    if url is None:
        port = free_port()
        log = Path(tempfile.mkdtemp(prefix="llmaccel-soak-")) / "serve.log"
        print(f"starting llmaccel serve on port {port} (log: {log})", file=sys.stderr)
        proc = start_server([sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model,
                             *args.serve_args.split()], port, log)
        url = f"http://127.0.0.1:{port}"
    passes = []
    try:
        for index in range(args.passes):
            result = asyncio.run(run_pass(url.rstrip("/"), config, index, headers))
            passes.append(result)
            print(format_pass(result), file=sys.stderr)
    finally:
        if proc is not None:
            stop_server(proc)
    report = {"machine": describe(), "model": args.model if args.url is None else None,
              "serve_args": args.serve_args, "config": asdict(config), "passes": [asdict(p) for p in passes]}
    print(format_table(passes))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.result_json}", file=sys.stderr)
    if args.plot:
        plot(passes, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    lost = sum(p.outcomes["lost"] for p in passes)
    return 0 if lost == 0 and all(p.settled for p in passes) else 1


def format_pass(p: PassResult) -> str:
    parts = ", ".join(f"{k} {v}" for k, v in p.outcomes.items())
    return (f"pass {p.index + 1}: {parts} in {p.seconds:.1f} s; gauges {'0' if p.settled else p.gauges}; "
            f"RSS {p.rss_bytes / 2**30:.2f} GiB")


def format_table(passes: list[PassResult]) -> str:
    lines = ["| pass | requests | completed | disconnected | timed out | lost | gauges after | RSS (GiB) | "
             "weights + KV written (GiB) |", "|---|---|---|---|---|---|---|---|---|"]
    for p in passes:
        parts = p.memory.get("weights", 0) + p.memory.get("kv_pool_touched", 0)
        lines.append(f"| {p.index + 1} | {sum(p.outcomes.values())} | {p.outcomes['completed']} | "
                     f"{p.outcomes['disconnected']} | {p.outcomes['timed_out']} | {p.outcomes['lost']} | "
                     f"{'all 0' if p.settled else 'not 0'} | {p.rss_bytes / 2**30:.2f} | {parts / 2**30:.2f} |")
    return "\n".join(lines)


def plot(passes: list[PassResult], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [p.index + 1 for p in passes]
    weights = [p.memory.get("weights", 0) / 2**30 for p in passes]
    touched = [p.memory.get("kv_pool_touched", 0) / 2**30 for p in passes]
    rest = [p.rss_bytes / 2**30 - w - t for p, w, t in zip(passes, weights, touched, strict=True)]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.bar(x, weights, label="weights")
    ax.bar(x, touched, bottom=weights, label="KV pool written so far")
    ax.bar(x, rest, bottom=[w + t for w, t in zip(weights, touched, strict=True)], label="everything else")
    if passes and passes[-1].memory.get("kv_pool"):
        ceiling = weights[-1] + passes[-1].memory["kv_pool"] / 2**30 + max(rest)
        ax.axhline(ceiling, color="k", linestyle="--", linewidth=1,
                   label=f"weights + KV pool + {max(rest):.2f} GiB = {ceiling:.2f} GiB")
    ax.set_xlabel("soak pass (identical traffic each pass)")
    ax.set_ylabel("server RSS (GiB)")
    ax.set_xticks(x)
    ax.set_ylim(0, max(p.rss_bytes for p in passes) / 2**30 * 1.45)
    ax.legend(loc="upper left", fontsize=8, ncols=2)
    ax.set_title("RSS levels off once the KV pool has been written")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
