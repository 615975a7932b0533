"""`llmaccel chat`: an interactive terminal chat that streams each reply and keeps the conversation.

With `--url` it talks to a running OpenAI-compatible server (llmaccel, vLLM, llama.cpp...); otherwise
it loads `--model` in this process. Type /reset to start over, /exit (or Ctrl-D) to leave.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Iterator

Messages = list[dict[str, str]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", help="base URL of a running server, e.g. http://127.0.0.1:8000 (default: load "
                                      "--model in this process)")
    parser.add_argument("--api-key", help="Bearer token for --url")
    parser.add_argument("--system", help="system prompt (default: the chat template's own)")
    parser.add_argument("--temperature", type=float, default=0.7, help="sampling temperature (0 is greedy)")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--max-tokens", type=int, default=512, help="most tokens per reply")
    parser.add_argument("--seed", type=int, help="seed for reproducible replies")


def _local_replier(args: argparse.Namespace, engine_options: dict) -> Callable[[Messages], Iterator[str]]:
    from llmaccel.config import DEFAULT_MODEL
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    llm = LLM(args.model or DEFAULT_MODEL, **engine_options)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens,
                            seed=args.seed)

    def reply(messages: Messages) -> Iterator[str]:
        engine = llm.engine
        request_id = engine.add_request(None, llm.apply_chat_template(messages), params)
        try:
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id == request_id:
                        yield output.outputs[0].delta_text
        finally:
            engine.abort_request(request_id)  # Ctrl-C mid-reply: free its blocks

    return reply


def _remote_replier(args: argparse.Namespace) -> Callable[[Messages], Iterator[str]]:
    import httpx

    base = args.url.rstrip("/")
    base = base if base.endswith("/v1") else base + "/v1"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpx.Client(timeout=httpx.Timeout(10.0, read=None), headers=headers)
    model = args.model  # None: the server's own model

    def reply(messages: Messages) -> Iterator[str]:
        body = {"messages": messages, "stream": True, "temperature": args.temperature, "top_p": args.top_p,
                "max_tokens": args.max_tokens}
        if model:
            body["model"] = model
        if args.seed is not None:
            body["seed"] = args.seed
        with client.stream("POST", f"{base}/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                try:
                    message = response.json()["error"]["message"]
                except (ValueError, KeyError, TypeError):
                    message = response.text
                raise ValueError(f"the server answered {response.status_code}: {message}")
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise ValueError(f"the server stopped the reply: {chunk['error']['message']}")
                for choice in chunk.get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""

    return reply


def run(args: argparse.Namespace, engine_options: dict) -> int:
    reply = _remote_replier(args) if args.url else _local_replier(args, engine_options)
    messages: Messages = [{"role": "system", "content": args.system}] if args.system else []
    print("llmaccel chat: /reset starts over, /exit or Ctrl-D leaves.", file=sys.stderr)
    while True:
        try:
            text = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            del messages[1 if args.system else 0:]
            print("(conversation cleared)", file=sys.stderr)
            continue
        if not text:
            continue
        messages.append({"role": "user", "content": text})
        pieces = []
        print("assistant> ", end="", flush=True)
        try:
            for piece in reply(messages):
                pieces.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            print(" [interrupted]", end="")
        print()
        messages.append({"role": "assistant", "content": "".join(pieces)})
