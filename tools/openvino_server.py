"""OpenVINO GenAI behind the OpenAI streaming API, so `llmaccel bench compare` measures it like every peer.

OpenVINO GenAI ships a continuous-batching engine (ContinuousBatchingPipeline: paged KV cache, a
scheduler that admits requests between steps) but no HTTP server of its own (OpenVINO Model Server
wraps the same pipeline). This script is that thin wrapper: one thread steps the pipeline while any
request runs, request threads only tokenize, queue and stream. It runs in OpenVINO's own venv (tools/peers.sh
--openvino builds it), imports nothing of llmaccel, and serves /health, /v1/models and streamed
/v1/chat/completions and /v1/completions with `max_tokens`, `ignore_eos` and greedy decoding: what the
benchmarks send. Not part of llmaccel.

    python tools/openvino_server.py --model OV_DIR --port 8001 [--threads 2] [--cache-gb 2]
        [--max-num-batched-tokens 256]
"""

from __future__ import annotations

import argparse
import itertools
import json
import queue
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import openvino as ov
import openvino_genai as ov_genai
from transformers import AutoTokenizer


class Engine:
    """Steps the pipeline on one thread and hands each request its new token ids."""

    def __init__(self, model_dir: str, threads: int, cache_gb: int, max_seqs: int, max_batched_tokens: int) -> None:
        scheduler = ov_genai.SchedulerConfig()
        scheduler.cache_size = cache_gb
        scheduler.max_num_seqs = max_seqs
        scheduler.max_num_batched_tokens = max_batched_tokens
        scheduler.dynamic_split_fuse = True
        scheduler.enable_prefix_caching = False
        self.pipe = ov_genai.ContinuousBatchingPipeline(model_dir, scheduler, "CPU",
                                                        {"INFERENCE_NUM_THREADS": threads})
        self.ids = itertools.count()
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.running: dict[int, tuple[object, queue.Queue]] = {}
        threading.Thread(target=self._loop, daemon=True).start()

    def submit(self, token_ids: list[int], max_tokens: int, ignore_eos: bool) -> queue.Queue:
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = max_tokens
        config.ignore_eos = ignore_eos
        out: queue.Queue = queue.Queue()
        with self.lock:
            request_id = next(self.ids)
            handle = self.pipe.add_request(request_id, ov.Tensor(np.array([token_ids], dtype=np.int64)), config)
            self.running[request_id] = (handle, out)
        self.wake.set()
        return out

    def _loop(self) -> None:
        while True:
            self.wake.wait()
            self.wake.clear()
            while self.pipe.has_non_finished_requests():
                self.pipe.step()
                with self.lock:
                    for request_id, (handle, out) in list(self.running.items()):
                        while handle.can_read():
                            for output in handle.read().values():
                                out.put(list(output.generated_ids))
                        if handle.get_status() != ov_genai.GenerationStatus.RUNNING and not handle.can_read():
                            out.put(None)
                            del self.running[request_id]


def make_handler(engine: Engine, tokenizer, name: str):
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args) -> None:  # quiet: the benchmark sends thousands of requests
            pass

        def _json(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._json(200, {"status": "ok"})
            elif self.path == "/v1/models":
                self._json(200, {"object": "list", "data": [{"id": name, "object": "model"}]})
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))))
            chat = self.path == "/v1/chat/completions"
            if chat:
                text = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True, tokenize=False)
                ids = tokenizer.encode(text, add_special_tokens=False)
            elif self.path == "/v1/completions":
                ids = tokenizer.encode(body["prompt"])
            else:
                self._json(404, {"error": {"message": f"no route {self.path}"}})
                return
            out = engine.submit(ids, int(body.get("max_tokens") or 16), bool(body.get("ignore_eos")))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            generated: list[int] = []
            sent = ""
            while (new := out.get()) is not None:
                generated += new
                text = tokenizer.decode(generated, skip_special_tokens=True)
                if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
                    continue
                piece, sent = text[len(sent):], text
                choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
                self._event({"object": "chat.completion.chunk" if chat else "text_completion", "choices": [choice]})
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(generated),
                     "total_tokens": len(ids) + len(generated)}
            self._event({"choices": [], "usage": usage})
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

        def _event(self, body: dict) -> None:
            self._chunk(b"data: " + json.dumps(body).encode() + b"\n\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
            self.wfile.flush()

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="a directory `optimum-cli export openvino` wrote")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="port to listen on")
    parser.add_argument("--threads", type=int, default=2, help="OpenVINO inference threads (INFERENCE_NUM_THREADS)")
    parser.add_argument("--cache-gb", type=int, default=2, help="KV cache size in GB (SchedulerConfig.cache_size)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="sequences the scheduler runs at once")
    parser.add_argument("--max-num-batched-tokens", type=int, default=256,
                        help="tokens a step at most (a long prompt's prefill chunk); 256 is OpenVINO GenAI's default")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    engine = Engine(args.model, args.threads, args.cache_gb, args.max_num_seqs, args.max_num_batched_tokens)
    ThreadingHTTPServer.request_queue_size = 256  # listen backlog: 64 clients connect at once (the default is 5)
    server = ThreadingHTTPServer((args.host, args.port), make_handler(engine, tokenizer, args.model))
    server.daemon_threads = True
    server.serve_forever()


if __name__ == "__main__":
    main()
