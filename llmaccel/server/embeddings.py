"""`POST /v1/embeddings`, with OpenAI's request and response shapes.

Each input (a string, a list of strings, a list of token ids or a list of them) becomes an engine request
that runs its prompt and no more (SamplingParams.pooling): it is scheduled and batched with the generation
traffic, and its final hidden states are pooled (the last token's, or the mean; --pooling) and L2-normalized.
`encoding_format` "base64" is the float32 little-endian bytes, as the official client decodes them (it asks
for base64 by default). `dimensions` is refused unless it is the model's own width: the vectors are not
trained to be cut short. Embeddings count against the client's rate limits as chats do (their prompt tokens).
"""

from __future__ import annotations

import asyncio
import base64
import json
from pathlib import Path
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from llmaccel.bounds import check_token_ids
from llmaccel.errors import EngineDeadError, EngineOverloadedError
from llmaccel.sampling_params import SamplingParams
from llmaccel.server.answer import submission_error
from llmaccel.server.chat_messages import _STRICT
from llmaccel.server.errors import APIError

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request


class EmbeddingRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]] = Field(
        description="Text, texts, token ids, or lists of token ids: one vector each.")
    encoding_format: Literal["float", "base64"] = Field("float", description="Numbers, or base64 of float32 bytes.")
    dimensions: int | None = Field(None, description="Only the model's own width is served.")
    user: str | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


def model_pooling(setting: str, model_dir: str | Path | None) -> str:
    """--pooling as it applies: auto reads the sentence-transformers config a model directory may carry
    (1_Pooling/config.json: mean or last token), else last, the one pooling every causal model supports."""
    if setting != "auto":
        return setting
    config = Path(model_dir) / "1_Pooling" / "config.json" if model_dir is not None else None
    if config is not None and config.is_file():
        modes = json.loads(config.read_text())
        if modes.get("pooling_mode_mean_tokens"):
            return "mean"
    return "last"


def input_token_ids(body: EmbeddingRequest, tokenizer, vocab_size: int) -> list[list[int]]:
    """Each input's token ids (texts tokenized with the special tokens, as /v1/completions does)."""
    items = body.input
    single = isinstance(items, str) or bool(items and isinstance(items[0], int))
    if single:
        items = [items]
    if not items:
        raise _bad("input must not be empty")
    if len(items) > MAX_INPUTS:
        raise _bad(f"input has {len(items)} items; at most {MAX_INPUTS} fit one request")
    token_ids = []
    for i, item in enumerate(items):
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        if not ids:
            raise _bad(f"input[{i}] is empty")
        try:
            check_token_ids(ids, vocab_size, "input" if single else f"input[{i}]")
        except ValueError as exc:
            raise _bad(str(exc)) from None
        token_ids.append(ids)
    return token_ids


async def embed(serving, body: EmbeddingRequest, model: str, pooling: str, owner: str = "") -> EmbeddingResponse:
    """serving: the server's OpenAIServing (its engine and tokenizer); `owner`: who sent it (fair share)."""
    engine = serving.engine
    width = engine.engine.spec.hidden_size
    if body.dimensions is not None and body.dimensions != width:
        raise APIError(400, f"dimensions {body.dimensions} is not served: this model's vectors have {width} "
                       "dimensions and are not trained to be cut short; leave dimensions out",
                       param="dimensions", rejected="invalid_request")
    token_ids = input_token_ids(body, serving.tokenizer, engine.engine.spec.vocab_size)
    params = SamplingParams(max_tokens=1, pooling=pooling, lora=serving.adapter_for(model))  # an adapter's own states
    streams = []
    try:
        for ids in token_ids:
            streams.append(engine.add_request(ids, params, timeout=serving.request_timeout, owner=owner))
    except BaseException as exc:
        for stream in streams:
            stream.close()
        if isinstance(exc, ValueError | EngineOverloadedError | EngineDeadError):
            raise submission_error(exc, "input", "input", f"input[{len(streams)}]: ") from None
        raise
    outputs = await asyncio.gather(*(_last(stream) for stream in streams))
    data = [Embedding(index=i, embedding=_encoded(out.embedding, body.encoding_format))
            for i, out in enumerate(outputs)]
    tokens = sum(len(ids) for ids in token_ids)
    return EmbeddingResponse(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


async def _last(stream):
    last = None
    async for output in stream:
        last = output
    if last is None or last.embedding is None:
        raise APIError(500, f"the engine ended embedding request {stream.request_id} without a vector"
                       + (f": {last.error}" if last is not None and last.error else ""), "server_error")
    return last


def _encoded(vector: list[float], encoding: str) -> list[float] | str:
    if encoding == "float":
        return vector
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode()


def _bad(message: str) -> APIError:
    return APIError(400, message, param="input", rejected="invalid_request")
