"""The web page on a real `llmaccel serve`: screenshots of its three views for the docs, and what an
open dashboard costs the server.

    .venv/bin/python tools/ui_pages.py screenshots --out docs/img
    .venv/bin/python tools/ui_pages.py overhead --rounds 8 --output-len 256 \
        --result-json docs/results/issue19/ui-overhead-zen5.json

Both drive Debian's headless Chromium through tests/browser.py, as the browser tests do.
`overhead` runs `bench serve` at concurrency 64 against one server in four arms per round: no page
open, twice (the second arm shows what noise alone does to a ratio); the stats endpoint polled once a
second by a plain client (a dashboard open on another machine); and the dashboard open in Chromium on
this machine, polling and drawing (its rendering shares the server's cores). It reports medians and
each arm's ratio to no page, also paired by round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402

from llmaccel.bench.paired import markdown_table, paired_summary, rotated  # noqa: E402
from llmaccel.bench.servers import free_port, start_server, stop_server  # noqa: E402
from llmaccel.platform import describe  # noqa: E402
from tests.browser import headless_chromium  # noqa: E402
from tests.live_server import wait_until  # noqa: E402


def serve(model: str, log: Path, *flags: str):
    port = free_port()
    command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", model, "--port", str(port),
               "--no-result-cache", *flags]
    return start_server(command, port, log, timeout=600), f"http://127.0.0.1:{port}"


def bench(url: str, model: str, concurrency: int, prompts: int, output_len: int, label: str) -> dict:
    from llmaccel.bench.serve import benchmark_args, run_benchmark, sample_requests, tokenizer_for

    args = benchmark_args(url, label, "--model", model, "--num-prompts", str(prompts), "--output-len", str(output_len))
    tokenizer = tokenizer_for(args)
    requests = sample_requests(args, tokenizer)
    return asyncio.run(run_benchmark(args, requests, tokenizer, float("inf"), concurrency, progress=False))


def screenshots(args: argparse.Namespace) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        results = Path(tmp) / "results"
        results.mkdir()
        proc, url = serve(args.model, Path(tmp) / "serve.log", "--ui-results-dir", str(results))
        try:
            int8, int8_url = serve(args.model, Path(tmp) / "serve-int8.log", "--quantization", "int8")
            try:  # two small sweeps for the Benchmarks view, overlaid: the served dtype and int8 weights
                for label, target in (("llmaccel", url), ("llmaccel int8", int8_url)):
                    for c in (1, 4, 16):
                        result = bench(target, args.model, c, max(8, 2 * c), 64, label)
                        (results / f"{label.replace(' ', '-')}-c{c}.json").write_text(json.dumps(result))
            finally:
                stop_server(int8)
            with headless_chromium(1280, 1000) as driver:
                driver.get(url + "/ui")
                wait_until(lambda: "KV blocks" in driver.find_element(By.ID, "engine-summary").text, 30, "summary")
                driver.find_element(By.ID, "message").send_keys("Explain in two sentences what a KV cache is.")
                driver.find_element(By.ID, "send").click()
                wait_until(lambda: driver.find_elements(By.CSS_SELECTOR, "li.assistant .meta") and
                           driver.find_element(By.CSS_SELECTOR, "li.assistant .meta").text, 120, "the answer")
                driver.save_screenshot(str(args.out / "ui-playground.png"))
                driver.get(url + "/ui#dashboard")
                time.sleep(3)  # a few quiet polls before the load, so the charts show it arrive
                load = threading.Thread(target=bench, args=(url, args.model, 32, 192, 128, "load"))
                load.start()
                time.sleep(15)  # the load runs ~30 s: the picture is taken in the middle of it
                driver.save_screenshot(str(args.out / "ui-dashboard.png"))
                load.join()
                driver.get(url + "/ui#benchmarks")
                wait_until(lambda: driver.find_element(By.ID, "bench-dir").is_displayed(), 10, "the list")
                driver.execute_script("for (const o of document.getElementById('bench-dir-list').options) "
                                      "o.selected = true")
                driver.find_element(By.ID, "bench-dir-load").click()
                wait_until(lambda: len(driver.find_elements(By.CSS_SELECTOR, "#bench-table tbody tr")) == 6, 10,
                           "the table")
                driver.save_screenshot(str(args.out / "ui-benchmarks.png"))
        finally:
            stop_server(proc)
    print(f"wrote {args.out}/ui-playground.png, ui-dashboard.png, ui-benchmarks.png")
    return 0


ARMS = ("no page", "no page again", "stats polled", "dashboard open")  # the second: what noise alone gives


class StatsPoller:
    """What a dashboard on another machine asks of the server: GET /v1/llmaccel/stats once a second."""

    def __init__(self, url: str) -> None:
        self.url, self.polls, self._stop = url, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self._stop.wait(1.0):
                client.get(self.url + "/v1/llmaccel/stats").raise_for_status()
                self.polls += 1

    def __enter__(self) -> StatsPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def one_arm(arm: str, url: str, driver, args: argparse.Namespace) -> tuple[float, int]:
    """(output tok/s of bench serve at concurrency 64, polls made) with the page in state `arm`."""
    driver.get(url + "/ui#dashboard" if arm == "dashboard open" else "about:blank")
    if arm == "stats polled":
        with StatsPoller(url) as poller:
            result = bench(url, args.model, 64, 64, args.output_len, arm)
        return result["output_throughput"], poller.polls
    result = bench(url, args.model, 64, 64, args.output_len, arm)
    polls = driver.execute_script("return state.history.length") if arm == "dashboard open" else 0
    return result["output_throughput"], polls


def overhead(args: argparse.Namespace) -> int:
    """Rounds of the four arms, the order rotated each round so no arm always follows another."""
    runs: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        proc, url = serve(args.model, Path(tmp) / "serve.log")
        try:
            bench(url, args.model, 64, 64, 32, "warm-up")
            with headless_chromium() as driver:
                for round_index in range(args.rounds):
                    for arm in rotated(ARMS, round_index):
                        tokens_per_s, polls = one_arm(arm, url, driver, args)
                        runs[arm].append(tokens_per_s)
                        print(f"round {round_index + 1} {arm}: {tokens_per_s:.1f} tok/s ({polls} polls)",
                              file=sys.stderr)
        finally:
            stop_server(proc)
    summary = paired_summary(runs, "no page")
    print(markdown_table(runs, summary, "no page", "output tok/s"))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "machine": describe(), "model": args.model, "concurrency": 64, "num_prompts": 64,
            "output_len": args.output_len, "runs": runs, "against_no_page": summary}, indent=1))
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    sub = parser.add_subparsers(dest="what", required=True)
    shots = sub.add_parser("screenshots", help="the three views, as PNGs")
    shots.add_argument("--out", type=Path, default=Path("docs/img"), help="where the PNGs go")
    cost = sub.add_parser("overhead", help="bench serve at concurrency 64 with and without the dashboard open")
    cost.add_argument("--rounds", type=int, default=3, help="rounds of the four arms (order rotated)")
    cost.add_argument("--output-len", type=int, default=128, help="tokens per request (EOS ignored)")
    cost.add_argument("--result-json", type=Path, help="write the figures here")
    args = parser.parse_args()
    return screenshots(args) if args.what == "screenshots" else overhead(args)


if __name__ == "__main__":
    raise SystemExit(main())
