"""Engine configuration: frozen dataclasses, validated at construction.

`EngineConfig.create` is the one place that turns loose keyword arguments (from the CLI or
from `LLM(**kwargs)`) into these objects.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from llmaccel.platform import auto_dtype

DEFAULT_MODEL = "smollm2-135m"

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 1000**2,
               "mib": 1 << 20, "g": 1 << 30, "gb": 1000**3, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40}


def parse_memory_size(text: str | int) -> int:
    """'1GiB', '512MiB', '2g', '1000000' -> bytes."""
    if isinstance(text, int):
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"cannot read memory size {text!r}: write a number with a unit, e.g. '1GiB' or '512MiB'")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def default_cache_dir() -> Path:
    """Where slow-to-rebuild artefacts (converted checkpoints, compiled kernels) live."""
    root = os.environ.get("LLMACCEL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "llmaccel")
    return Path(root)


def _dtype_from_name(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
             "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}
    if name not in table:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}")
    return table[name]


BF16_LAYOUTS = ("auto", "plain", "vnni", "compact")


@dataclass(frozen=True)
class ModelConfig:
    model: str = DEFAULT_MODEL
    device: str = "cpu"
    dtype: str = "auto"  # auto: bfloat16 where the hardware computes it (CUDA, AMX, AVX512-BF16), else float32
    seed: int = 0
    quantization: str | None = None  # weight-only "int8" / "int4" for the decoder's linear layers, or "gguf":
    # a GGUF file's own quantized tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) as they are, never expanded
    quant_group_size: int | None = None  # INT4 group size (32, 64, 128); None: 32
    quantize_embedding: bool = False  # hold the embedding and LM head in INT8 too (one copy when tied);
    # with "gguf", the file's own Q8_0 table
    rope_scaling: dict | None = None  # replaces the config's RoPE scaling, e.g. {"rope_type": "yarn", "factor": 4}
    # every projection sums each row in one order whatever the rows beside it (bf16: the ordered kernels,
    # ops/kernel_choice.py), so a greedy answer does not change with the load
    batch_invariant: bool = False
    # the bf16 CPU weights' layout (ops/kernel_choice.py): auto, the fastest over the row counts timed at load; plain;
    # vnni (AMX tiles); compact (12 bits a weight, lossless: a lone request reads 0.75 of the bytes)
    bf16_layout: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
        if self.dtype != "auto":
            _dtype_from_name(self.dtype)
        if self.quantization is not None and self.quantization not in ("int8", "int4", "gguf"):
            raise ValueError(f"unknown quantization method {self.quantization!r}; choose int8, int4 or gguf")
        if self.quant_group_size not in (None, 32, 64, 128):
            raise ValueError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size}")
        if self.rope_scaling is not None:
            check_rope_scaling(self.rope_scaling)
        if self.batch_invariant and self.device != "cpu":
            raise ValueError("--batch-invariant runs on llmaccel's CPU kernels; it is not built for CUDA yet")
        if self.bf16_layout not in BF16_LAYOUTS:
            raise ValueError(f"unknown bf16 layout {self.bf16_layout!r}; choose one of {', '.join(BF16_LAYOUTS)}")
        if self.batch_invariant and self.bf16_layout not in ("auto", "vnni"):
            raise ValueError(f"--batch-invariant runs the vnni layout's ordered kernels; --bf16-layout "
                             f"{self.bf16_layout} has none")
        if self.batch_invariant and self.quantization is not None:
            raise ValueError(f"--batch-invariant covers bfloat16 and float32 weights; --quantization "
                             f"{self.quantization}'s kernels are not batch-invariant yet")

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype == "auto":
            return _dtype_from_name(auto_dtype(self.device))
        return _dtype_from_name(self.dtype)


ROPE_SCALINGS = ("linear", "dynamic", "yarn", "llama3", "longrope")  # what model/rope.py computes


def check_rope_scaling(scaling: object) -> None:
    """A --rope-scaling value: a mapping with a known rope_type and a positive factor; ValueError otherwise."""
    if not isinstance(scaling, dict):
        raise ValueError(f"rope_scaling must be a JSON object such as {{\"rope_type\": \"yarn\", \"factor\": 4}}, "
                         f"got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind not in ROPE_SCALINGS:
        raise ValueError(f"rope_scaling: unknown rope_type {kind!r}; choose one of {', '.join(ROPE_SCALINGS)}")
    factor = scaling.get("factor")
    if not isinstance(factor, (int, float)) or isinstance(factor, bool) or factor <= 0:
        raise ValueError(f"rope_scaling: factor must be a positive number, got {factor!r}")


KV_POSITIONS = ("cache", "absolute")  # where a KV window's kept keys sit (engine/kv_cache_manager.py)
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")  # ops/kv_int8.py's formats
_KV_CACHE_ALIASES = {"bf16": "bfloat16", "fp32": "float32", "fp8_e4m3": "fp8"}


def kv_cache_dtype_name(name: str) -> str:
    """The canonical name of a --kv-cache-dtype value; ValueError naming the choices for anything else."""
    canonical = _KV_CACHE_ALIASES.get(name, name)
    if canonical not in KV_CACHE_DTYPES:
        raise ValueError(f"unknown kv_cache_dtype {name!r}; choose one of auto, bf16, float32, int8, fp8")
    return canonical


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    kv_cache_memory: int = 1 << 30  # bytes; the number of blocks follows from it
    num_kv_blocks: int | None = None  # sets the count directly, overriding kv_cache_memory
    enable_prefix_caching: bool = True  # reuse the KV of identical prompt prefixes (hashed full blocks)
    kv_window: int | None = None  # StreamingLLM: keep the last kv_window tokens of each sequence ...
    kv_sinks: int = 4  # ... and its first kv_sinks (attention sinks); blocks wholly between are freed
    # with kv_window: where the kept keys sit. "cache": at their places in the cache (StreamingLLM), so a query never
    # sees a sink farther away than the window; "absolute": at their places in the text
    kv_positions: str = "cache"
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), bfloat16, float32, int8 or fp8 (ops/kv_int8.py)
    # the disk tier below the RAM pool (engine/kv_tiers/): evicted prefix blocks go to files here and come back
    # for a prompt that continues them, across restarts; None: off
    kv_offload_dir: str | None = None
    kv_offload_size: int = 16 << 30  # bytes the disk tier may hold (least recently used files out first)
    # "evict": a block is written when RAM evicts it (and at shutdown); "write-through": as soon as it is computed,
    # so replicas sharing the directory find each other's blocks
    kv_offload_policy: str = "evict"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_cache_dtype", kv_cache_dtype_name(self.kv_cache_dtype))
        if self.kv_offload_dir is not None and not self.enable_prefix_caching:
            raise ValueError("kv_offload_dir needs prefix caching: the disk tier holds the prefix cache's blocks")
        if self.kv_offload_policy not in ("evict", "write-through"):
            raise ValueError(f"unknown kv_offload_policy {self.kv_offload_policy!r}; choose evict or write-through")
        if self.kv_offload_size < 1:
            raise ValueError(f"kv_offload_size must be positive, got {self.kv_offload_size}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two >= 1, got {self.block_size}")
        if self.kv_window is not None and self.kv_window < self.block_size:
            raise ValueError(f"kv_window must be at least the block size ({self.block_size}), got {self.kv_window}")
        if self.kv_sinks < 0:
            raise ValueError(f"kv_sinks must be >= 0, got {self.kv_sinks}")
        if self.kv_positions not in KV_POSITIONS:
            raise ValueError(f"unknown kv_positions {self.kv_positions!r}; choose cache or absolute")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.num_kv_blocks is None and self.kv_cache_memory < 1:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None  # None: the model's own limit, capped by the KV budget
    # "fcfs": in arrival order; "priority": lower `priority` first (vLLM's semantics), a running request preempted
    # for a waiting one of higher priority, and the step's token budget shared fairly between owners (API keys)
    policy: str = "fcfs"

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"unknown scheduling policy {self.policy!r}; choose fcfs or priority")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")


MAX_SPECULATIVE_TOKENS = 16  # past this many drafts a step the last ones are almost never kept


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (spec/): a drafter proposes tokens, the model verifies them in one pass."""

    speculative_method: str | None = None  # "draft": a smaller model (speculative_model); "ngram": prompt
    # lookup, drafts copied from earlier in the context; None: off (or "draft" when a model is given)
    speculative_model: str | None = None  # the draft model: a directory, GGUF file or alias, same tokenizer
    num_speculative_tokens: int = 2  # drafts a decoding request has verified per step (K); 2 measured best
    # on a 2-core Zen 4 (docs/results/issue15/HISTORY.md: three verification rows cost ~1.2x one, four 1.5-2x)
    prompt_lookup_max: int = 4  # ngram: the longest suffix n-gram searched for ...
    prompt_lookup_min: int = 2  # ... and the shortest
    speculative_max_batch: int | None = None  # speculate only while at most this many requests run;
    # None: measured while serving (spec/policy.py)
    speculative_draft_vocab: int | None = None  # the draft model's LM head cut to this many frequent tokens
    # (spec/draft_vocab.py); None: its whole vocabulary (a draft head: the size it was trained for)
    speculative_lookup: bool = False  # with a draft model: prompt lookup first where the context repeats

    def __post_init__(self) -> None:
        if self.speculative_method not in (None, "draft", "ngram"):
            raise ValueError(f"unknown speculative method {self.speculative_method!r}; choose draft or ngram")
        if self.speculative_method == "draft" and self.speculative_model is None:
            raise ValueError("speculative method 'draft' needs --speculative-model (the draft model)")
        if self.speculative_method == "ngram" and self.speculative_model is not None:
            raise ValueError("--speculative-method ngram drafts without a model; drop --speculative-model")
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be between 1 and {MAX_SPECULATIVE_TOKENS}, got "
                             f"{self.num_speculative_tokens}: a draft is kept only if every draft before it was, "
                             "so past a few the rest cost a pass and are almost never kept")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min} "
                             f"and {self.prompt_lookup_max}")
        if self.speculative_max_batch is not None and self.speculative_max_batch < 1:
            raise ValueError(f"speculative_max_batch must be >= 1, got {self.speculative_max_batch}")
        if self.speculative_draft_vocab is not None:
            if self.method != "draft":
                raise ValueError("--speculative-draft-vocab cuts a draft model's LM head; it needs "
                                 "--speculative-model")
            if self.speculative_draft_vocab < 1:
                raise ValueError(f"speculative_draft_vocab must be >= 1, got {self.speculative_draft_vocab}")
        if self.speculative_lookup and self.method != "draft":
            raise ValueError("--speculative-lookup puts prompt lookup before a draft model; it needs "
                             "--speculative-model (for lookup alone use --speculative-method ngram)")

    @property
    def method(self) -> str | None:
        if self.speculative_method is None and self.speculative_model is not None:
            return "draft"
        return self.speculative_method


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters served beside the base model (lora/): requests name one, and any mix shares a batch."""

    enable_lora: bool = False  # hold room for adapters loaded at run time (implied by lora_modules)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, PEFT adapter directory) loaded at start
    max_loras: int = 4  # adapters loaded at once: each takes a share of every projection's stacked LoRA matrices
    max_lora_rank: int = 16  # the largest rank an adapter may have (the share's width)

    def __post_init__(self) -> None:
        modules = self.lora_modules.items() if isinstance(self.lora_modules, Mapping) else self.lora_modules
        object.__setattr__(self, "lora_modules", tuple((str(n), str(p)) for n, p in modules))
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"max_loras must be between 1 and 256, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"max_lora_rank must be between 1 and 512, got {self.max_lora_rank}")
        names = [name for name, _ in self.lora_modules]
        if len(set(names)) != len(names):
            raise ValueError(f"a LoRA module name is given twice: {', '.join(sorted(names))}")
        if len(names) > self.max_loras:
            raise ValueError(f"{len(names)} LoRA modules given, but --max-loras is {self.max_loras}")
        for name in names:
            if not name or any(c.isspace() for c in name):
                raise ValueError(f"bad LoRA module name {name!r}: a name is what requests give as `model`")

    @property
    def enabled(self) -> bool:
        return self.enable_lora or bool(self.lora_modules)


GUARD_ACTIONS = ("block", "flag", "count")


@dataclass(frozen=True)
class GuardConfig:
    """The semantic input guard (safety/semantic_guard.py, engine/guard_stage.py): a classifier on the
    model's pooled hidden states, judged at the end of each prompt's prefill, before its first token."""

    semantic_guard: str | None = None  # a classifier file, "default" (the one shipped or trained for this
    # model; none: the rules alone, logged) or None: off
    semantic_guard_action: str = "block"  # block: end it with no token (HTTP 400 content_filter);
    # flag: serve it, count it and log it; count: serve it and only count it
    semantic_guard_threshold: float | None = None  # a probability in (0, 1); None: the classifier's own

    def __post_init__(self) -> None:
        if self.semantic_guard_action not in GUARD_ACTIONS:
            raise ValueError(f"unknown semantic guard action {self.semantic_guard_action!r}; choose "
                             f"{', '.join(GUARD_ACTIONS)}")
        if self.semantic_guard_threshold is not None and not 0.0 < self.semantic_guard_threshold < 1.0:
            raise ValueError(f"semantic_guard_threshold must be a probability in (0, 1), got "
                             f"{self.semantic_guard_threshold}")


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    lora: LoRAConfig = field(default_factory=LoRAConfig)

    @classmethod
    def create(cls, model: str = DEFAULT_MODEL, **kwargs: object) -> EngineConfig:
        """Build a config from flat keyword arguments; unknown names are an error."""
        for name in ("kv_cache_memory", "kv_offload_size"):
            if name in kwargs:
                kwargs[name] = parse_memory_size(kwargs[name])  # type: ignore[arg-type]
        parts = {}
        for name, klass in (("model", ModelConfig), ("cache", CacheConfig), ("scheduler", SchedulerConfig),
                            ("speculative", SpeculativeConfig), ("guard", GuardConfig), ("lora", LoRAConfig)):
            names = {f.name for f in fields(klass)}
            chosen = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
            if klass is ModelConfig:
                chosen["model"] = model
            parts[name] = klass(**chosen)  # type: ignore[arg-type]
        if kwargs:
            raise ValueError(f"unknown engine option(s): {', '.join(sorted(kwargs))}")
        return cls(**parts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class ServerConfig:
    """How `llmaccel serve` listens and protects itself (the engine has its own config)."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # names clients may ask for; () means the --model value
    api_keys: tuple[str, ...] = ()  # Bearer tokens accepted on /v1/* (any one of them); (): no key needed
    protect_metrics: bool = False  # /metrics, /docs, /openapi.json and /version need a key too
    auth_failures_per_minute: int = 10  # failed authentications allowed per client address; then 429
    trusted_proxies: tuple[str, ...] = ()  # addresses/networks whose X-Forwarded-For names the client
    max_waiting_requests: int | None = 1024  # more waiting sequences than this get HTTP 429
    request_timeout: float | None = 600.0  # seconds from arrival; None: no limit
    max_batch_delay_ms: float = 0.0  # an idle engine waits this long for more arrivals before a step
    step_warn_s: float = 10.0  # the watchdog logs engine steps slower than this
    graceful_shutdown_s: float = 30.0  # on SIGTERM, in-flight requests get this long to finish
    quality_check_interval_s: float | None = None  # re-measure validation perplexity this often; None: never
    result_cache: bool = True  # answer repeated deterministic requests from the result cache
    result_cache_size: int = 4096  # entries held in memory (least recently used out first)
    result_cache_memory: int = 64 << 20  # bytes held in memory
    result_cache_path: str | None = None  # SQLite file that keeps results across restarts
    result_cache_ttl_s: float | None = None  # entries older than this are misses; None: no expiry
    safety_rules: tuple[str, ...] = ("default",)  # input-filter rule files ("default": the shipped set); (): off
    max_body_bytes: int = 4 << 20  # larger request bodies get HTTP 413
    max_prompt_chars: int | None = 65536  # longer prompts (all messages together) get HTTP 400
    rate_limit_requests: int | None = None  # requests per minute per API key (or client address); None: no limit
    rate_limit_tokens: int | None = None  # prompt + completion tokens per minute per API key; None: no limit
    output_rules: tuple[str, ...] = ()  # output-filter rule files ("default-output": secrets redacted); (): off
    guard_sample_rate: float = 0.0  # share of answers the output guard checks at random
    guard_confidence: float | None = None  # the guard also checks answers at least this confident; None: never
    guard_kl: float = 0.35  # mean per-token KL(served || reference) above this is anomalous
    guard_retries: int = 2  # an anomalous answer is generated again this many times, hotter each time
    max_failed_steps: int = 3  # engine steps failing in a row before the server exits non-zero to be restarted
    cascade_small: str | None = None  # a smaller model with the same tokenizer answers each request first
    cascade_threshold: float | None = None  # ... and the model answers when its confidence is below this
    cascade_decide_tokens: int = 32  # the confidence: mean log-probability of the small answer's first N tokens
    tool_call_parser: str = "hermes"  # reads tool calls out of the model's text (structured/tool_parsers.py)
    pooling: str = "auto"  # /v1/embeddings: last, mean, or auto (the model's sentence-transformers config, else last)
    ui: bool = True  # the web page at /ui (playground, dashboard, benchmarks)
    ui_results_dir: str | None = None  # benchmark result JSON files the page may list and draw

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.request_timeout is not None and self.request_timeout <= 0:
            raise ValueError(f"request_timeout must be > 0 seconds, got {self.request_timeout}")
        if self.max_batch_delay_ms < 0:
            raise ValueError(f"max_batch_delay_ms must be >= 0, got {self.max_batch_delay_ms}")
        if self.step_warn_s <= 0 or self.graceful_shutdown_s < 0:
            raise ValueError("step_warn_s must be > 0 and graceful_shutdown_s >= 0")
        if self.result_cache_size < 1 or self.result_cache_memory < 1:
            raise ValueError("result_cache_size and result_cache_memory must be >= 1")
        if self.result_cache_ttl_s is not None and self.result_cache_ttl_s <= 0:
            raise ValueError(f"result_cache_ttl_s must be > 0, got {self.result_cache_ttl_s}")
        if self.quality_check_interval_s is not None and self.quality_check_interval_s <= 0:
            raise ValueError(f"quality_check_interval_s must be > 0, got {self.quality_check_interval_s}")
        if any(not key or key != key.strip() or any(c in key for c in "\r\n") for key in self.api_keys):
            raise ValueError("an API key must not be empty or hold spaces at its ends or line breaks")
        if self.ui_results_dir is not None and not Path(self.ui_results_dir).expanduser().is_dir():
            raise ValueError(f"--ui-results-dir {self.ui_results_dir!r} is not a directory")
        if self.protect_metrics and not self.api_keys:
            raise ValueError("--protect-metrics needs --api-key (or --api-key-file): there is no key to ask for")
        if self.auth_failures_per_minute < 1 or self.max_failed_steps < 1:
            raise ValueError("auth_failures_per_minute and max_failed_steps must be >= 1")
        if self.max_body_bytes < 1 or (self.max_prompt_chars is not None and self.max_prompt_chars < 1):
            raise ValueError("max_body_bytes and max_prompt_chars must be >= 1")
        if self.cascade_small is not None and self.cascade_threshold is None:
            raise ValueError("--cascade-small needs --cascade-threshold: the small model's mean token log-probability "
                             "below which the model answers instead (`llmaccel bench cascade` plots the choices)")
        if self.cascade_threshold is not None and math.isnan(self.cascade_threshold):
            raise ValueError("the cascade threshold must be a number (a mean log-probability, e.g. -0.8)")
        from llmaccel.structured.tool_parsers import TOOL_PARSERS  # config stays import-light

        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"unknown tool-call parser {self.tool_call_parser!r}; known: {', '.join(TOOL_PARSERS)}")
        if self.pooling not in ("auto", "last", "mean"):
            raise ValueError(f"unknown pooling {self.pooling!r}; choose auto, last or mean")
        if self.cascade_decide_tokens < 1:
            raise ValueError(f"the cascade must decide on at least 1 token, got {self.cascade_decide_tokens}")
        for name in ("rate_limit_requests", "rate_limit_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1 per minute, got {getattr(self, name)}")
