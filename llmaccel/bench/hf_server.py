"""The HF transformers baseline server for `bench compare`: a minimal OpenAI-compatible wrapper
around `model.generate`, one request at a time. It is the baseline llmaccel is measured against,
not part of the product path.

    llmaccel bench hf-server --model smollm2-135m --port 8001

It loads the same converted weights llmaccel loads (float32 on the CPU) and streams tokens as
`generate` produces them, so TTFT and ITL mean the same thing on both servers. All torch work runs
on one worker thread, as in llmaccel's server (a second OpenMP thread team costs ~10-15% here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8001, help="TCP port to listen on")


class _TokenStreamer:
    """Hands each new token id from the generate thread to the event loop (transformers' streamer
    protocol: `put` gets the prompt first, then each new token; `end` closes)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue) -> None:
        self.loop, self.queue, self.seen_prompt = loop, queue, False

    def put(self, value) -> None:
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        for token in value.flatten().tolist():
            self.loop.call_soon_threadsafe(self.queue.put_nowait, token)

    def end(self) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, None)


def create_app(model_name: str) -> FastAPI:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from llmaccel.model.loader import hf_dir_for, load_tokenizer

    hf_dir = hf_dir_for(model_name)
    tokenizer = load_tokenizer(hf_dir)
    worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-generate")  # every torch call runs here
    model = worker.submit(lambda: AutoModelForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
                          ).result()
    lock = asyncio.Lock()  # one request at a time: the baseline's defining property
    app = FastAPI(title="HF transformers baseline")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "owned_by": "hf-baseline"}]}

    async def generate(request: Request, chat: bool) -> object:
        body = await request.json()
        if chat:
            text = tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        else:
            prompt_ids = tokenizer.encode(body["prompt"])
        temperature = float(body.get("temperature", 1.0))
        config = GenerationConfig(max_new_tokens=int(body.get("max_tokens") or 16), do_sample=temperature > 0,
                                  temperature=temperature or None, top_p=body.get("top_p", 1.0),
                                  eos_token_id=None if body.get("ignore_eos") else model.generation_config.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id or 0)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[int | None] = asyncio.Queue()
        kind, prefix = ("chat.completion", "chatcmpl") if chat else ("text_completion", "cmpl")
        rid, created, name = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), body.get("model", model_name)

        async def tokens():
            async with lock:
                inputs = torch.tensor([prompt_ids])
                job = loop.run_in_executor(worker, lambda: model.generate(
                    inputs, attention_mask=torch.ones_like(inputs), generation_config=config,
                    streamer=_TokenStreamer(loop, queue)))
                while (token := await queue.get()) is not None:
                    yield token
                await job

        def envelope(choice: dict, usage: dict | None = None, chunk: bool = False) -> dict:
            return {"id": rid, "object": kind + (".chunk" if chunk and chat else ""), "created": created,
                    "model": name, "choices": [choice] if choice else [], "usage": usage}

        def usage(n: int) -> dict:
            return {"prompt_tokens": len(prompt_ids), "completion_tokens": n, "total_tokens": len(prompt_ids) + n}

        if not body.get("stream"):
            ids = [t async for t in tokens()]
            finish = "length" if len(ids) >= config.max_new_tokens else "stop"
            out = tokenizer.decode(ids, skip_special_tokens=True)
            choice = ({"index": 0, "message": {"role": "assistant", "content": out}, "finish_reason": finish} if chat
                      else {"index": 0, "text": out, "finish_reason": finish})
            return JSONResponse(envelope(choice, usage(len(ids))))

        async def events():
            ids, sent = [], ""
            async for token in tokens():
                ids.append(token)
                text = tokenizer.decode(ids, skip_special_tokens=True)
                if text.endswith("\ufffd") or len(text) <= len(sent):
                    continue
                delta, sent = text[len(sent):], text
                choice = {"index": 0, "delta": {"content": delta}} if chat else {"index": 0, "text": delta}
                yield f"data: {json.dumps(envelope(choice, chunk=True))}\n\n"
            finish = "length" if len(ids) >= config.max_new_tokens else "stop"
            last = {"index": 0, "delta": {}, "finish_reason": finish} if chat else {"index": 0, "text": "",
                                                                                   "finish_reason": finish}
            yield f"data: {json.dumps(envelope(last, chunk=True))}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps(envelope({}, usage(len(ids)), chunk=True))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> object:
        return await generate(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request) -> object:
        return await generate(request, chat=False)

    return app


def run(args: argparse.Namespace) -> int:
    import uvicorn

    uvicorn.run(create_app(args.model), host=args.host, port=args.port, log_level="warning")
    return 0
