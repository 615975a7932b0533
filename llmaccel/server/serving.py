"""Chat and text completions: an OpenAI request -> engine requests -> one response or SSE chunks.

A completion request may carry several prompts; each becomes one engine request with `n` samples,
and choice `i * n + j` is sample j of prompt i, as in OpenAI's API. Streams send one chunk per
engine step and choice that has news, end with a usage chunk when asked, then `data: [DONE]`.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

import jinja2
from pydantic import BaseModel

from llmaccel.bounds import check_token_ids
from llmaccel.cache.result_cache import ResultCache, cache_key, is_cacheable
from llmaccel.engine.async_engine import AsyncEngine
from llmaccel.engine.request_stream import RequestStream
from llmaccel.errors import (
    EngineDeadError,
    InvalidRequestError,
    PromptTooLongError,
    RequestFailedError,
    RequestTimeoutError,
)
from llmaccel.outputs import CompletionOutput, RequestOutput
from llmaccel.safety.output_filter import OutputTextFilter
from llmaccel.safety.output_guard import GuardReport
from llmaccel.sampling_params import SamplingParams
from llmaccel.server import echo
from llmaccel.server import protocol as p
from llmaccel.server import response_models as r
from llmaccel.server.answer_checks import CONTENT_FILTER, AnswerChecks
from llmaccel.server.cascade import CascadeRouter, CascadeStream, cascade_route
from llmaccel.server.chat_messages import Message
from llmaccel.server.errors import clip
from llmaccel.server.job import AnyRequest, Job, Stream, merged, outcome
from llmaccel.server.metrics import NullTracker, ServerMetrics
from llmaccel.server.prompt_checks import PromptChecks
from llmaccel.server.result_streams import ReplayStream, SharedFlight
from llmaccel.server.shapes import Shapes
from llmaccel.server.tools import (
    ToolCallStream,
    ToolPlan,
    assistant_message,
    called,
    chat_turns,
    template_reads_tools,
    tool_plan,
)
from llmaccel.structured.tool_parsers import HermesToolParser

logger = logging.getLogger(__name__)



class OpenAIServing:
    def __init__(self, engine: AsyncEngine, tokenizer, metrics: ServerMetrics,
                 request_timeout: float | None, result_cache: ResultCache | None = None,
                 variant: str = "", prompt_checks: PromptChecks | None = None,
                 answer_checks: AnswerChecks | None = None, cascade: CascadeRouter | None = None,
                 tool_parser: HermesToolParser | None = None) -> None:
        self.engine = engine  # the model; with a cascade, the large one
        self.cascade = cascade  # a small model first, the large one when it is unsure
        self.tokenizer = tokenizer  # the server's own copy: the engine thread decodes with another
        self.metrics = metrics
        self.request_timeout = request_timeout
        self.shapes = Shapes(tokenizer)  # logprobs, stream chunks and echo in the API's shapes
        self.result_cache = result_cache
        self.variant = variant  # the model variant, part of every result-cache key
        self.prompt_checks = prompt_checks  # size, well-formed text and the input filter, before tokenizing
        self.answer_checks = answer_checks  # the output guard and the output filter, after generating
        self.tool_parser = tool_parser or HermesToolParser()  # reads tool calls out of text (tool_choice auto)
        self._retry_ids = itertools.count()
        self._flights: dict[str, SharedFlight] = {}

    @property
    def guard_blocks(self) -> bool:
        """Whether the engine's semantic guard may end a request before its first token (a streamed
        answer then waits for the first output before its status line)."""
        guard = getattr(self.engine.engine, "guard", None)  # replicas (cluster/remote_engine.py) run none
        return guard is not None and guard.action == "block"

    # ---- admission --------------------------------------------------------------------------------
    def render_chat(self, messages: list[Message], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, tools: ToolPlan | None = None) -> str:
        """The conversation (with the tools it may call) as the model's chat template writes it."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model has no chat template; use /v1/completions")
        native = template_reads_tools(self.tokenizer)
        turns = chat_turns(messages, tools, native)
        extra = {"tools": tools.specs} if native and tools is not None else {}
        try:
            return self.tokenizer.apply_chat_template(turns, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt,
                                                      continue_final_message=continue_final_message, **extra)
        except jinja2.TemplateError as exc:  # the template's own raise_exception: a client's conversation
            raise InvalidRequestError(f"the model's chat template refused these messages: {exc}",
                                      param="messages") from None

    def prompts(self, request: AnyRequest, tools: ToolPlan | None = None) -> list[list[int]]:
        if isinstance(request, p.ChatCompletionRequest):
            return [self.tokenizer.encode(self.render_chat(request.messages, tools=tools), add_special_tokens=False)]
        return [self.tokenizer.encode(x, add_special_tokens=True) if isinstance(x, str) else x
                for x in request.prompt]

    def sampling_params(self, request: AnyRequest, prompt_len: int, tools: ToolPlan | None = None) -> SamplingParams:
        max_tokens = request.max_new_tokens
        limit = self.engine.engine.max_model_len
        if max_tokens is not None and prompt_len < limit < prompt_len + max_tokens:
            raise PromptTooLongError(
                f"this model's maximum context length is {limit} tokens, but {prompt_len + max_tokens} were "
                f"requested ({prompt_len} in the prompt, {max_tokens} for the completion); shorten the prompt "
                "or lower max_tokens")
        return SamplingParams(
            n=request.n, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            seed=request.seed, max_tokens=max_tokens, min_tokens=request.min_tokens, stop=tuple(request.stop or ()),
            stop_token_ids=tuple(request.stop_token_ids or ()), ignore_eos=request.ignore_eos,
            logprobs=request.num_logprobs, skip_special_tokens=request.skip_special_tokens,
            logit_bias=request.logit_bias or {}, prompt_logprobs=_prompt_logprobs(request),
            structured_outputs=tools.constraint if tools is not None and tools.constraint is not None
            else request.output_constraint)

    def adapter_for(self, model: str) -> str | None:
        """The LoRA adapter a request's `model` names (server/lora_routes.py), or None for the base model. Replicas
        (cluster/remote_engine.py) serve none."""
        return model if model in getattr(self.engine.engine, "lora_adapters", {}) else None

    def submit(self, request: AnyRequest, model: str, owner: str = "") -> Job:
        """Tokenize, validate and queue every prompt; all or nothing. Raises before any output. `owner`: who sent
        it, for the priority policy's fair share."""
        if request.unknown_fields:
            logger.warning("ignoring unknown request field(s): %s", quoted(request.unknown_fields))
        if isinstance(request, p.CompletionRequest):  # token ids are checked before anything decodes them
            vocab = self.engine.engine.spec.vocab_size
            for i, prompt in enumerate(request.prompt):
                if isinstance(prompt, list):
                    check_token_ids(prompt, vocab, "prompt" if len(request.prompt) == 1 else f"prompt[{i}]", "prompt")
        if self.prompt_checks is not None:
            request = self.prompt_checks.apply(request)
        tools = tool_plan(request) if isinstance(request, p.ChatCompletionRequest) else None
        prompts = self.prompts(request, tools)
        params = [self.sampling_params(request, len(ids), tools) for ids in prompts]
        if (lora := self.adapter_for(model)) is not None:
            params = [replace(sp, lora=lora) for sp in params]
        response_id = f"{'chatcmpl' if isinstance(request, p.ChatCompletionRequest) else 'cmpl'}-{uuid.uuid4().hex}"
        streams: list[Stream] = []
        outcomes: list[str] = []
        try:
            for i, (ids, sp) in enumerate(zip(prompts, params, strict=True)):
                stream, outcome = self._open(ids, sp, f"{response_id}-{i}", request.result_cache,
                                             request.priority or 0, owner)
                streams.append(stream)
                outcomes.append(outcome)
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        trackers = [NullTracker() if o == "hit" else self.metrics.track() for o in outcomes]
        cache = "hit" if all(o == "hit" for o in outcomes) else "bypass" if all(o == "bypass" for o in outcomes) \
            else "miss"
        return Job(request, response_id, model, streams, trackers, prompts, params, cache, tools=tools)

    def _open(self, ids: list[int], params: SamplingParams, request_id: str, use_cache: bool, priority: int = 0,
              owner: str = "") -> tuple[Stream, str]:
        """The stream of one prompt: a cache hit's replay, a subscription to an identical request in
        flight, or a new engine request. Also says which: hit, miss or bypass."""
        if self.result_cache is None or not use_cache or not is_cacheable(params):
            return self._engine_request(ids, params, request_id, priority, owner), "bypass"
        variant = self.variant
        if params.lora is not None:  # an adapter loaded again under its name is another model
            adapter = self.engine.engine.lora_adapters.get(params.lora)
            variant += f"|lora={adapter.digest if adapter is not None else params.lora}"
        key = cache_key(variant, ids, params)
        stored = self.result_cache.get(key)
        if stored is not None:
            return ReplayStream(request_id, stored), "hit"
        flight = self._flights.get(key)
        if flight is None:
            stream = self._engine_request(ids, params, request_id, priority, owner)
            flight = SharedFlight(key, stream, self.result_cache, self._flights)
        else:
            self.metrics.result_cache_shared.inc()
        return flight.subscribe(request_id, self.request_timeout), "miss"

    def _engine_request(self, ids: list[int], params: SamplingParams, request_id: str, priority: int = 0,
                        owner: str = "") -> RequestStream | CascadeStream:
        if self.cascade is not None and params.lora is None:  # the cascade's two models schedule in arrival order
            stream = self.cascade.open(ids, params, request_id, self.request_timeout)
        else:
            stream = self.engine.add_request(ids, params, request_id, self.request_timeout, priority=priority,
                                             owner=owner)
        self.metrics.engine_requests.inc()
        return stream

    async def routes(self, job: Job) -> str | None:
        """With a cascade: which model answers each prompt ("small" or "large"; "cache" for a stored
        result), comma-separated in prompt order, once every route is decided. None without a cascade.
        If a decision fails (a timeout, the large engine's queue full), the job ends here and this raises."""
        if self.cascade is None:
            return None
        try:
            return ",".join([await cascade_route(stream) for stream in job.streams])
        except Exception as exc:
            for tracker in job.trackers:
                tracker.finish("timeout" if isinstance(exc, RequestTimeoutError) else "error")
            for stream in job.streams:
                stream.close()
            if job.on_done is not None:
                job.on_done(0)
            raise

    # ---- running ----------------------------------------------------------------------------------
    async def complete(self, job: Job) -> BaseModel:
        """Run to the end, pass every answer through the answer checks, and build one response."""
        last: dict[int, RequestOutput] = {}
        with outcome(job.trackers):
            async for i, output in merged(job):
                last[i] = output
        n = job.request.n
        choices, served = [], []
        for i in range(len(job.streams)):
            for c in last[i].outputs:
                c = await self._finish(job, i, c)
                served.append(c)
                index = i * n + c.index
                if job.is_chat:
                    message, finish_reason = assistant_message(job.tools, self.tool_parser, c.text, c.finish_reason)
                    choices.append(r.ChatChoice(index=index, message=message, finish_reason=finish_reason,
                                                logprobs=self.shapes.chat_logprobs(c.logprobs or [], job)))
                else:
                    choices.append(self.shapes.completion_choice(job, i, index, c, last[i]))
        usage = _usage(job, served, last.values())
        if job.is_chat:
            prompt_logprobs = echo.prompt_logprobs_field(self.shapes, last[0].prompt_logprobs) \
                if job.request.prompt_logprobs is not None else None
            return r.ChatCompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                            usage=usage, prompt_logprobs=prompt_logprobs)
        return r.CompletionResponse(id=job.response_id, created=job.created, model=job.model, choices=choices,
                                    usage=usage)

    async def _finish(self, job: Job, i: int, output: CompletionOutput) -> CompletionOutput:
        if self.answer_checks is None:
            return output
        served, report = await self.answer_checks.finish(job.prompt_ids[i], job.params[i], output,
                                                         lambda params: self._regenerate(job, i, params))
        _record(job, i, report)
        return served

    async def _regenerate(self, job: Job, i: int, params: SamplingParams) -> CompletionOutput:
        """A new answer to prompt i (the output guard's retry), generated to the end."""
        stream = self._engine_request(job.prompt_ids[i], params, f"{job.response_id}-{i}-retry{next(self._retry_ids)}")
        last = None
        try:
            async for output in stream:
                last = output
        finally:
            stream.close()
        return last.outputs[0]

    async def stream(self, job: Job) -> AsyncIterator[str]:
        """SSE lines: chunks, an optional usage chunk, then [DONE]. Errors after the first byte are
        sent as an error event, since the status line has gone already. With answer checks, each
        choice's text goes through the output filter as it streams, and the output guard's verdict
        on a finished choice rides on its final chunk (`guard`)."""
        n = job.request.n
        include_usage = bool(job.request.stream_options and job.request.stream_options.include_usage)
        usage_field = {"usage": None} if include_usage else {}
        sent_tokens: dict[int, int] = {}
        last: dict[int, RequestOutput] = {}
        filters: dict[int, OutputTextFilter] = {}
        calls = {k: ToolCallStream(job.tools, self.tool_parser) for k in range(n * len(job.streams))} \
            if job.tools is not None else {}
        ended: set[int] = set()
        echoing, echoed = not job.is_chat and bool(job.request.echo), set()
        if job.is_chat:  # the role comes first, as OpenAI sends it
            roles = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None} for k in range(n * len(job.streams))]
            yield _sse(self.shapes.chunk(job, roles), **usage_field)
        try:
            with outcome(job.trackers):
                async for i, output in merged(job):
                    last[i] = output
                    choices, reports, echoes = [], [], []
                    for c in output.outputs:
                        index = i * n + c.index
                        if index in ended:
                            continue
                        new_logprobs = (c.logprobs or [])[sent_tokens.get(index, 0):]
                        sent_tokens[index] = len(c.token_ids)
                        if echoing and index not in echoed and (c.token_ids or c.finish_reason):
                            echoed.add(index)  # the prefill is done: its prompt logprobs are in
                            echoes.append(self.shapes.echo_chunk_choice(job, i, index, output))
                        c = self._filter_delta(filters, index, c)
                        if c.finish_reason:
                            ended.add(index)
                            report = await self._review_stream(job, i, c)
                            if report is not None:
                                reports.append(report.as_dict())
                        deltas = []
                        if calls:  # the text goes through the choice's tool-call reader
                            content, deltas = calls[index].push(c.delta_text, c.finish_reason is not None)
                            c = replace(c, delta_text=content or "",
                                        finish_reason=called(c.finish_reason, calls[index].num_calls > 0))
                        if c.delta_text or c.finish_reason or new_logprobs or deltas:
                            choice = self.shapes.chunk_choice(job, index, c, new_logprobs)
                            if deltas:
                                choice["delta"]["tool_calls"] = deltas
                            choices.append(choice)
                    if echoes:  # a chunk of its own, before the choice's first tokens
                        yield _sse(self.shapes.chunk(job, echoes), **usage_field)
                    if choices:
                        guard = {"guard": reports} if reports else {}
                        yield _sse(self.shapes.chunk(job, choices), **usage_field, **guard)
                    if len(ended) == n * len(job.streams):
                        break  # every choice ended (the output filter may stop one before the engine does)
        except (RequestTimeoutError, EngineDeadError, RequestFailedError) as exc:
            yield _sse(r.ErrorResponse(error=error_info(exc)))
            yield "data: [DONE]\n\n"
            return
        except Exception:  # a bug after the status line went out: the details to the log, the id to the client
            logger.exception("internal error while streaming %s", job.response_id)
            yield _sse(r.ErrorResponse(error=r.ErrorInfo(
                message=f"internal error while streaming {job.response_id}; the server log has the details",
                type="internal_error", code="internal_error")))
            yield "data: [DONE]\n\n"
            return
        if include_usage:
            served = [c for out in last.values() for c in out.outputs]
            yield _sse(self.shapes.chunk(job, []), usage=_usage(job, served, last.values()).model_dump())
        yield "data: [DONE]\n\n"

    def _filter_delta(self, filters: dict[int, OutputTextFilter], index: int, c: CompletionOutput) -> CompletionOutput:
        """The choice's output with its delta through the output filter (stopped: content_filter)."""
        if self.answer_checks is None or self.answer_checks.output_filter is None:
            return c
        if index not in filters:
            filters[index] = self.answer_checks.stream_filter()
        text_filter = filters[index]
        delta = text_filter.push(c.delta_text, final=c.finish_reason is not None)
        if text_filter.stopped_by is not None:
            return replace(c, delta_text=delta, finish_reason=CONTENT_FILTER, stop_reason=text_filter.stopped_by)
        return replace(c, delta_text=delta)

    async def _review_stream(self, job: Job, i: int, c: CompletionOutput) -> GuardReport | None:
        if self.answer_checks is None:
            return None
        return _record(job, i, await self.answer_checks.review_stream(job.prompt_ids[i], job.params[i], c))


def _prompt_logprobs(request: AnyRequest) -> int | None:
    """vLLM's prompt_logprobs; an echo with logprobs needs the prompt's too."""
    asked = getattr(request, "prompt_logprobs", None)
    if getattr(request, "echo", False) and request.num_logprobs is not None:
        return max(asked or 0, request.num_logprobs)
    return asked


def error_info(exc: BaseException) -> r.ErrorInfo:
    if isinstance(exc, RequestTimeoutError):
        return r.ErrorInfo(message=str(exc), type="timeout_error", code="request_timeout")
    if isinstance(exc, RequestFailedError):  # the reason stays in the log, under the same request id
        return r.ErrorInfo(message=f"{exc}; the server log has the details under this id", type="internal_error",
                           code="internal_error")
    return r.ErrorInfo(message=str(exc), type="service_unavailable", code="engine_unavailable")


def quoted(names: list[str], limit: int = 10, length: int = 40) -> str:
    """Client-supplied names for a log line: escaped (a newline cannot forge a line), clipped, counted."""
    shown = [repr(clip(name, length)) for name in names[:limit]]
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(shown) + more


def _record(job: Job, i: int, report: GuardReport | None) -> GuardReport | None:
    """Keep the guard's report on the job, its choice numbered across the job's prompts."""
    if report is None:
        return None
    report = replace(report, output=replace(report.output, index=i * job.request.n + report.output.index))
    job.guard_reports.append(report)
    return report


def _usage(job: Job, served: list[CompletionOutput], outputs) -> r.Usage:
    completion = sum(len(c.token_ids) for c in served)
    prompt = sum(job.prompt_lengths)
    outputs = list(outputs)
    cached = r.PromptTokensDetails(cached_tokens=sum(out.num_cached_tokens for out in outputs))
    drafted = sum(out.metrics.spec_draft_tokens for out in outputs)
    accepted = sum(out.metrics.spec_accepted_tokens for out in outputs)
    details = r.CompletionTokensDetails(accepted_prediction_tokens=accepted,
                                        rejected_prediction_tokens=drafted - accepted) if drafted else None
    return r.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                   prompt_tokens_details=cached, completion_tokens_details=details)


# Characters that str.splitlines (and so httpx's iter_lines and many SSE clients) takes for line
# breaks but JSON leaves raw; escaped, a generated U+2028 cannot split one event into two lines.
_LINE_BREAKS_JSON_LEAVES_RAW = str.maketrans({"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def _sse(data: dict | BaseModel, **overrides: object) -> str:
    if isinstance(data, BaseModel):
        data = data.model_dump()
    data.update(overrides)
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS_JSON_LEAVES_RAW)
    return "data: " + body + "\n\n"
