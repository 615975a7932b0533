"""The OpenAI-compatible HTTP app (FastAPI).

The app starts listening at once and loads the model in a thread: until the engine runs, /health
and the API answer 503. Every error a client can cause is a 4xx with OpenAI's error JSON
(`{"error": {"message", "type", "param", "code"}}`); a 500 means a bug in llmaccel.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import llmaccel
from llmaccel.cache.result_cache import ResultCache
from llmaccel.config import ServerConfig
from llmaccel.engine.async_engine import AsyncEngine
from llmaccel.engine.engine import LLMEngine
from llmaccel.engine.engine_thread import BackgroundTask
from llmaccel.safety.input_filter import InputFilter
from llmaccel.safety.output_guard import GuardConfig, OutputGuard
from llmaccel.safety.rate_limit import RateLimiter
from llmaccel.safety.rules import load_rules
from llmaccel.server import embeddings, openapi, responses, tokenizing
from llmaccel.server import protocol as p
from llmaccel.server.answer import admitted_client, answer
from llmaccel.server.answer_checks import AnswerChecks
from llmaccel.server.auth import Gate, parse_networks
from llmaccel.server.cascade import CascadeRouter, CascadeRule, check_cascade
from llmaccel.server.errors import APIError, validation_error_message
from llmaccel.server.lora_routes import adapter_cards, adapter_names, add_lora_routes
from llmaccel.server.metrics import ServerMetrics
from llmaccel.server.middleware import CatchErrors, CountRequests, LimitBody
from llmaccel.server.prompt_checks import PromptChecks
from llmaccel.server.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    HealthStatus,
    ModelCard,
    ModelList,
    VersionInfo,
)
from llmaccel.server.serving import OpenAIServing
from llmaccel.server.state import ServerState
from llmaccel.server.stats import DashboardStats, engine_summary
from llmaccel.server.ui_routes import add_ui, results_router
from llmaccel.structured.tool_parsers import tool_parser

logger = logging.getLogger(__name__)

def create_app(config: ServerConfig, engine_factory: Callable[[], LLMEngine] | None, model_name: str,
               on_fatal: Callable[[], None] | None = None,
               small_engine_factory: Callable[[], LLMEngine] | None = None,
               async_engine_factory: Callable[[], AsyncEngine] | None = None) -> FastAPI:
    """`engine_factory` builds the LLMEngine (slow: runs in a thread); `on_fatal` is called if it fails
    to load, or when the engine stops for good after steps kept failing (then `engine_died` is set, so
    the process exits non-zero and a supervisor restarts it). Bad safety rules or proxy addresses
    raise ValueError here, before anything loads. `small_engine_factory`: a cascade's small model
    (config.cascade_small); it must share the model's tokenizer and be smaller, or loading fails.
    `async_engine_factory` replaces `engine_factory` with an object that has AsyncEngine's surface
    (cluster/remote_engine.py: replicas on Ray Serve)."""
    input_filter = InputFilter(load_rules(list(config.safety_rules))) if config.safety_rules else None
    output_filter = InputFilter(load_rules(list(config.output_rules))) if config.output_rules else None
    guard_config = GuardConfig(config.guard_sample_rate, config.guard_confidence, config.guard_kl, config.guard_retries)
    limiter = RateLimiter(config.rate_limit_requests, config.rate_limit_tokens)
    gate = Gate(config.api_keys, parse_networks(config.trusted_proxies), config.auth_failures_per_minute)
    state = ServerState(config, ServerMetrics(), config.served_model_names or (model_name,), created=int(time.time()),
                        rate_limiter=limiter if limiter.enabled else None, gate=gate)

    def engine_died(error: BaseException) -> None:  # in the engine thread
        state.engine_died = True
        if on_fatal is not None:
            on_fatal()

    async def load() -> None:
        async_engine = async_engine_factory() if async_engine_factory is not None else AsyncEngine(
            engine_factory, max_batch_delay_s=config.max_batch_delay_ms / 1000, step_warn_s=config.step_warn_s,
            max_waiting_requests=config.max_waiting_requests, on_step=state.metrics.observe_step,
            background=_quality_watch(config, state), max_failed_steps=config.max_failed_steps, on_dead=engine_died)
        small = None if small_engine_factory is None else AsyncEngine(  # stepped by the host's thread and loop
            small_engine_factory, max_waiting_requests=config.max_waiting_requests,
            max_failed_steps=config.max_failed_steps, on_dead=engine_died, host=async_engine)
        try:
            await async_engine.start()
            if small is not None:
                await small.start()
                check_cascade(small.engine, async_engine.engine, config.cascade_small)
        except Exception as exc:
            state.load_error = exc
            logger.error("could not load the model%s: %s", "s" if small is not None else "", exc)
            for started in (async_engine, small):
                if started is not None and started.engine is not None:
                    await started.shutdown()
            if on_fatal is not None:
                on_fatal()
            return
        engine = async_engine.engine
        engine.record_confidence = guard_config.confidence is not None  # set before the first request arrives
        state.metrics.bind_engine(lambda: engine.num_running_seqs, lambda: async_engine.num_waiting,
                                  lambda: engine.kv_cache_usage, lambda: engine.prefix_cache_stats,
                                  lambda: engine.memory_bytes)
        state.metrics.bind_speculation(lambda: engine.speculation_stats)
        state.metrics.bind_kv_tiers(lambda: getattr(engine, "kv_tier_stats", None))  # replicas: none yet
        if getattr(engine, "guard", None) is not None:  # replicas (cluster/remote_engine.py) run none
            state.metrics.bind_semantic_guard(lambda: dict(engine.guard.counts))
        state.stats = DashboardStats(state.metrics.registry, engine_summary(engine, list(state.model_names)))
        result_cache = _result_cache(config)
        if result_cache is not None:
            state.metrics.bind_result_cache(result_cache)
        tokenizer = copy.deepcopy(engine.tokenizer)
        checks = PromptChecks(input_filter, config.max_prompt_chars, state.metrics, tokenizer)
        answers = None
        if guard_config.enabled or output_filter is not None:
            async def measure(prompt_ids, output_ids, params):
                return await async_engine.call(lambda e: e.divergence(prompt_ids, output_ids, params))

            guard = None
            if guard_config.enabled:
                guard = OutputGuard(guard_config, measure, state.metrics)
                await async_engine.call(lambda e: e.reference_scorer())  # load a float reference now, not mid-request
            answers = AnswerChecks(guard, output_filter, state.metrics)
        variant, cascade = engine.variant, None
        if small is not None:
            rule = CascadeRule(config.cascade_threshold, config.cascade_decide_tokens)
            cascade = CascadeRouter(small, async_engine, rule, state.metrics)
            state.metrics.bind_cascade_small(lambda: small.engine.num_running_seqs, lambda: small.num_waiting,
                                             lambda: small.engine.kv_cache_usage)
            variant += f"|cascade:{small.engine.variant}|{rule.threshold}|{rule.decide_tokens}"  # its answers differ
            logger.info("cascade: %s answers first (%.0f MB of weights against %.0f MB); the model answers when the "
                        "mean log-probability of its first %d tokens is below %g", config.cascade_small,
                        small.engine.weight_bytes / 1e6, engine.weight_bytes / 1e6, rule.decide_tokens, rule.threshold)
        state.serving = OpenAIServing(async_engine, tokenizer, state.metrics, config.request_timeout, result_cache,
                                      variant, checks, answers, cascade, tool_parser(config.tool_call_parser))
        state.small_engine = small
        state.engine = async_engine
        capacity = engine.num_blocks * engine.config.cache.block_size
        logger.info("serving %s (%s, %s, KV cache %d tokens in %d blocks, max_model_len %d) at http://%s:%d/v1",
                    ", ".join(state.model_names), str(engine.dtype).removeprefix("torch."), engine.device, capacity,
                    engine.num_blocks, engine.max_model_len, config.host, config.port)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        loader = asyncio.create_task(load())
        yield
        state.draining = True
        if not loader.done():
            loader.cancel()
        if state.engine is not None:
            await state.engine.shutdown()
        if state.small_engine is not None:
            await state.small_engine.shutdown()
        if state.serving is not None and state.serving.result_cache is not None:
            state.serving.result_cache.close()

    app = FastAPI(title="llmaccel", version=llmaccel.__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None, description="An OpenAI-compatible server. Errors are OpenAI's JSON.")
    app.state.server = state
    _install_error_handlers(app, state)
    app.add_middleware(LimitBody, max_bytes=config.max_body_bytes, metrics=state.metrics)
    app.add_middleware(CatchErrors)  # request ids; a bug is a 500 naming one, and the connection lives on
    app.add_middleware(CountRequests, metrics=state.metrics)  # outermost: counts the 413s and 500s as well

    def serving() -> OpenAIServing:
        if state.draining:
            raise APIError(503, "the server is shutting down", "service_unavailable", code="shutting_down",
                           headers={"Retry-After": "5"}, rejected="unavailable")
        if state.serving is None or not state.engines_alive:
            raise APIError(503, "the model is still loading" if state.serving is None else "the engine is not running",
                           "service_unavailable", code="not_ready", headers={"Retry-After": "5"},
                           rejected="unavailable")
        return state.serving

    async def check_api_key(request: Request) -> None:  # async: no worker thread per request
        gate.check(request)

    def model_for(requested: str | None) -> str:
        """The model a request names: the served model's names, or a LoRA adapter's (server/lora_routes.py)."""
        if requested is None:
            return state.model_names[0]
        if requested not in state.model_names and requested not in adapter_names(state):
            served = [*state.model_names, *adapter_names(state)]
            raise APIError(400, f"the model {requested!r} does not exist; this server serves "
                           f"{', '.join(repr(m) for m in served)}", param="model", code="model_not_found",
                           rejected="invalid_request")
        return requested

    keyed = [Depends(check_api_key)]
    api = APIRouter(prefix="/v1", dependencies=keyed)
    auth_errors = (401, 429) if gate.needs_key else ()
    answer_errors = openapi.errors(400, *auth_errors, 413, 429, 500, 503, 504)
    open_unless_protected = keyed if config.protect_metrics else []
    meta_errors = openapi.errors(*auth_errors) if config.protect_metrics else {}

    @api.get("/models", responses=openapi.errors(*auth_errors))
    async def list_models() -> ModelList:
        limit = state.engine.engine.max_model_len if state.engine is not None else 0
        return ModelList(data=[ModelCard(id=name, created=state.created, max_model_len=limit)
                               for name in state.model_names] + adapter_cards(state, state.created, limit))

    @api.post("/chat/completions", response_model=ChatCompletionResponse,
              responses={200: {"content": openapi.STREAM}, **answer_errors})
    async def chat_completions(body: p.ChatCompletionRequest, request: Request) -> Response:
        return await answer(serving(), body, model_for(body.model), request, state)

    stored_responses = responses.ResponseStore()  # previous_response_id; in memory, least recently used out

    @api.post("/responses", responses={200: {"content": openapi.STREAM}, **answer_errors, **responses.NOT_FOUND})
    async def create_response(body: responses.ResponsesRequest, request: Request) -> Response:
        """OpenAI's Responses API, answered on the chat path (server/responses.py)."""
        return await responses.create(serving(), body, model_for(body.model), request, state, stored_responses)

    @api.get("/responses/{response_id}", responses={**openapi.errors(*auth_errors), **responses.NOT_FOUND})
    async def retrieve_response(response_id: str) -> JSONResponse:
        return JSONResponse(stored_responses.find(response_id).response)

    @api.delete("/responses/{response_id}", responses={**openapi.errors(*auth_errors), **responses.NOT_FOUND})
    async def delete_response(response_id: str) -> JSONResponse:
        stored_responses.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    @api.post("/completions", response_model=CompletionResponse,
              responses={200: {"content": openapi.STREAM}, **answer_errors})
    async def completions(body: p.CompletionRequest, request: Request) -> Response:
        return await answer(serving(), body, model_for(body.model), request, state)

    @api.post("/embeddings", response_model=embeddings.EmbeddingResponse,
              responses=openapi.errors(400, *auth_errors, 413, 429, 500, 503, 504))
    async def create_embeddings(body: embeddings.EmbeddingRequest, request: Request) -> embeddings.EmbeddingResponse:
        served = serving()
        pooling = embeddings.model_pooling(config.pooling, getattr(served.engine.engine, "hf_dir", None))
        model = model_for(body.model)
        client = admitted_client(state, request)
        response = await embeddings.embed(served, body, model, pooling, client)
        if state.rate_limiter is not None:
            state.rate_limiter.charge(client, response.usage.prompt_tokens)
        return response

    add_lora_routes(api, state, serving, auth_errors)
    app.include_router(api)

    @app.post("/tokenize", dependencies=keyed, response_model=tokenizing.TokenizeResponse,
              responses=openapi.errors(400, *auth_errors, 413, 503))
    async def tokenize(body: tokenizing.TokenizeRequest) -> tokenizing.TokenizeResponse:
        model_for(body.model)
        return tokenizing.tokenize(serving(), body)

    @app.post("/detokenize", dependencies=keyed, response_model=tokenizing.DetokenizeResponse,
              responses=openapi.errors(400, *auth_errors, 413, 503))
    async def detokenize(body: tokenizing.DetokenizeRequest) -> tokenizing.DetokenizeResponse:
        model_for(body.model)
        return tokenizing.detokenize(serving(), body)

    @app.get("/health", response_model=HealthStatus,
             responses={503: {"model": HealthStatus, "description": "Starting, failed to load, draining or dead."}})
    async def health() -> Response:
        if state.engines_alive and not state.draining:
            return JSONResponse({"status": "ok"})
        status = ("draining" if state.draining else "failed" if state.load_error else
                  "starting" if state.engine is None else "dead")
        return JSONResponse({"status": status}, status_code=503)

    @app.get("/version", dependencies=open_unless_protected, responses=meta_errors)
    async def version() -> VersionInfo:
        import torch

        return VersionInfo(version=llmaccel.__version__, torch=torch.__version__)

    @app.get("/metrics", dependencies=open_unless_protected, response_class=Response,
             responses={200: {"content": openapi.TEXT, "description": "Prometheus text format."}, **meta_errors})
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    if config.ui:
        add_ui(app)
    app.include_router(results_router(config.ui_results_dir, keyed))

    @app.get("/v1/llmaccel/stats", dependencies=keyed, responses=openapi.errors(*auth_errors, 503))
    async def dashboard_stats() -> JSONResponse:
        """Rates, gauges, windowed latency percentiles and totals, from this server's own metrics
        (llmaccel/server/stats.py): what the /ui dashboard draws."""
        if state.stats is None:
            raise APIError(503, "the model is still loading; no statistics yet", "service_unavailable",
                           code="not_ready", headers={"Retry-After": "5"})
        return JSONResponse(state.stats.report())

    @app.get("/openapi.json", dependencies=open_unless_protected, include_in_schema=False)
    async def openapi_document() -> JSONResponse:
        return JSONResponse(openapi.openapi_schema(app, state.model_names))

    @app.get("/docs", dependencies=open_unless_protected, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="llmaccel API")

    app.openapi = lambda: openapi.openapi_schema(app, state.model_names)
    return app


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        if exc.rejected is not None:
            state.metrics.rejected.labels(reason=exc.rejected).inc()
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_error_message(exc.errors())
        return await api_error(request, APIError(400, message, param=param, rejected="invalid_request"))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code=code, headers=getattr(exc, "headers", None)).response()


def _quality_watch(config: ServerConfig, state: ServerState) -> BackgroundTask | None:
    if config.quality_check_interval_s is None:
        return None
    from llmaccel.quantization.quality import QualityWatch

    return BackgroundTask(config.quality_check_interval_s, QualityWatch(state.metrics.observe_quality),
                          "quality check")


def _result_cache(config: ServerConfig) -> ResultCache | None:
    if not config.result_cache:
        return None
    path = Path(config.result_cache_path).expanduser() if config.result_cache_path else None
    return ResultCache(config.result_cache_size, config.result_cache_memory, path, config.result_cache_ttl_s)
