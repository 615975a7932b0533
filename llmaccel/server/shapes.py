"""A response's pieces in the OpenAI API's shapes: logprobs (chat's and the legacy completions'), stream
chunks, a completion's choice with its echo and prompt logprobs (server/echo.py).

Stream chunks are built as the dicts that ChatCompletionChunk / CompletionResponse dump to (same keys,
same order, so the same bytes): the pydantic models and their dump cost ~25 us a chunk, a fifth of the
event loop's time with 64 streams (tests/test_server_openai.py checks the shapes).
"""

from __future__ import annotations

from llmaccel.engine.detokenizer import token_bytes_function
from llmaccel.outputs import CompletionOutput, Logprob, RequestOutput
from llmaccel.server import echo
from llmaccel.server.job import Job
from llmaccel.server.response_models import ChatLogprobs, CompletionChoice, CompletionLogprobs, TokenLogprob, TopLogprob


class Shapes:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.token_bytes = token_bytes_function(tokenizer)

    def completion_choice(self, job: Job, i: int, index: int, c: CompletionOutput,
                          output: RequestOutput) -> CompletionChoice:
        text, logprobs = c.text, self.completion_logprobs(c.logprobs or [], job)
        if job.request.echo:
            text = echo.prompt_text(self, job, i) + text
            if logprobs is not None:
                logprobs = echo.joined(echo.echo_logprobs(self, job, i, output.prompt_logprobs), logprobs)
        prompt_logprobs = echo.prompt_logprobs_field(self, output.prompt_logprobs) \
            if job.request.prompt_logprobs is not None else None
        return CompletionChoice(index=index, text=text, finish_reason=c.finish_reason, logprobs=logprobs,
                                prompt_logprobs=prompt_logprobs)

    def chunk(self, job: Job, choices: list[dict]) -> dict:
        return {"id": job.response_id, "object": "chat.completion.chunk" if job.is_chat else "text_completion",
                "created": job.created, "model": job.model, "choices": choices, "usage": None,
                "system_fingerprint": None}

    def chunk_choice(self, job: Job, index: int, c: CompletionOutput, new_logprobs: list[Logprob]) -> dict:
        if job.is_chat:
            logprobs = self.chat_logprobs(new_logprobs, job) if new_logprobs else None
            content = c.delta_text if c.delta_text or not c.finish_reason else None
            return {"index": index, "delta": {} if content is None else {"content": content},
                    "logprobs": None if logprobs is None else logprobs.model_dump(), "finish_reason": c.finish_reason}
        logprobs = self.completion_logprobs(new_logprobs, job) if new_logprobs else None
        return {"index": index, "text": c.delta_text, "logprobs": None if logprobs is None else logprobs.model_dump(),
                "finish_reason": c.finish_reason}

    def echo_chunk_choice(self, job: Job, i: int, index: int, output: RequestOutput) -> dict:
        """An echoed choice's first chunk: its prompt (and the prompt's logprobs, when asked)."""
        logprobs = echo.echo_logprobs(self, job, i, output.prompt_logprobs) if job.request.num_logprobs is not None \
            else None
        return {"index": index, "text": echo.prompt_text(self, job, i),
                "logprobs": None if logprobs is None else logprobs.model_dump(), "finish_reason": None}

    def chat_logprobs(self, logprobs: list[Logprob], job: Job) -> ChatLogprobs | None:
        if job.request.num_logprobs is None:
            return None

        def entry(token_id: int, logprob: float) -> dict:
            raw = self.token_bytes(token_id)
            return {"token": raw.decode("utf-8", errors="replace"), "logprob": logprob, "bytes": list(raw)}

        return ChatLogprobs(content=[
            TokenLogprob(**entry(lp.token_id, lp.logprob),
                         top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top.items()])
            for lp in logprobs])

    def token_text(self, token_id: int) -> str:
        return self.token_bytes(token_id).decode("utf-8", errors="replace")

    def completion_logprobs(self, logprobs: list[Logprob], job: Job) -> CompletionLogprobs | None:
        if job.request.num_logprobs is None:
            return None
        return self.completion_entries([(lp.token_id, lp) for lp in logprobs])

    def completion_entries(self, entries: list[tuple[int, Logprob | None]]) -> CompletionLogprobs:
        """Legacy completions' logprobs of these tokens; a token without a Logprob (an echoed prompt's
        first) gets nulls."""
        out = CompletionLogprobs()
        offset = 0
        for token, lp in entries:
            text = self.token_text(token)
            out.tokens.append(text)
            out.token_logprobs.append(lp.logprob if lp is not None else None)
            top: dict[str, float] | None = None
            if lp is not None:
                top = {}
                for token_id, value in lp.top.items():  # most likely first; pieces that read alike keep the first
                    top.setdefault(self.token_text(token_id), value)
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(text)
        return out
