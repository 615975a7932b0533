"""What serving over HTTP costs: the same chat prompts through `LLM.chat` (offline, in-process) and
through a live `llmaccel serve` (all requests at once, streamed and not), alternated in one run.

    .venv/bin/python tools/served_vs_offline.py --num-prompts 64 --output-len 128 --repeat 2

Each offline run is its own process, as is the server, so neither sees the other's threads. This is
an interim check of the server's overhead; `llmaccel bench serve` is the load benchmark.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from llmaccel.bench.servers import free_port, start_server

OFFLINE = """
import sys, time
from llmaccel import LLM, SamplingParams
from llmaccel.data.prompts import builtin_prompts
n, out = int(sys.argv[1]), int(sys.argv[2])
llm = LLM()
conv = [[{"role": "user", "content": p.prompt}] for p in builtin_prompts()[:n]]
llm.chat(conv[:2], SamplingParams(max_tokens=2))
start = time.perf_counter()
outs = llm.chat(conv, SamplingParams(temperature=0, max_tokens=out, ignore_eos=True))
print(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start))
"""


def offline(num_prompts: int, output_len: int) -> float:
    done = subprocess.run([sys.executable, "-c", OFFLINE, str(num_prompts), str(output_len)], capture_output=True,
                          text=True, check=True)
    return float(done.stdout.split()[-1])


async def served(url: str, prompts: list[str], output_len: int, stream: bool) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        async def one(prompt: str) -> int:
            body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": output_len,
                    "temperature": 0, "ignore_eos": True, "stream": stream}
            if not stream:
                response = await client.post(url + "/v1/chat/completions", json=body)
                return response.json()["usage"]["completion_tokens"]
            body["stream_options"] = {"include_usage": True}
            tokens = 0
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {") and '"usage":{' in line:
                        tokens = json.loads(line[6:])["usage"]["completion_tokens"]
            return tokens

        await one("warm up")
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(p) for p in prompts))
        return sum(tokens) / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int, default=64, help="chat prompts from the built-in set")
    parser.add_argument("--output-len", type=int, default=128, help="tokens generated per prompt (EOS ignored)")
    parser.add_argument("--repeat", type=int, default=2, help="rounds of (streamed, non-streamed, offline)")
    args = parser.parse_args()
    from llmaccel.data.prompts import builtin_prompts

    prompts = [p.prompt for p in builtin_prompts()[:args.num_prompts]]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server([sys.executable, "-m", "llmaccel.cli", "serve", "--no-result-cache"], port,
                          Path(tempfile.mkdtemp(prefix="served-vs-offline-")) / "serve.log")
    try:
        rows = []
        for _ in range(args.repeat):  # the server idles while offline runs, and the other way round
            streamed = asyncio.run(served(url, prompts, args.output_len, stream=True))
            plain = asyncio.run(served(url, prompts, args.output_len, stream=False))
            base = offline(args.num_prompts, args.output_len)
            rows.append((base, streamed, plain))
            print(f"offline {base:6.1f} tok/s   served+streamed {streamed:6.1f} ({streamed / base:.3f})   "
                  f"served {plain:6.1f} ({plain / base:.3f})", flush=True)
    finally:
        server.terminate()
        server.wait(60)
    print(f"median ratio: streamed {statistics.median(r[1] / r[0] for r in rows):.3f}, "
          f"non-streamed {statistics.median(r[2] / r[0] for r in rows):.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
