"""`llmaccel bench priority`: a high-priority request's time to first token behind a queue of long low-priority
ones, and a light API key's behind a heavy key's flood, with --scheduling-policy priority against fcfs (issue 46).

One `llmaccel serve` per policy, each with two API keys, measured one at a time:
- **priority**: --ttft-samples streamed chat completions with priority 0, one at a time, on the idle server; then
  --low-requests long completions (priority 5, --low-tokens tokens, EOS ignored) are sent at once and, once the
  server has them, as many high-priority requests, 0.3 s apart, so each arrives under that load. Reported: median
  TTFT loaded / idle.
- **fair share**: the light key runs --light-clients closed-loop clients (one streamed request after another,
  each --fair-tokens tokens) for --seconds, alone; then again while the heavy key runs 10x as many clients (not
  streamed: the load generator shares the machine's cores with the server). Reported: the light key's p50 TTFT
  with the flood / alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

KEYS = {"light": "light-key", "heavy": "heavy-key"}
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."
MESSAGES = [{"role": "user", "content": PROMPT}]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model each server serves")
    parser.add_argument("--policies", default="priority,fcfs", help="comma list of --scheduling-policy values")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="each server's --max-num-seqs")
    parser.add_argument("--low-requests", type=int, default=64, help="long low-priority requests queued")
    parser.add_argument("--low-tokens", type=int, default=512, help="tokens each of them generates")
    parser.add_argument("--ttft-samples", type=int, default=15, help="high-priority requests timed, idle and loaded")
    parser.add_argument("--light-clients", type=int, default=2, help="the light key's concurrent clients")
    parser.add_argument("--fair-tokens", type=int, default=64, help="tokens per fair-share request")
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each fair-share phase")
    parser.add_argument("--result-json", type=Path, help="write every figure to this JSON file")


async def _ttft(client, priority: int, tokens: int) -> float:
    """Seconds to the first streamed text of one chat completion."""
    began = time.perf_counter()
    stream = await client.chat.completions.create(model="default", messages=MESSAGES, max_tokens=tokens,
                                                  temperature=0, stream=True,
                                                  extra_body={"priority": priority, "ignore_eos": True})
    first = None
    async for chunk in stream:
        if first is None and chunk.choices and chunk.choices[0].delta.content:
            first = time.perf_counter() - began
    return first if first is not None else time.perf_counter() - began


async def _priority_phase(url: str, args: argparse.Namespace) -> dict:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["light"], max_retries=0, timeout=3600)
    heavy = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["heavy"], max_retries=0, timeout=3600)
    await _ttft(client, 0, 4)  # warm-up
    idle = [await _ttft(client, 0, 8) for _ in range(args.ttft_samples)]
    lows = [asyncio.create_task(heavy.completions.create(
        model="default", prompt=PROMPT, max_tokens=args.low_tokens, temperature=0,
        extra_body={"priority": 5, "ignore_eos": True})) for _ in range(args.low_requests)]
    async with httpx.AsyncClient() as http:  # wait until the server holds every low request
        while True:
            stats = (await http.get(url + "/v1/llmaccel/stats",
                                    headers={"Authorization": f"Bearer {KEYS['light']}"})).json()
            if stats["engine"]["running"] + stats["engine"]["waiting"] >= args.low_requests:
                break
            await asyncio.sleep(0.2)
    async def spaced(i: int) -> float:  # each arrives while the low requests still run or wait
        await asyncio.sleep(0.3 * i)
        return await _ttft(client, 0, 8)

    loaded = await asyncio.gather(*(spaced(i) for i in range(args.ttft_samples)))
    await asyncio.gather(*lows)
    await client.close()
    await heavy.close()
    return {"idle_ttft_s": idle, "loaded_ttft_s": loaded,
            "ratio": statistics.median(loaded) / statistics.median(idle)}


async def _fair_phase(url: str, args: argparse.Namespace, with_flood: bool) -> list[float]:
    import openai

    light = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["light"], max_retries=0, timeout=3600)
    heavy = openai.AsyncOpenAI(base_url=url + "/v1", api_key=KEYS["heavy"], max_retries=0, timeout=3600)
    end = time.perf_counter() + args.seconds
    times: list[float] = []

    async def light_loop() -> None:
        while time.perf_counter() < end:
            times.append(await _ttft(light, 0, args.fair_tokens))

    async def heavy_loop() -> None:  # not streamed: the load generator shares the machine's cores
        while time.perf_counter() < end:
            await heavy.completions.create(model="default", prompt=PROMPT, max_tokens=args.fair_tokens,
                                           temperature=0, extra_body={"ignore_eos": True})

    clients = [light_loop() for _ in range(args.light_clients)]
    if with_flood:
        clients += [heavy_loop() for _ in range(10 * args.light_clients)]
    async with light, heavy:
        await asyncio.gather(*clients)
    return times


def _interrupted_steps(url: str) -> int:
    """Steps the server has stopped between layers so far, for arrivals that outranked them."""
    import httpx

    stats = httpx.get(url + "/v1/llmaccel/stats", headers={"Authorization": f"Bearer {KEYS['light']}"}).json()
    return int(stats["totals"]["interrupted_steps"] or 0)


def run(args: argparse.Namespace) -> int:
    from llmaccel.bench.servers import free_port, start_server, stop_server
    from llmaccel.platform import describe

    results = {"model": args.model, "machine": describe(), "args": {k: str(v) for k, v in vars(args).items()},
               "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for policy in args.policies.split(","):
            port = free_port()
            command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", args.model, "--no-result-cache",
                       "--no-input-filter", "--semantic-guard", "off", "--scheduling-policy", policy,
                       "--max-num-seqs", str(args.max_num_seqs), "--served-model-name", "default",
                       "--api-key", KEYS["light"], "--api-key", KEYS["heavy"], "--max-waiting-requests", "100000"]
            proc = start_server(command, port, Path(tmp) / f"{policy}.log")
            url = f"http://127.0.0.1:{port}"
            try:
                priority = asyncio.run(_priority_phase(url, args))
                priority["interrupted_steps"] = _interrupted_steps(url)
                alone = asyncio.run(_fair_phase(url, args, with_flood=False))
                before = _interrupted_steps(url)
                flooded = asyncio.run(_fair_phase(url, args, with_flood=True))
                interrupted = _interrupted_steps(url) - before
            finally:
                stop_server(proc)
            fair = {"light_alone_ttft_s": alone, "light_flooded_ttft_s": flooded,
                    "ratio": statistics.median(flooded) / statistics.median(alone),
                    "light_requests_alone": len(alone), "light_requests_flooded": len(flooded),
                    "interrupted_steps_flooded": interrupted}
            results["policies"][policy] = {"priority": priority, "fair_share": fair}
            print(f"{policy}: high-priority TTFT {statistics.median(priority['idle_ttft_s']) * 1e3:.0f} ms idle, "
                  f"{statistics.median(priority['loaded_ttft_s']) * 1e3:.0f} ms behind {args.low_requests} low "
                  f"({priority['ratio']:.2f}x); light key p50 TTFT {statistics.median(alone) * 1e3:.0f} ms alone, "
                  f"{statistics.median(flooded) * 1e3:.0f} ms beside a 10x flood ({fair['ratio']:.2f}x)", flush=True)
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(results, indent=2))
    return 0
