"""`llmaccel bench replicas`: replicas on Ray Serve against one process, and the routers against each other.

Two parts, each in one run on this machine:
- throughput: the same burst of built-in prompts (all at once) against `llmaccel serve` (one engine
  with every core) and against `llmaccel serve --replicas N` (N engines, the cores split), rounds
  alternating, medians compared;
- multi-turn routing (also `llmaccel bench multiturn --replicas N`): conversations that share a
  system prompt, every turn resending the whole history, all conversations advancing a turn at a
  time in a shuffled order (as independent clients arrive), against N replicas with each router.
  The prefix-cache hit rate is what the server's usage reports: cached prompt tokens / prompt tokens.
  Each replica gets --kv-cache-memory; the single process, shown for reference, gets N times that.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import time
from pathlib import Path

import aiohttp

from llmaccel.bench.serve import send_request
from llmaccel.bench.serve_metrics import RequestResult, percentile
from llmaccel.data.prompts import SYSTEM_PROMPT

ROUTER_NAMES = ("cache-aware", "round-robin", "ray-prefix")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--replicas", type=int, default=2, help="engine replicas of the replicated servers")
    parser.add_argument("--kv-cache-memory", default="256MiB",
                        help="KV cache of each replica (the single process gets --replicas times this)")
    parser.add_argument("--max-num-seqs", type=int, default=128,
                        help="most sequences in one step of each replica (the single process: --replicas times this)")
    parser.add_argument("--routers", default=",".join(ROUTER_NAMES),
                        help="routers to compare on the multi-turn chats, comma-separated (see serve --router)")
    parser.add_argument("--conversations", type=int, default=48, help="multi-turn: conversations side by side")
    parser.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    parser.add_argument("--reply-tokens", type=int, default=48, help="multi-turn: tokens of every reply (EOS ignored)")
    parser.add_argument("--num-prompts", type=int, default=64, help="throughput: requests in the burst")
    parser.add_argument("--output-len", type=int, default=128, help="throughput: tokens per request (EOS ignored)")
    parser.add_argument("--rounds", type=int, default=2, help="throughput: alternating rounds of each server")
    parser.add_argument("--skip-throughput", action="store_true", help="only the multi-turn routing part")
    parser.add_argument("--skip-multiturn", action="store_true", help="only the throughput part")
    parser.add_argument("--seed", type=int, default=0, help="the order in which conversations arrive each turn")
    parser.add_argument("--shared-tier", action="store_true",
                        help="multi-turn: also run each router with the replicas sharing a disk tier "
                             "(--kv-offload-dir in the run's folder, --kv-offload-policy write-through), so a "
                             "replica finds the blocks another computed")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


def _server(args: argparse.Namespace, log: Path, replicas: int | None, router: str | None = None,
            kv_memory: str | None = None, tier: Path | None = None):
    from llmaccel.bench.servers import free_port, start_server

    # --no-input-filter, --semantic-guard off: each turn sends the model's own replies back as history, and a
    # reply that happens to match a rule (a 135M model's text once matched 'jailbreak.persona') or the guard
    # would end that run; this measures routing
    command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache",
               "--no-input-filter", "--semantic-guard", "off", "--kv-cache-memory", kv_memory or args.kv_cache_memory,
               "--max-num-seqs", str(args.max_num_seqs * (args.replicas if replicas is None else 1))]
    if replicas is not None:
        command += ["--replicas", str(replicas)]
    if router is not None:
        command += ["--router", router]
    if tier is not None:
        command += ["--kv-offload-dir", str(tier), "--kv-offload-policy", "write-through"]
    port = free_port()
    return start_server(command, port, log, timeout=600), f"http://127.0.0.1:{port}"


def _total_kv(args: argparse.Namespace) -> str:
    from llmaccel.config import parse_memory_size

    return str(parse_memory_size(args.kv_cache_memory) * args.replicas)


def throughput(args: argparse.Namespace, workdir: Path) -> dict:
    from llmaccel.bench.datasets import builtin_requests
    from llmaccel.bench.serve import benchmark_args, run_benchmark, tokenizer_for
    from llmaccel.bench.servers import stop_server

    runs: dict[str, list[dict]] = {"1 process": [], f"{args.replicas} replicas": []}
    for round_index in range(args.rounds):
        for label, replicas in (("1 process", None), (f"{args.replicas} replicas", args.replicas)):
            proc, url = _server(args, workdir / f"throughput-{label.replace(' ', '-')}-{round_index}.log",
                                replicas, kv_memory=_total_kv(args) if replicas is None else None)
            try:
                bench = benchmark_args(url, label, "--model", args.model)
                tokenizer = tokenizer_for(bench)
                warm = builtin_requests(tokenizer, 4, 8)
                asyncio.run(run_benchmark(bench, warm, tokenizer, float("inf"), 4, progress=False))
                burst = builtin_requests(tokenizer, args.num_prompts, args.output_len)
                result = asyncio.run(run_benchmark(bench, burst, tokenizer, float("inf"), args.num_prompts))
                runs[label].append({k: result[k] for k in ("output_throughput", "request_throughput", "duration_s",
                                                           "completed", "failed", "median_ttft_ms",
                                                           "median_tpot_ms")})
            finally:
                stop_server(proc)
    medians = {label: statistics.median(r["output_throughput"] for r in rs) for label, rs in runs.items()}
    single, replicated = medians.values()
    return {"runs": runs, "median_output_tok_per_s": medians, "ratio": replicated / single}


def shared_prefix_tokens(args: argparse.Namespace, block_size: int = 16) -> int:
    """Tokens of the prompt prefix every conversation shares (the system prompt as the template writes
    it), in whole KV blocks: each replica computes them once, whatever the router does."""
    from llmaccel.bench.serve import load_tokenizer
    from llmaccel.data.prompts import builtin_prompts

    tokenizer = load_tokenizer(args.model)
    questions = [p.prompt for p in builtin_prompts()]
    ids = [tokenizer.encode(tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}], tokenize=False,
        add_generation_prompt=True), add_special_tokens=False) for q in questions[:8]]
    common = 0
    while all(len(x) > common and x[common] == ids[0][common] for x in ids):
        common += 1
    return common // block_size * block_size


async def _conversations(url: str, args: argparse.Namespace, shared: int = 0) -> dict:
    from llmaccel.data.prompts import builtin_prompts

    questions = [p.prompt for p in builtin_prompts()]
    histories = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(args.conversations)]
    rng = random.Random(args.seed)
    prompt_tokens = cached_tokens = generated = 0
    own_prompt = own_cached = 0  # past the prefix every conversation shares: what routing can change
    per_turn, replies, returning = [], [], []
    connector = aiohttp.TCPConnector(limit=args.conversations, limit_per_host=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600),
                                     read_bufsize=2**20) as client:
        async def ask(c: int) -> RequestResult:
            # min_tokens, not ignore_eos: an end-of-turn token mid-reply would vanish from the reply's text,
            # so the next turn's prompt would part from the cached blocks there, by chance, router by router
            body = {"messages": histories[c], "max_tokens": args.reply_tokens, "min_tokens": args.reply_tokens,
                    "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
            result = await send_request(client, url + "/v1/chat/completions", body, 0, None)
            if result.error:  # the server's own words, not just the status
                raise RuntimeError(f"conversation {c}: {result.error}")
            return result

        start = time.perf_counter()
        for turn in range(args.turns):
            for c, history in enumerate(histories):
                history.append({"role": "user", "content": questions[(c * args.turns + turn) % len(questions)]})
            order = list(range(args.conversations))
            rng.shuffle(order)
            tasks = {}
            for c in order:  # they arrive in a shuffled order, a millisecond apart
                tasks[c] = asyncio.create_task(ask(c))
                await asyncio.sleep(0.001)
            answers = {c: await task for c, task in tasks.items()}
            turn_prompt = turn_cached = 0
            for c in range(args.conversations):
                answer = answers[c]
                turn_prompt += answer.prompt_len
                turn_cached += answer.cached_tokens
                own_prompt += answer.prompt_len - shared
                own_cached += max(answer.cached_tokens - shared, 0)
                generated += answer.output_len
                histories[c].append({"role": "assistant", "content": answer.generated_text})
                replies.append(answer.generated_text)
            ttfts = sorted(answers[c].ttft for c in range(args.conversations))
            per_turn.append({"prompt_tokens": turn_prompt, "cached_tokens": turn_cached,
                             "hit_rate": turn_cached / turn_prompt, "ttft_p50_s": statistics.median(ttfts),
                             "ttft_max_s": ttfts[-1]})
            returning += ttfts if turn else []
            prompt_tokens += turn_prompt
            cached_tokens += turn_cached
        seconds = time.perf_counter() - start
        await asyncio.sleep(2.5)  # the replicas' counters reach the ingress every second
        async with client.get(url + "/metrics") as response:
            metrics = await response.text()
    spread = [float(v) for v in re.findall(r"^llmaccel_replica_requests_total\{[^}]*\} (\S+)$", metrics, re.M)]
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens, "hit_rate": cached_tokens / prompt_tokens,
            "shared_prefix_tokens": shared, "own_hit_rate": own_cached / own_prompt,
            "prefill_tokens_computed": prompt_tokens - cached_tokens, "output_tokens": generated,
            "seconds": seconds, "output_tok_per_s": generated / seconds, "per_turn": per_turn,
            "returning_ttft_p50_s": statistics.median(returning) if returning else None,
            "returning_ttft_p99_s": percentile(sorted(returning), 99) if returning else None,
            "requests_per_replica": spread, "replies": replies}


def multiturn(args: argparse.Namespace, workdir: Path) -> dict:
    from llmaccel.bench.servers import stop_server

    rows = {}
    shared = shared_prefix_tokens(args)
    configs = [(router, args.replicas, router, False) for router in args.routers.split(",")]
    if getattr(args, "shared_tier", False):  # bench multiturn --replicas has no such flag
        configs += [(f"{router} + shared disk tier", args.replicas, router, True) for router in args.routers.split(",")]
    configs.append(("1 process", None, None, False))
    for label, replicas, router, shared_tier in configs:
        slug = label.replace(" ", "-").replace("+", "")
        tier = workdir / f"kv-{slug}" if shared_tier else None
        proc, url = _server(args, workdir / f"multiturn-{slug}.log", replicas, router,
                            kv_memory=_total_kv(args) if replicas is None else None, tier=tier)
        try:
            rows[label] = asyncio.run(_conversations(url, args, shared))
        finally:
            stop_server(proc)
        r = rows[label]
        print(f"{label}: hit rate {r['hit_rate']:.1%} ({r['own_hit_rate']:.1%} past the shared {shared}-token "
              f"prefix), {r['output_tok_per_s']:.0f} output tok/s, returning turns' TTFT p50 "
              f"{r['returning_ttft_p50_s'] * 1000:.0f} ms p99 {r['returning_ttft_p99_s'] * 1000:.0f} ms, requests "
              f"per replica {r['requests_per_replica']}", file=sys.stderr)
    replies = [r.pop("replies") for r in rows.values()]
    identical = all(r == replies[0] for r in replies)
    result = {"rows": rows, "replies_identical": identical, "shared_prefix_tokens": shared}
    if "cache-aware" in rows:
        result["projection"] = project_hit_rates(rows, args.conversations, shared)
    return result


def router_costs(replica_counts=(2, 8, 64, 512), blocks_per_replica: int = 4096, prompt_blocks: int = 32,
                 decisions: int = 2000) -> dict:
    """What one cache-aware routing decision and one published cache change cost, in this process, at
    each cluster size: the measured inputs of the projection in docs/scaling.md. Every replica holds
    `blocks_per_replica` block hashes; each prompt has `prompt_blocks` full blocks, a random share of
    which one replica holds."""
    from llmaccel.cluster.kv_index import BlockView, ClusterState
    from llmaccel.cluster.routing import pick_replica

    rng = random.Random(0)
    rows = {}
    for n in replica_counts:
        names = [f"replica-{i}" for i in range(n)]
        view = BlockView()
        state = ClusterState(max_log=10**9)
        prompts = [[rng.getrandbits(63) for _ in range(prompt_blocks)] for _ in range(256)]
        for i, name in enumerate(names):
            held = [rng.getrandbits(63) for _ in range(blocks_per_replica)]
            for p in prompts[i % len(prompts)::n]:
                held += p[:rng.randrange(prompt_blocks)]
            state.publish(name, {}, held, [], reset=True)
        cursor, entries, snapshot = state.changes(0)
        view.apply(cursor, entries, snapshot)
        loads = {name: rng.randrange(8) for name in names}
        start = time.perf_counter()
        for d in range(decisions):
            hashes = prompts[d % len(prompts)]
            pick_replica(loads, {name: view.matched(name, hashes) for name in names}, 8)
        per_decision = (time.perf_counter() - start) / decisions
        start = time.perf_counter()
        for d in range(decisions):
            state.publish(names[d % n], None, [rng.getrandbits(63)], [rng.getrandbits(63)])
        per_event = (time.perf_counter() - start) / decisions
        rows[n] = {"decision_us": per_decision * 1e6, "publish_us": per_event * 1e6,
                   "decisions_per_s": 1 / per_decision, "publishes_per_s": 1 / per_event}
    return rows


def project_hit_rates(rows: dict, conversations: int, shared: int, replica_counts=(2, 8, 64, 512)) -> dict:
    """A model, not a measurement: the hit rate of round-robin at N replicas, from the measured
    cache-aware turns. A turn finds cached what its conversation's previous visit to the same
    replica left: with round-robin over N replicas the last visit was k turns back with probability
    (1/N)(1 - 1/N)^(k-1), and then the cached prefix is what cache-aware routing found at that
    visit's next turn; a replica never visited holds only the shared prefix. Cache-aware routing
    keeps a conversation on one replica whatever N is (while each replica's cache holds its share),
    so its rate stays the measured one. At N = 2 the model can be checked against the measured
    round-robin row."""
    turns = rows["cache-aware"]["per_turn"]
    held = [t["cached_tokens"] / conversations for t in turns]  # cache-aware: cached tokens per request, turn t
    prompts = [t["prompt_tokens"] / conversations for t in turns]
    out = {}
    for n in replica_counts:
        p = 1.0 / n
        cached = held[0]  # a first turn finds the shared prefix wherever it goes
        for t in range(1, len(turns)):
            cached += sum(p * (1 - p) ** (k - 1) * held[t - k + 1] for k in range(1, t + 1))
            cached += (1 - p) ** t * min(shared, prompts[t])
        out[n] = {"round_robin_hit_rate": cached / sum(prompts),
                  "cache_aware_hit_rate": rows["cache-aware"]["hit_rate"]}
    return out


def format_report(result: dict) -> str:
    lines = []
    if "throughput" in result:
        t = result["throughput"]
        lines.append("| server | output tok/s (median) | runs |")
        lines.append("|---|---|---|")
        for label, value in t["median_output_tok_per_s"].items():
            runs = ", ".join(f"{r['output_throughput']:.0f}" for r in t["runs"][label])
            lines.append(f"| {label} | {value:.1f} | {runs} |")
        lines.append(f"replicated / single: {t['ratio']:.2f}x")
    if "multiturn" in result:
        m = result["multiturn"]
        rows = m["rows"]
        lines.append("")
        lines.append("| routing | prompt tokens | cached | hit rate | hit rate past the shared prefix | output tok/s "
                     "| returning turns' TTFT p50 / p99 | requests per replica |")
        lines.append("|---|---|---|---|---|---|---|---|")
        for label, r in rows.items():
            spread = "/".join(f"{v:.0f}" for v in r["requests_per_replica"]) or "-"
            ttft = (f"{r['returning_ttft_p50_s'] * 1000:.0f} / {r['returning_ttft_p99_s'] * 1000:.0f} ms"
                    if r.get("returning_ttft_p50_s") is not None else "-")
            lines.append(f"| {label} | {r['prompt_tokens']} | {r['cached_tokens']} | {r['hit_rate']:.1%} | "
                         f"{r['own_hit_rate']:.1%} | {r['output_tok_per_s']:.1f} | {ttft} | {spread} |")
        if "cache-aware" in rows:
            ours = rows["cache-aware"]
            for other in ("round-robin", "ray-prefix"):
                if other in rows:
                    lines.append(f"cache-aware / {other}: hit rate {ours['hit_rate'] / rows[other]['hit_rate']:.2f}x, "
                                 f"past the shared prefix {ours['own_hit_rate'] / rows[other]['own_hit_rate']:.2f}x")
        lines.append(f"replies identical across servers: {m['replies_identical']}")
    if "projection" in result.get("multiturn", {}):
        lines.append("")
        lines.append("| replicas (model) | round-robin hit rate | cache-aware hit rate |")
        lines.append("|---|---|---|")
        for n, r in result["multiturn"]["projection"].items():
            lines.append(f"| {n} | {r['round_robin_hit_rate']:.1%} | {r['cache_aware_hit_rate']:.1%} |")
    if "router_costs" in result:
        lines.append("")
        lines.append("| replicas | one routing decision (us) | decisions/s | one cache update published (us) |")
        lines.append("|---|---|---|---|")
        for n, r in result["router_costs"].items():
            lines.append(f"| {n} | {r['decision_us']:.1f} | {r['decisions_per_s']:.0f} | {r['publish_us']:.1f} |")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import tempfile

    from llmaccel.platform import machine_record

    result: dict = {"machine": machine_record(), "args": {k: str(v) for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory(prefix="llmaccel-bench-replicas-") as tmp:
        workdir = Path(tmp)
        if not args.skip_multiturn:
            result["multiturn"] = multiturn(args, workdir)
        if not args.skip_throughput:
            result["throughput"] = throughput(args, workdir)
    result["router_costs"] = router_costs()
    print(format_report(result))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1))
    return 0
