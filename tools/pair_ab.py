"""Paired A/B of two `llmaccel serve` configurations on a noisy machine.

Both servers run at once (an idle server costs nothing), and the same streamed workload goes to A, then
B, then B, then A, ... so each pair of runs sees the same machine; the figure is the median of the
per-round ratios B/A, which moves far less than either side's own tok/s (on the 2-core EPYC the same
configuration reads 150-240 tok/s within minutes). Each side is `ENV|FLAGS`, e.g.

    tools/pair_ab.py --rounds 10 "|--quantization int8" "THP_MEM_ALLOC_ENABLE=1|--quantization int8"
    tools/pair_ab.py --concurrency 64 --max-tokens 128 --rounds 6 "|" "|--max-num-seqs 32"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from llmaccel.bench.servers import free_port, start_server, stop_server  # noqa: E402
from llmaccel.data.prompts import builtin_prompts  # noqa: E402

LONE_PROMPT = "Tell me a long story about a dragon and a knight."


async def _one(session: aiohttp.ClientSession, url: str, text: str, max_tokens: int) -> None:
    body = {"messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for _ in response.content:
            pass


async def _workload(url: str, prompts: list[str], max_tokens: int) -> float:
    """Output tokens/s of all prompts at once."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        began = time.perf_counter()
        await asyncio.gather(*(_one(session, url, text, max_tokens) for text in prompts))
        return len(prompts) * max_tokens / (time.perf_counter() - began)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("a", help="configuration A: 'ENV=V ...|serve flags'")
    parser.add_argument("b", help="configuration B, the same way")
    parser.add_argument("--rounds", type=int, default=10, help="A/B pairs (the order alternates)")
    parser.add_argument("--max-tokens", type=int, default=300, help="tokens each request generates (EOS ignored)")
    parser.add_argument("--concurrency", type=int, default=1,
                        help="requests at once (1: the lone chat prompt; more: the built-in prompts)")
    args = parser.parse_args()
    prompts = [LONE_PROMPT] if args.concurrency == 1 else [
        p.prompt for p in builtin_prompts()[:args.concurrency]]
    servers, urls = [], []
    try:
        for side in (args.a, args.b):
            env_text, _, flags = side.partition("|")
            env = {**os.environ, **dict(item.split("=", 1) for item in env_text.split())}
            port = free_port()
            command = [sys.executable, "-m", "llmaccel.cli", "serve", "--no-result-cache", *flags.split()]
            log = Path(tempfile.gettempdir()) / f"pair-ab-{port}.log"
            servers.append(start_server(command, port, log, env=env))
            urls.append(f"http://127.0.0.1:{port}")
        for url in urls:  # warm both
            asyncio.run(_workload(url, prompts, 8))
        rates: list[list[float]] = [[], []]
        for r in range(args.rounds):
            for side in ((0, 1) if r % 2 == 0 else (1, 0)):
                rates[side].append(asyncio.run(_workload(urls[side], prompts, args.max_tokens)))
    finally:
        for server in servers:
            stop_server(server)
    ratios = [b / a for a, b in zip(*rates, strict=True)]
    for name, side in (("A", 0), ("B", 1)):
        print(f"{name} {[args.a, args.b][side]!r}: median {statistics.median(rates[side]):.1f} tok/s "
              f"{[round(x) for x in rates[side]]}")
    print(f"B/A: median of paired ratios {statistics.median(ratios):.3f} (lowest {min(ratios):.3f}, "
          f"highest {max(ratios):.3f}, {len(ratios)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
