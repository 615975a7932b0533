"""`POST /tokenize` and `POST /detokenize`, as vLLM's OpenAI server has them.

/tokenize takes a `prompt` (tokenized as /v1/completions does, special tokens added) or chat
`messages` (rendered by the model's chat template as /v1/chat/completions does); it answers the ids,
their count and the context window, and with `return_token_strs` each id's text. /detokenize answers
the text of `tokens`. Neither runs the model, so neither waits behind the engine.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, Field, model_validator

from llmaccel.bounds import check_token_ids
from llmaccel.server.chat_messages import _STRICT, ChatMessage
from llmaccel.server.errors import APIError


class TokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    prompt: str | None = Field(None, description="Text, tokenized as /v1/completions does. Give it or messages.")
    messages: list[ChatMessage] | None = Field(None, min_length=1,
                                               description="A conversation, rendered by the chat template.")
    add_special_tokens: bool | None = Field(None, description="Default: true for prompt, false for messages "
                                                              "(the template writes its own).")
    add_generation_prompt: bool = Field(True, description="messages only: end with the assistant's turn opening.")
    continue_final_message: bool = Field(False, description="messages only: leave the last message open, "
                                                            "to be continued (add_generation_prompt must be false).")
    return_token_strs: bool = Field(False, description="Also answer each token's text.")

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt to be false")
        return self


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(BaseModel):
    model_config = _STRICT
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]] = Field(description="Token ids in [0, vocab).")


class DetokenizeResponse(BaseModel):
    prompt: str


def tokenize(serving, body: TokenizeRequest) -> TokenizeResponse:
    """serving: the server's OpenAIServing (its tokenizer and chat rendering)."""
    tokenizer = serving.tokenizer
    try:
        if body.messages is not None:
            text = serving.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message)
            ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
        else:
            ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    except ValueError as exc:  # no chat template, or the template refused the messages
        raise _bad(exc) from None
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.engine.engine.max_model_len, tokens=ids,
                            token_strs=strs)


def detokenize(serving, body: DetokenizeRequest) -> DetokenizeResponse:
    try:
        check_token_ids(body.tokens, serving.engine.engine.spec.vocab_size, "tokens", param="tokens")
    except ValueError as exc:
        raise _bad(exc) from None
    return DetokenizeResponse(prompt=serving.tokenizer.decode(body.tokens))


def _bad(exc: ValueError) -> APIError:
    return APIError(400, str(exc), param=getattr(exc, "param", None), rejected="invalid_request")
