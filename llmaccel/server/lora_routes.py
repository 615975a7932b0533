"""LoRA adapters over HTTP, as vLLM serves them: each loaded adapter is a model a request may name (listed in
/v1/models with the base model as its parent), and with --enable-lora adapters load and unload at run time
(`POST /v1/load_lora_adapter {lora_name, lora_path}`, `/v1/unload_lora_adapter {lora_name}`; plain-text success,
OpenAI error JSON otherwise). The engine loads between steps; a bad adapter is a 400 naming the problem and every
other request goes on.
"""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from llmaccel.errors import LLMAccelError
from llmaccel.server import openapi
from llmaccel.server.errors import APIError
from llmaccel.server.response_models import ModelCard
from llmaccel.server.state import ServerState


class LoadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_path: str


class UnloadLoRARequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    lora_name: str
    lora_int_id: int | None = None  # vLLM's clients may send it; the name decides


def _loaded(state: ServerState) -> dict:
    """The adapters loaded now, by name (none before the engine is up, or on replicas, which serve none)."""
    return getattr(getattr(state.engine, "engine", None), "lora_adapters", {})


def adapter_names(state: ServerState) -> list[str]:
    return sorted(_loaded(state))


def adapter_cards(state: ServerState, created: int, max_model_len: int) -> list[ModelCard]:
    adapters = _loaded(state)
    return [ModelCard(id=name, created=created, max_model_len=max_model_len, root=adapter.path,
                      parent=state.model_names[0]) for name, adapter in sorted(adapters.items())]


def add_lora_routes(api: APIRouter, state: ServerState, serving: Callable[[], object], auth_errors: tuple) -> None:
    # success is vLLM's plain-text line; errors are OpenAI's JSON, as on every route
    done = {"description": "The adapter's new state, in one line of text.",
            "content": {"text/plain": {"schema": {"type": "string"}}}}
    answers = {200: done, **openapi.errors(400, *auth_errors, 503)}

    def runtime_loading() -> None:
        serving()  # 503 while loading or shutting down
        if not state.engine.engine.config.lora.enable_lora:
            raise APIError(400, "loading LoRA adapters at run time is off: start the server with --enable-lora",
                           code="lora_disabled", rejected="invalid_request")

    @api.post("/load_lora_adapter", responses=answers)
    async def load_lora_adapter(body: LoadLoRARequest) -> PlainTextResponse:
        runtime_loading()
        if body.lora_name in state.model_names:
            raise APIError(400, f"{body.lora_name!r} is the base model's name; give the adapter another",
                           param="lora_name", code="invalid_lora", rejected="invalid_request")
        try:
            await state.engine.call(lambda engine: engine.add_lora(body.lora_name, body.lora_path))
        except LLMAccelError as exc:
            raise APIError(400, str(exc), param="lora_path", code="invalid_lora", rejected="invalid_request") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @api.post("/unload_lora_adapter", responses=answers)
    async def unload_lora_adapter(body: UnloadLoRARequest) -> PlainTextResponse:
        runtime_loading()
        try:
            await state.engine.call(lambda engine: engine.remove_lora(body.lora_name))
        except LLMAccelError as exc:
            raise APIError(400, str(exc), param="lora_name", code="invalid_lora", rejected="invalid_request") from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
