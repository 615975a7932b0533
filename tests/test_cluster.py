"""`llmaccel serve --replicas`: engine replicas on a local Ray instance behind one OpenAI ingress.

Each server here is a real `llmaccel serve` process that starts Ray with this machine's cores, and
real replica processes; the official openai client talks to it. Bounded in time: every wait has a
deadline.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest

from llmaccel.bench.servers import free_port
from tests.live_server import MODEL_NAME, live_server, wait_until

SYSTEM = ("You are the assistant of a small bookshop. Answer in one short sentence and never invent "
          "titles, prices or opening hours that you were not told about.")


@contextmanager
def cluster_server(model_dir: Path, log: Path, *flags: str, timeout: float = 180):
    """A replicated server in its own session: teardown kills the whole process group (Ray's
    processes included) if SIGTERM did not stop it."""
    port = free_port()
    command = [sys.executable, "-m", "llmaccel.cli", "serve", "--model", str(model_dir), "--port", str(port),
               "--dtype", "float32", "--num-kv-blocks", "512", *flags]
    proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, timeout)
        yield url
    finally:
        stop_group(proc, signal.SIGTERM, 60)


def wait_healthy(proc: subprocess.Popen, url: str, log: Path, timeout: float) -> None:
    """Until /health answers 200; the log if the process exits or the time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert proc.poll() is None, f"the server exited; its log:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"the server did not come up; its log:\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def stop_group(proc: subprocess.Popen, sig: int, timeout: float) -> None:
    """`sig`, then the whole process group killed (Ray's processes included) whatever became of it."""
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def sse_chunks(response: httpx.Response):
    """The JSON of each `data:` event. Events end at a blank line; generated text may hold characters
    that str.splitlines (and so httpx's iter_lines) takes for line breaks, such as U+0085 or U+2028."""
    buffer = b""
    for piece in response.iter_bytes():
        buffer += piece
        *events, buffer = buffer.split(b"\n\n")
        for event in events:
            if event.startswith(b"data: {"):
                yield json.loads(event[6:])


def metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def replica_pids(url: str) -> dict[str, int]:
    """replica name -> process id, from the ingress's /metrics."""
    pids = {}
    for line in metrics(url).splitlines():
        if line.startswith("llmaccel_replica_info{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line))
            pids[labels["replica"]] = int(labels["pid"])
    return pids


def wait_for(condition, timeout: float, what: str):
    """wait_until, polling /metrics every half second (under load it is slow to answer)."""
    return wait_until(condition, timeout, what, interval=0.5)


def counter(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def two_replicas(llama_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("cluster") / "serve.log"
    with cluster_server(llama_dir, log, "--replicas", "2", "--max-num-seqs", "2") as url:
        wait_for(lambda: len(replica_pids(url)) == 2, 30, "both replicas to report")
        yield url, log


def test_the_openai_client_gets_the_engines_tokens_from_two_replicas(two_replicas, llama_dir):
    url, _ = two_replicas
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    prompts = ["The quick brown fox", "Once upon a time", "In the beginning", "A long time ago"]
    messages = [{"role": "user", "content": "Hello there"}]
    extra = {"ignore_eos": True, "result_cache": False}

    def answers(base: str, model: str) -> list[str]:
        """Every prompt non-streamed and streamed, and a chat both ways, one request after another."""
        c = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        out = []
        for prompt in prompts:
            out.append(c.completions.create(model=model, prompt=prompt, max_tokens=12, temperature=0,
                                            extra_body=extra).choices[0].text)
            out.append("".join(x.choices[0].text for x in c.completions.create(
                model=model, prompt=prompt, max_tokens=12, temperature=0, stream=True, extra_body=extra)
                if x.choices))
        out.append(c.chat.completions.create(model=model, messages=messages, max_tokens=10, temperature=0,
                                             extra_body=extra).choices[0].message.content)
        out.append("".join(x.choices[0].delta.content or "" for x in c.chat.completions.create(
            model=model, messages=messages, max_tokens=10, temperature=0, stream=True, extra_body=extra)
            if x.choices))
        return out

    with live_server(llama_dir) as single:  # the single-process server is the reference
        expected = answers(single.url, MODEL_NAME)
    assert answers(url, str(llama_dir)) == expected
    assert all(expected) and expected[0] == expected[1]
    with pytest.raises(openai.BadRequestError) as bad:  # checked at the ingress, as a single server does
        client.completions.create(model=str(llama_dir), prompt=[[999_999]], max_tokens=2)
    assert "vocabulary" in str(bad.value)
    sent = 2 * len(prompts) + 2
    wait_for(lambda: counter(metrics(url), "llmaccel_replica_requests_total") >= sent, 10,
             "the replicas' counts on /metrics (refreshed every second)")
    assert counter(metrics(url), "llmaccel_router_decisions_total", router="cache_aware") >= sent


def test_the_second_turn_reaches_the_first_turns_replica_and_hits_its_cache(two_replicas, llama_dir):
    url, _ = two_replicas
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    before = metrics(url)
    for topic in ("maps", "poetry", "cooking", "history"):  # four conversations, each of its own
        history = [{"role": "system", "content": f"{SYSTEM} Today's theme is {topic}."},
                   {"role": "user", "content": f"Do you have books about {topic}?"}]
        first = client.chat.completions.create(model=str(llama_dir), messages=history, max_tokens=16, temperature=0,
                                               extra_body={"result_cache": False})
        time.sleep(0.3)  # the replica publishes its new blocks every 100 ms
        history += [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "And which one would you pick?"}]
        second = client.chat.completions.create(model=str(llama_dir), messages=history, max_tokens=8,
                                                temperature=0, extra_body={"result_cache": False})
        full_blocks = first.usage.prompt_tokens // 16
        assert second.usage.prompt_tokens_details.cached_tokens >= (full_blocks - 1) * 16 > 0
    after = metrics(url)
    affinity = (counter(after, "llmaccel_router_decisions_total", reason="affinity")
                - counter(before, "llmaccel_router_decisions_total", reason="affinity"))
    assert affinity >= 4  # every second turn was routed for its prefix


def test_a_killed_replica_loses_no_request_that_had_not_started(tmp_path):
    """Two replicas of the default model, each running one request at a time (n=2 fills its two sequence
    slots for two seconds or so of decoding), 14 requests queued on them. One replica is killed while it holds
    queued requests and both replicas have just begun streaming one: its running answer ends with an error
    event, its queued ones are sent again to the other, and every request that had not started is served whole.

    The replicas are the bottleneck here, so the kill lands on work whatever the machine's speed (with the
    tiny model the ingress was: the replicas sat idle between requests and the victim, chosen from /metrics
    read seconds late, could hold nothing by the time it was killed)."""
    tokens_each, count = 128, 14
    first_chunk: dict[int, float] = {}  # request -> when its first chunk arrived
    finished: set[int] = set()
    lock = threading.Lock()

    def one(url: str, i: int) -> tuple[str, int]:
        body = {"prompt": f"Request number {i} says", "max_tokens": tokens_each, "n": 2, "ignore_eos": True,
                "stream": True, "result_cache": False, "stream_options": {"include_usage": True}}
        tokens, error = 0, None
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            for chunk in sse_chunks(response):
                if "error" in chunk:
                    error = chunk["error"]["message"]
                    continue
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
                with lock:
                    if chunk["choices"]:
                        first_chunk.setdefault(i, time.monotonic())
        with lock:
            finished.add(i)
        return ("error: " + error) if error else "ok", tokens

    def both_streaming() -> bool:
        """Two answers under way, both begun in the last second: a replica runs one request at a time, so
        they are one on each, and each has most of its tokens still to come."""
        now = time.monotonic()
        with lock:
            under_way = [t for i, t in first_chunk.items() if i not in finished]
        return len(under_way) == 2 and all(now - t < 1.0 for t in under_way)

    log = tmp_path / "serve.log"
    with cluster_server("smollm2-135m", log, "--replicas", "2", "--max-num-seqs", "2") as url:
        wait_for(lambda: len(replica_pids(url)) == 2, 30, "both replicas to report")
        pids = replica_pids(url)
        with concurrent.futures.ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(one, url, i) for i in range(count)]

            def queueing_replica() -> int | None:  # two requests or more queued (n=2: two sequences each)
                text = metrics(url)
                return next((pid for replica, pid in pids.items() if counter(
                    text, "llmaccel_replica_num_requests_waiting", replica=replica) >= 4), None)

            victim = wait_for(queueing_replica, 60, "a replica with requests queued")
            wait_until(both_streaming, 60, "both replicas to begin an answer", interval=0.01)
            os.kill(victim, signal.SIGKILL)
            killed_at = time.monotonic()
            results = [f.result(timeout=180) for f in futures]  # nothing hangs
        # not started: no chunk until well after the kill (a chunk sent just before it may still be on its way)
        not_started = [i for i in range(count) if first_chunk.get(i, float("inf")) > killed_at + 0.5]
        assert len(not_started) >= 3, sorted(round(t - killed_at, 2) for t in first_chunk.values())
        for i in not_started:  # queued on the dead replica, or on the other: all served whole
            assert results[i] == ("ok", 2 * tokens_each), (i, results[i])
        cut = [outcome for outcome, _ in results if outcome != "ok"]
        assert len(cut) == 1 and "stopped mid-answer" in cut[0], results  # the victim's running answer
        retries = counter(metrics(url), "llmaccel_router_retries_total")
        assert retries >= 1, log.read_text()[-3000:]  # its queued requests, sent again
        # Ray Serve replaces the replica; the cluster serves on
        wait_for(lambda: len(replica_pids(url)) == 2 and victim not in replica_pids(url).values(), 90,
                 "a replacement replica")
        done = httpx.post(url + "/v1/completions", json={"prompt": "Still there?", "max_tokens": 4}, timeout=60)
        assert done.status_code == 200


def test_replicas_sharing_a_disk_tier_read_each_others_blocks_and_route_by_them(llama_dir, tmp_path):
    """Two replicas with 24 blocks each and one write-through tier: eight 150-token prompts push each other out of
    both pools; sent again, each finds its 9 whole blocks (in a RAM, or on the disk either replica wrote) and gives
    the same tokens, and the router, knowing the tier, sends prompts no RAM holds by it."""
    import random

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(llama_dir)
    printable = [i for i in range(3, 300) if tokenizer.decode([i]).isprintable()]  # the ingress checks the text
    rng = random.Random(0)
    prompts = [[rng.choice(printable) for _ in range(150)] for _ in range(8)]
    flags = ("--replicas", "2", "--num-kv-blocks", "24", "--kv-offload-dir", str(tmp_path / "kv"),
             "--kv-offload-policy", "write-through")
    with cluster_server(llama_dir, tmp_path / "serve.log", *flags) as url:
        wait_for(lambda: len(replica_pids(url)) == 2, 30, "both replicas to report")
        rounds = []
        for _ in range(2):
            answers = []
            for prompt in prompts:
                body = {"model": str(llama_dir), "prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True, "result_cache": False}
                answer = httpx.post(url + "/v1/completions", json=body, timeout=120).json()
                assert "usage" in answer, answer
                cached = answer["usage"]["prompt_tokens_details"]["cached_tokens"]
                answers.append((answer["choices"][0]["text"], cached))
            rounds.append(answers)
            time.sleep(1.5)  # the replicas publish their blocks (the router read their stats at its first pick)
        text = metrics(url)
    assert [a for a, _ in rounds[1]] == [a for a, _ in rounds[0]]
    assert all(cached >= 144 for _, cached in rounds[1])
    assert counter(text, "llmaccel_router_decisions_total", reason="shared_tier") >= 1


def test_autoscaling_adds_a_replica_under_load_and_removes_it_after(llama_dir, tmp_path):
    flags = ("--replicas", "1", "--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "2",
             "--upscale-delay-s", "1", "--downscale-delay-s", "4", "--autoscale-window-s", "2", "--max-num-seqs", "2")
    with cluster_server(llama_dir, tmp_path / "serve.log", *flags) as url:
        wait_for(lambda: len(replica_pids(url)) == 1, 30, "the first replica to report")
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                httpx.post(url + "/v1/completions", json={"prompt": "Load", "max_tokens": 200, "ignore_eos": True,
                                                          "result_cache": False}, timeout=120)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            workers = [pool.submit(load) for _ in range(8)]
            try:
                wait_for(lambda: len(replica_pids(url)) == 2, 90, "a second replica under load")
            finally:
                stop.set()
            for w in workers:
                w.result(timeout=180)
        wait_for(lambda: len(replica_pids(url)) == 1, 90, "the extra replica to go once idle")


def test_a_replica_that_cannot_start_is_an_error_at_start(llama_dir, tmp_path):
    missing = subprocess.run([sys.executable, "-m", "llmaccel.cli", "serve", "--model", str(tmp_path / "nope"),
                              "--replicas", "2"], capture_output=True, text=True, timeout=120)
    assert missing.returncode != 0 and "nope" in missing.stderr and "Traceback" not in missing.stderr
    broken = tmp_path / "broken"
    shutil.copytree(llama_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "llmaccel.cli", "serve", "--model", str(broken), "--replicas", "1",
                             "--port", str(free_port())], capture_output=True, text=True, timeout=240,
                            start_new_session=True)
    assert result.returncode != 0
    assert "could not start" in result.stderr, result.stderr[-2000:]
    assert time.monotonic() - started < 200


def test_serve_run_with_a_config_file_serves_the_same_api(llama_dir, tmp_path):
    """Ray Serve's own tooling (`serve run`, KubeRay) runs the application, ingress included."""
    port = free_port()
    config = tmp_path / "serve.yaml"
    config.write_text(f"""proxy_location: HeadOnly
http_options: {{host: 127.0.0.1, port: {port}}}
applications:
  - name: llmaccel
    route_prefix: /
    import_path: llmaccel.cluster.deployment:build_app
    args: {{model: "{llama_dir}", replicas: 1, dtype: float32, num_kv_blocks: 256}}
""")
    log = tmp_path / "serve-run.log"
    proc = subprocess.Popen([str(Path(sys.executable).parent / "serve"), "run", str(config)], stdout=log.open("w"),
                            stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, log, 180)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=str(llama_dir), prompt="hello world", max_tokens=6, temperature=0,
                                         extra_body={"ignore_eos": True})
        streamed = client.completions.create(model=str(llama_dir), prompt="hello world", max_tokens=6, temperature=0,
                                             stream=True, extra_body={"ignore_eos": True, "result_cache": False})
        assert "".join(c.choices[0].text for c in streamed if c.choices) == done.choices[0].text
        assert done.usage.completion_tokens == 6
        wait_for(lambda: len(replica_pids(url)) == 1, 20, "the replica on the ingress's /metrics")
    finally:
        stop_group(proc, signal.SIGINT, 30)


def test_bench_multiturn_compares_routers_against_replicas(llama_dir, tmp_path):
    """`llmaccel bench multiturn --replicas 2`: every router's row from real servers, in one run."""
    out = tmp_path / "routers.json"
    result = subprocess.run([sys.executable, "-m", "llmaccel.cli", "bench", "multiturn", "--model", str(llama_dir),
                             "--replicas", "2", "--routers", "cache-aware,round-robin", "--conversations", "6",
                             "--turns", "3", "--reply-tokens", "8", "--kv-cache-memory", "8MiB",
                             "--result-json", str(out)], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = report["multiturn"]["rows"]
    assert set(rows) == {"cache-aware", "round-robin", "1 process"}
    for row in rows.values():
        assert row["prompt_tokens"] > 0 and 0 <= row["cached_tokens"] <= row["prompt_tokens"]
        assert len(row["per_turn"]) == 3 and row["output_tokens"] == 6 * 3 * 8
    assert sum(rows["cache-aware"]["requests_per_replica"]) == 18  # every request, counted by the replicas
    assert set(report["multiturn"]["projection"]) == {"2", "8", "64", "512"}
    assert "| cache-aware |" in result.stdout and "round-robin" in result.stdout
