"""`llmaccel bench serve`: a load generator for any OpenAI-compatible server (llmaccel, vLLM,
llama.cpp's server, ...), reporting what vLLM's `bench serve` reports.

Requests are streamed and timestamped chunk by chunk. Arrivals follow a Poisson process at
--request-rate (a gamma process with --burstiness != 1), optionally capped at --max-concurrency
requests in flight. A request that fails (connection error, HTTP 4xx/5xx, an error event in the
stream) is counted as failed with its error kept; the run always ends with a report.

The client is aiohttp, as in vLLM's benchmark: on a small machine the client shares the cores with
the server it measures, and httpx's streaming took ~0.5 ms of CPU a chunk against aiohttp's ~0.2
(2 cores), time taken from the server under test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from llmaccel.bench import datasets
from llmaccel.bench.serve_metrics import RequestResult, compute_metrics, parse_goodput, parse_percentiles


def add_arguments(parser: argparse.ArgumentParser, sweep: bool = False) -> None:
    parser.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", help="model name to send (default: the first one the server's /v1/models lists)")
    parser.add_argument("--tokenizer", default=None,
                        help="model alias, GGUF file or HF directory whose tokenizer counts tokens (default: "
                             "--model if llmaccel can load it, else smollm2-135m)")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="/v1/chat/completions (prompts go through the chat template) or /v1/completions")
    parser.add_argument("--dataset", choices=datasets.DATASETS, default="builtin", help="where prompts come from")
    parser.add_argument("--dataset-path", type=Path, help="the ShareGPT JSON file for --dataset sharegpt")
    parser.add_argument("--num-prompts", type=int, default=64, help="how many requests to send")
    parser.add_argument("--input-len", type=int, default=128, help="prompt tokens for --dataset random")
    parser.add_argument("--output-len", type=int,
                        help="tokens to ask for per request (default: the dataset's own lengths; 128 for random)")
    parser.add_argument("--range-ratio", type=float, default=0.0, help="--dataset random: lengths vary +-this share")
    if not sweep:
        parser.add_argument("--request-rate", type=float, default=float("inf"),
                            help="requests per second (Poisson arrivals); inf sends all at once")
        parser.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="gamma shape of the arrival process: 1 is Poisson, < 1 burstier, > 1 steadier")
    parser.add_argument("--ignore-eos", action="store_true", help="ask the server to generate every requested token")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature of every request")
    parser.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                        help='fields merged into every request body, e.g. \'{"logit_bias": {"2": -100}}\' to ban '
                             "EOS on a server without ignore_eos")
    parser.add_argument("--goodput", nargs="+", metavar="NAME:MS",
                        help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:10000 (milliseconds)")
    parser.add_argument("--percentiles", default="50,90,99", help="latency percentiles to report")
    parser.add_argument("--api-key", help="Bearer token for the server")
    parser.add_argument("--seed", type=int, default=0, help="seed for dataset sampling and arrivals")
    parser.add_argument("--label", help="name of this server in reports and plots (default: the model name)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    if not sweep:
        parser.add_argument("--result-json", type=Path, help="write the figures and per-request data here")
        parser.add_argument("--no-progress", action="store_true", help="no progress bar")


def load_tokenizer(name: str):
    from llmaccel.model.loader import load_tokenizer as load
    from llmaccel.model.loader import model_files_dir

    return load(model_files_dir(name))  # (a GGUF file's tokenizer from its metadata: no weights converted)


def benchmark_args(url: str, label: str, *flags: str) -> argparse.Namespace:
    """bench serve's own arguments and defaults for one server, as its command line would parse them
    (EOS ignored, an hour's timeout, then `flags`): for the commands that run it from code, so they
    all measure alike."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--base-url", url, "--label", label, "--ignore-eos", "--timeout", "3600", *flags])


def sample_requests(args: argparse.Namespace, tokenizer) -> list[datasets.SampleRequest]:
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be >= 1")
    if args.dataset == "builtin":
        return datasets.builtin_requests(tokenizer, args.num_prompts, args.output_len)
    if args.dataset == "chinese":
        return datasets.chinese_requests(tokenizer, args.num_prompts, args.output_len, args.seed)
    if args.dataset == "sharegpt":
        if args.dataset_path is None:
            raise ValueError("--dataset sharegpt needs --dataset-path FILE.json")
        return datasets.sharegpt_requests(args.dataset_path, tokenizer, args.num_prompts, args.output_len, args.seed)
    return datasets.random_requests(tokenizer, args.num_prompts, args.input_len, args.output_len or 128,
                                    args.range_ratio, args.seed)


async def send_request(session: aiohttp.ClientSession, url: str, body: dict, prompt_len: int, tokenizer,
                       ) -> RequestResult:
    """POST one streaming request and time every content chunk."""
    result = RequestResult(prompt_len=prompt_len)
    text, usage = [], None
    start = last = time.perf_counter()
    result.start_time = time.time()
    try:
        async with session.post(url, json=body) as response:
            if response.status != 200:
                result.error = f"HTTP {response.status}: {_error_message(await response.text())}"
                return result
            async for line in response.content:  # one SSE line at a time
                if not line.startswith(b"data:"):
                    continue
                data = line[5:].strip()
                if data == b"[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = f"error event: {chunk['error'].get('message', chunk['error'])}"
                    return result
                usage = chunk.get("usage") or usage
                piece = "".join((c.get("delta") or {}).get("content") or c.get("text") or ""
                                for c in chunk.get("choices") or [])
                if piece:
                    now = time.perf_counter()
                    if not text:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    last = now
                    text.append(piece)
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError) as exc:  # ValueError: bad JSON
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.latency = time.perf_counter() - start
    result.generated_text = "".join(text)
    if usage and usage.get("completion_tokens") is not None:
        result.output_len = usage["completion_tokens"]
        result.prompt_len = usage.get("prompt_tokens") or prompt_len
        result.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    else:
        result.output_len = len(tokenizer.encode(result.generated_text, add_special_tokens=False))
    result.success = bool(text) or result.output_len == 0
    if not result.success:
        result.error = "the stream ended without any content"
    return result


def _error_message(body: str) -> str:
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:300]


def _body(args: argparse.Namespace, model: str, request: datasets.SampleRequest) -> dict:
    body: dict = {"model": model, "max_tokens": request.expected_output_len, "temperature": args.temperature,
                  "stream": True, "stream_options": {"include_usage": True}}
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": request.prompt}]
    else:
        body["prompt"] = request.prompt
    if args.ignore_eos:
        body["ignore_eos"] = True
    body.update(getattr(args, "extra_body", None) or {})
    return body


async def discover_model(session: aiohttp.ClientSession, base_url: str) -> str:
    try:
        async with session.get(base_url + "/v1/models") as response:
            return (await response.json(content_type=None))["data"][0]["id"]
    except (TimeoutError, aiohttp.ClientError, OSError, ValueError, KeyError, IndexError) as exc:
        raise ValueError(f"could not list the models of {base_url} ({exc}); give --model") from None


async def run_benchmark(args: argparse.Namespace, requests: list[datasets.SampleRequest], tokenizer,
                        request_rate: float, max_concurrency: int | None, progress: bool = True) -> dict:
    """Send every request, then return the summary figures plus per-request data."""
    base_url = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    connector = aiohttp.TCPConnector(limit=max_concurrency or len(requests), limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=args.timeout, connect=10)
    # read_bufsize: an SSE line (a chunk with logprobs) may be longer than aiohttp's 64 KiB default
    async with aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers,
                                     read_bufsize=2**20) as client:
        model = args.model or await discover_model(client, base_url)
        url = base_url + ("/v1/chat/completions" if args.endpoint == "chat" else "/v1/completions")
        gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), desc=f"bench {args.label or model}", unit="req", disable=not progress)
        rng = np.random.default_rng(args.seed)

        async def one(request: datasets.SampleRequest) -> RequestResult:
            if gate is None:
                result = await send_request(client, url, _body(args, model, request), request.prompt_len, tokenizer)
            else:
                async with gate:
                    result = await send_request(client, url, _body(args, model, request), request.prompt_len,
                                                tokenizer)
            bar.update(1)
            return result

        tasks = []
        start = time.perf_counter()
        for request in requests:
            tasks.append(asyncio.create_task(one(request)))
            if request_rate != float("inf"):
                await asyncio.sleep(rng.gamma(args.burstiness, 1.0 / (request_rate * args.burstiness)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    percentiles = parse_percentiles(args.percentiles)
    summary = compute_metrics(results, duration, percentiles, parse_goodput(args.goodput))
    return {
        "label": args.label or model, "model": model, "base_url": base_url, "endpoint": args.endpoint,
        "dataset": args.dataset, "num_prompts": len(requests), "request_rate": request_rate,
        "burstiness": args.burstiness, "max_concurrency": max_concurrency, "percentiles": percentiles,
        "goodput_slos_ms": parse_goodput(args.goodput),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        **summary,
        "input_lens": [r.prompt_len for r in results], "output_lens": [r.output_len for r in results],
        "ttfts": [r.ttft for r in results], "e2els": [r.latency for r in results], "itls": [r.itl for r in results],
        "errors": [r.error for r in results],
    }


def format_report(result: dict) -> str:
    """vLLM's report layout."""
    lines = ["{s:{c}^60}".format(s=" Serving Benchmark Result ", c="=")]

    def row(name: str, value: object) -> None:
        lines.append(f"{name:<44}{value:>16.2f}" if isinstance(value, float) else f"{name:<44}{value!s:>16}")

    row("Successful requests:", result["completed"])
    row("Failed requests:", result["failed"])
    row("Request rate (req/s):", result["request_rate"])
    row("Max concurrency:", result["max_concurrency"] or "none")
    row("Benchmark duration (s):", result["duration_s"])
    row("Total input tokens:", result["total_input_tokens"])
    row("Total generated tokens:", result["total_output_tokens"])
    row("Request throughput (req/s):", result["request_throughput"])
    if "request_goodput" in result:
        row("Request goodput (req/s):", result["request_goodput"])
    row("Output token throughput (tok/s):", result["output_throughput"])
    row("Total token throughput (tok/s):", result["total_token_throughput"])
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}
    for name, title in titles.items():
        lines.append("{s:{c}^60}".format(s=f" {title} ", c="-"))
        row(f"Mean {name.upper()} (ms):", result[f"mean_{name}_ms"])
        row(f"Median {name.upper()} (ms):", result[f"median_{name}_ms"])
        row(f"Std {name.upper()} (ms):", result[f"std_{name}_ms"])
        for p in result["percentiles"]:
            row(f"P{p:g} {name.upper()} (ms):", result[f"p{p:g}_{name}_ms"])
    errors = Counter(e for e in result["errors"] if e)
    if errors:
        lines.append("{s:{c}^60}".format(s=" Errors ", c="-"))
        lines.extend(f"{count} x {error}" for error, count in errors.most_common(10))
    lines.append("=" * 60)
    return "\n".join(lines)


def tokenizer_for(args: argparse.Namespace):
    name = args.tokenizer or args.model or "smollm2-135m"
    try:
        return load_tokenizer(name)
    except ValueError:
        if args.tokenizer:
            raise
        print(f"note: llmaccel cannot load {name!r}; counting tokens with smollm2-135m's tokenizer where the "
              "server reports no usage (give --tokenizer to change)", file=sys.stderr)
        return load_tokenizer("smollm2-135m")


def run(args: argparse.Namespace) -> int:
    tokenizer = tokenizer_for(args)
    requests = sample_requests(args, tokenizer)
    result = asyncio.run(run_benchmark(args, requests, tokenizer, args.request_rate, args.max_concurrency,
                                       progress=not args.no_progress))
    print(format_report(result))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.result_json}")
    return 0
