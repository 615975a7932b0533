"""`llmaccel serve`: flags -> configs -> uvicorn, with a draining SIGTERM.

On SIGTERM (or Ctrl-C) the server stops accepting connections, answers 503 on connections that
are still open, lets in-flight requests finish for up to --graceful-shutdown-s, then stops the engine.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal

import uvicorn

from llmaccel.config import EngineConfig, ServerConfig, parse_memory_size
from llmaccel.engine.engine import LLMEngine
from llmaccel.model.loader import resolve_model_path
from llmaccel.server.auth import read_key_file
from llmaccel.structured.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)

API_KEY_ENV = "LLMACCEL_API_KEY"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0 for every interface)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port to listen on")
    parser.add_argument("--served-model-name", action="append", default=[],
                        help="name clients use in the 'model' field (repeatable; default: the --model value)")
    parser.add_argument("--api-key", action="append", default=[], metavar="KEY",
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (repeat for several keys; or set "
                             f"${API_KEY_ENV}; default: no key). Rate limits then count per key")
    parser.add_argument("--api-key-file", metavar="F",
                        help="accept every key in this file too, one per line ('#' starts a comment)")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="with keys: /metrics, /docs, /openapi.json and /version need a key as well "
                             "(/health always stays open)")
    parser.add_argument("--no-ui", action="store_true",
                        help="do not serve the web page at /ui (playground, live dashboard, benchmark viewer)")
    parser.add_argument("--ui-results-dir", metavar="DIR",
                        help="benchmark result JSON files (bench serve / sweep / offline) that the page's "
                             "Benchmarks view lists and draws; files can also be uploaded in the page")
    parser.add_argument("--auth-failures-per-minute", type=int, default=10, metavar="N",
                        help="failed authentications allowed per client address per minute; after that every "
                             "attempt from it gets HTTP 429 until the allowance refills")
    parser.add_argument("--trusted-proxies", action="append", default=[], metavar="ADDR",
                        help="a reverse proxy's address or network (repeatable, e.g. 10.0.0.0/8): requests from it "
                             "are attributed to the client named in X-Forwarded-For (for rate limits and failed "
                             "authentications); without this flag X-Forwarded-For is ignored")
    parser.add_argument("--max-failed-steps", type=int, default=3, metavar="N",
                        help="an engine step that fails ends its requests with HTTP 500 and the engine goes on; after "
                             "N failed steps in a row the server exits with status 1, for a supervisor to restart")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="sequences allowed to wait for the engine; more get HTTP 429 with Retry-After")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds from arrival after which a request is aborted (HTTP 504); 0 disables")
    parser.add_argument("--max-batch-delay-ms", type=float, default=0.0,
                        help="an idle engine waits up to this long for more requests before its first step")
    parser.add_argument("--step-warn-s", type=float, default=10.0, help="log engine steps slower than this")
    parser.add_argument("--graceful-shutdown-s", type=float, default=30.0,
                        help="on SIGTERM, how long in-flight requests may take to finish")
    parser.add_argument("--quality-check-interval", type=float, metavar="S",
                        help="every S seconds, between batches, re-measure perplexity on a small fixed validation "
                             "slice and export it with the full-precision reference as llmaccel_quality_* gauges "
                             "on /metrics (for quantized models; the reference comes from `llmaccel quantize`, "
                             "or is measured once at the first check)")
    parser.add_argument("--no-result-cache", action="store_true",
                        help="do not answer repeated deterministic requests (temperature 0 or a fixed seed, n = 1) "
                             "from the exact result cache; a request can also opt out with \"result_cache\": false")
    parser.add_argument("--result-cache-size", type=int, default=4096,
                        help="result-cache entries held in memory, least recently used evicted first")
    parser.add_argument("--result-cache-memory", default="64MiB", help="result-cache bytes held in memory")
    parser.add_argument("--result-cache-path", metavar="F.db",
                        help="also keep results in this SQLite file (WAL mode), so hits survive a restart")
    parser.add_argument("--result-cache-ttl", type=float, metavar="S",
                        help="results older than S seconds are recomputed (default: no expiry)")
    parser.add_argument("--safety-rules", action="append", metavar="F",
                        help="input-filter rules, a YAML or JSON file (repeatable; 'default' names the rule set "
                             "shipped with llmaccel, used when none is given); prompts a `block` rule "
                             "matches get HTTP 400 with code content_filter (docs/safety.md)")
    parser.add_argument("--no-input-filter", action="store_true", help="check prompts against no safety rules")
    parser.add_argument("--semantic-guard", default="default", metavar="F",
                        help="the semantic input guard: a classifier on the model's own hidden states that judges "
                             "each prompt at the end of its prefill, before its first token (docs/safety.md). F: a "
                             "classifier file from `llmaccel safety train-guard`; 'default': the one shipped or "
                             "trained for --model (none: the rules alone, logged); 'off': no semantic guard")
    parser.add_argument("--semantic-guard-action", choices=("block", "flag", "count"), default="block",
                        help="what a prompt at or over the threshold gets: block (HTTP 400 content_filter, no token "
                             "generated), flag (served, counted and logged) or count (served and counted)")
    parser.add_argument("--semantic-guard-threshold", type=float, metavar="P",
                        help="the probability at or over which a prompt is judged an attack (default: the "
                             "classifier's own, chosen for <= 1%% false positives with the rules on held-out sets)")
    parser.add_argument("--max-body-size", default="4MiB", help="larger request bodies get HTTP 413")
    parser.add_argument("--max-prompt-chars", type=int, default=65536,
                        help="prompts longer than this many characters (all messages together) get HTTP 400; "
                             "0: no limit")
    parser.add_argument("--rate-limit-requests", type=int, metavar="N",
                        help="requests per minute allowed to each API key (to each client address when no key is "
                             "set); more get HTTP 429 with Retry-After; none: no limit")
    parser.add_argument("--rate-limit-tokens", type=int, metavar="N",
                        help="prompt + completion tokens per minute allowed to each API key (or client address); "
                             "none: no limit")
    parser.add_argument("--output-rules", action="append", metavar="F",
                        help="output-filter rules, YAML or JSON (repeatable; 'default-output' names the shipped set "
                             "that redacts secrets and card numbers): `redact` rules rewrite generated text, a "
                             "`block` rule stops the answer with finish_reason content_filter; none: no output filter")
    parser.add_argument("--guard-sample-rate", type=float, default=0.0, metavar="R",
                        help="share of answers (0..1) the output guard scores against the reference distribution "
                             "(the full-precision model for a quantized variant; else the raw distribution before "
                             "temperature and penalties); see docs/safety.md")
    parser.add_argument("--guard-confidence", type=float, metavar="P",
                        help="the guard also checks every answer whose mean top-token probability is at least P")
    parser.add_argument("--guard-kl", type=float, default=0.35,
                        help="mean per-token KL(served || reference) above which an answer is anomalous")
    parser.add_argument("--guard-retries", type=int, default=2,
                        help="an anomalous answer is generated again up to this many times at a higher temperature; "
                             "if every try is anomalous the closest one is served, flagged (x-llmaccel-guard)")
    parser.add_argument("--access-log", action="store_true", help="log every HTTP request (uvicorn access log)")
    parser.add_argument("--pooling", default="auto", choices=("auto", "last", "mean"),
                        help="how /v1/embeddings pools the model's final hidden states into one vector (then "
                             "L2-normalized): last token, mean over tokens, or auto: the model directory's "
                             "sentence-transformers pooling config (1_Pooling/config.json) where it has one, else last")
    parser.add_argument("--tool-call-parser", default="hermes", choices=sorted(TOOL_PARSERS),
                        help="how tool calls are read out of the model's text when tool_choice is auto: 'hermes' "
                             "reads <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call> (Hermes 2 Pro, "
                             "Qwen2/2.5/3, and the prompt llmaccel writes for templates without tools). A named "
                             "or required tool_choice needs no parser: the grammar holds the output to the schema")
    cascade = parser.add_argument_group(
        "cascade (a small model answers first; the --model answers when the small one is unsure)")
    cascade.add_argument("--cascade-small", metavar="DIR",
                         help="the small model: same tokenizer as --model, fewer weight bytes (e.g. a student from "
                              "`llmaccel distill`); it runs with --model's dtype, device and KV-cache settings, "
                              "unquantized. The route of each answer is in the x-llmaccel-route header and in "
                              "llmaccel_cascade_requests_total on /metrics")
    cascade.add_argument("--cascade-threshold", type=float, metavar="T",
                         help="(required with --cascade-small) the --model answers when the mean log-probability of "
                              "the small answer's first --cascade-decide-tokens tokens is below T; `llmaccel bench "
                              "cascade --decide-tokens N` plots cost against agreement and recommends a threshold")
    cascade.add_argument("--cascade-decide-tokens", type=int, default=32, metavar="N",
                         help="tokens of the small answer the route is decided on (all of it if shorter); a response, "
                              "streamed or not, starts after the decision")


def guard_options(args: argparse.Namespace) -> dict:
    """The engine's semantic-guard options from --semantic-guard*."""
    return dict(semantic_guard=None if args.semantic_guard == "off" else args.semantic_guard,
                semantic_guard_action=args.semantic_guard_action,
                semantic_guard_threshold=args.semantic_guard_threshold)


def small_engine_options(engine_options: dict) -> dict:
    """A cascade's small model runs where and as the model does, unquantized and without speculation. It
    answers first, so it judges prompts with a semantic guard too: its own classifier (one is trained per
    model, so a file given for the large model does not fit it), found as 'default' finds one."""
    shared = ("device", "dtype", "kv_cache_memory", "kv_cache_dtype", "num_kv_blocks", "block_size",
              "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens", "semantic_guard_action")
    options = {name: engine_options[name] for name in shared if name in engine_options}
    if engine_options.get("semantic_guard") is not None:
        options["semantic_guard"] = "default"
    return options


def api_keys(args: argparse.Namespace) -> tuple[str, ...]:
    """--api-key flags, the key file and $LLMACCEL_API_KEY, in that order, without repeats."""
    keys = list(args.api_key)
    if args.api_key_file:
        keys += read_key_file(args.api_key_file)
    if os.environ.get(API_KEY_ENV):
        keys.append(os.environ[API_KEY_ENV])
    return tuple(dict.fromkeys(keys))


def server_config(args: argparse.Namespace) -> ServerConfig:
    return ServerConfig(host=args.host, port=args.port, served_model_names=tuple(args.served_model_name),
                        api_keys=api_keys(args), protect_metrics=args.protect_metrics,
                        ui=not args.no_ui, ui_results_dir=args.ui_results_dir,
                        auth_failures_per_minute=args.auth_failures_per_minute,
                        trusted_proxies=tuple(args.trusted_proxies), max_failed_steps=args.max_failed_steps,
                        max_waiting_requests=args.max_waiting_requests,
                        request_timeout=args.request_timeout or None, max_batch_delay_ms=args.max_batch_delay_ms,
                        step_warn_s=args.step_warn_s, graceful_shutdown_s=args.graceful_shutdown_s,
                        quality_check_interval_s=args.quality_check_interval,
                        result_cache=not args.no_result_cache, result_cache_size=args.result_cache_size,
                        result_cache_memory=parse_memory_size(args.result_cache_memory),
                        result_cache_path=args.result_cache_path, result_cache_ttl_s=args.result_cache_ttl,
                        safety_rules=() if args.no_input_filter else tuple(args.safety_rules or ["default"]),
                        max_body_bytes=parse_memory_size(args.max_body_size),
                        max_prompt_chars=args.max_prompt_chars or None,
                        rate_limit_requests=args.rate_limit_requests, rate_limit_tokens=args.rate_limit_tokens,
                        output_rules=tuple(args.output_rules or ()), guard_sample_rate=args.guard_sample_rate,
                        guard_confidence=args.guard_confidence, guard_kl=args.guard_kl,
                        guard_retries=args.guard_retries, cascade_small=args.cascade_small,
                        cascade_threshold=args.cascade_threshold, cascade_decide_tokens=args.cascade_decide_tokens,
                        tool_call_parser=args.tool_call_parser, pooling=args.pooling)


class _DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_exit) -> None:
        super().__init__(config)
        self._on_exit = on_exit

    def handle_exit(self, sig, frame) -> None:
        """As uvicorn's, but without re-raising the signal at the end: a drained server exits 0."""
        if not self.should_exit:
            logger.info("shutting down: no new requests; in-flight requests get up to %.0f s to finish",
                        self.config.timeout_graceful_shutdown or 0)
        self._on_exit()
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True  # a second Ctrl-C stops at once
        else:
            self.should_exit = True


def serve(model: str, engine_options: dict, config: ServerConfig, log_level: str = "info",
          access_log: bool = False) -> int:
    """Run the server until SIGTERM/SIGINT; returns the process exit code."""
    from llmaccel.server.app import create_app

    engine_config = EngineConfig.create(model, **engine_options)  # bad flags fail here, before listening
    resolve_model_path(model)
    small_factory = None
    if config.cascade_small is not None:
        small_config = EngineConfig.create(config.cascade_small, **small_engine_options(engine_options))
        resolve_model_path(config.cascade_small)
        small_factory = lambda: LLMEngine(small_config)  # noqa: E731
    server: _DrainingServer | None = None

    def stop() -> None:
        if server is not None:
            server.should_exit = True

    app = create_app(config, lambda: LLMEngine(engine_config), model_name=model, on_fatal=stop,
                     small_engine_factory=small_factory)
    server = draining_server(app, config, log_level, access_log)
    return run_server(server, app, model, config)


def draining_server(app, config: ServerConfig, log_level: str, access_log: bool) -> _DrainingServer:
    state = app.state.server

    def drain() -> None:
        state.draining = True

    uv_config = uvicorn.Config(app, host=config.host, port=config.port, log_level=log_level.lower(),
                               access_log=access_log, timeout_graceful_shutdown=config.graceful_shutdown_s,
                               timeout_keep_alive=5, proxy_headers=False)  # X-Forwarded-For: --trusted-proxies
    return _DrainingServer(uv_config, drain)


def run_server(server: _DrainingServer, app, model: str, config: ServerConfig) -> int:
    """Serve until told to stop; the exit code (the load error is raised)."""
    state = app.state.server
    server.run()
    if state.load_error is not None:
        raise ValueError(f"could not load {model!r}: {state.load_error}") if isinstance(
            state.load_error, ValueError) else state.load_error
    if state.engine_died:
        logger.error("exiting with status 1: the engine stopped after %d failed steps in a row",
                     config.max_failed_steps)
        return 1
    return 0
