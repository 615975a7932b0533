"""Prometheus metrics of the server (prometheus-client; seconds, tokens and ratios as units).

Each app has its own registry, so several servers can live in one process (the tests do). Latency
histograms are observed per request when it ends, from the engine's timestamps; inter-token latency
is observed as outputs reach the server. Engine gauges are read at scrape time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmaccel.engine.engine import StepStats
from llmaccel.engine.kv_cache_manager import PrefixCacheStats
from llmaccel.outputs import RequestOutput
from llmaccel.spec.policy import SpeculationStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                    40.0, 80.0, 160.0, 640.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                          2.5, 5.0, 10.0)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 512)

PREFIX = "llmaccel_"


class ServerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        ProcessCollector(registry=r)  # process_resident_memory_bytes, cpu seconds, ...

        def histogram(name: str, doc: str, buckets: tuple[float, ...] = _LATENCY_BUCKETS) -> Histogram:
            return Histogram(PREFIX + name, doc, buckets=buckets, registry=r)

        self.time_to_first_token = histogram("time_to_first_token_seconds", "Arrival to first generated token.")
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds", "Per request: (end - first token) / (output tokens - 1).",
            _TOKEN_LATENCY_BUCKETS)
        self.inter_token_latency = histogram("inter_token_latency_seconds",
                                             "Time between successive outputs of a request, per token.",
                                             _TOKEN_LATENCY_BUCKETS)
        self.e2e_latency = histogram("e2e_request_latency_seconds", "Arrival to the last token.")
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled step.")
        self.step_batch_size = histogram("step_batch_size", "Sequences that shared one engine step.", _BATCH_BUCKETS)
        self.step_tokens = histogram("step_num_tokens", "Tokens computed in one engine step.",
                                     (1, 4, 16, 64, 128, 256, 512, 1024, 2048, 4096, 8192))
        self.step_duration = histogram("step_duration_seconds", "Wall time of one engine step.",
                                       _TOKEN_LATENCY_BUCKETS)

        self.running = Gauge(PREFIX + "num_requests_running", "Sequences in the running batch.", registry=r)
        self.waiting = Gauge(PREFIX + "num_requests_waiting", "Sequences waiting to be scheduled.", registry=r)
        self.kv_cache_usage = Gauge(PREFIX + "kv_cache_usage_ratio", "Share of KV-cache blocks in use (0..1).",
                                    registry=r)

        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens generated.", registry=r)
        self.finished = Counter(PREFIX + "finished_sequences", "Sequences (choices) that ended, by finish reason.",
                                ["finish_reason"], registry=r)
        self.requests = Counter(PREFIX + "http_requests", "HTTP requests answered, by endpoint and status code.",
                                ["endpoint", "status"], registry=r)
        self.preemptions = Counter(PREFIX + "preemptions", "Sequences preempted for lack of KV blocks.", registry=r)
        self.interrupted_steps = Counter(PREFIX + "interrupted_steps", "Steps stopped between layers for an arriving "
                                         "request that outranks them (--scheduling-policy priority).", registry=r)
        self.aborted = Counter(PREFIX + "aborted_requests", "Requests aborted because the client went away.",
                               registry=r)
        self.timed_out = Counter(PREFIX + "timed_out_requests", "Requests aborted at --request-timeout.",
                                 registry=r)
        self.rejected = Counter(PREFIX + "rejected_requests", "Requests refused before generation, by reason.",
                                ["reason"], registry=r)
        self.engine_requests = Counter(PREFIX + "engine_requests", "Requests handed to the engine (result-cache "
                                       "hits and requests sharing an identical one in flight are not).", registry=r)
        self.result_cache_shared = Counter(PREFIX + "result_cache_shared", "Requests that joined an identical "
                                           "deterministic request already in flight (single-flight).", registry=r)
        self.quality_perplexity = Gauge(PREFIX + "quality_perplexity",
                                        "Perplexity of the served model on the validation slice (quality watch).",
                                        registry=r)
        self.quality_reference = Gauge(PREFIX + "quality_reference_perplexity",
                                       "The full-precision model's perplexity on the same slice.", registry=r)
        self.quality_change = Gauge(PREFIX + "quality_perplexity_change_ratio",
                                    "quality_perplexity / quality_reference_perplexity - 1.", registry=r)
        self.safety_input = Counter(PREFIX + "safety_input_matches", "Input-filter rule matches, by rule and action "
                                    "(block, flag, redact).", ["rule", "action"], registry=r)
        self.input_filter_seconds = Histogram(PREFIX + "input_filter_seconds", "Input-filter time per text checked.",
                                              buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05),
                                              registry=r)
        self.guard_verdict_seconds = Histogram(
            PREFIX + "semantic_guard_verdict_seconds", "Time from a request's arrival to the semantic input guard's "
            "verdict on its prompt (the end of its prefill).",
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 7.5,
                     10.0, 15.0, 20.0, 30.0, 60.0), registry=r)
        self.rate_limited = Counter(PREFIX + "rate_limited_requests", "Requests refused by a rate limit, by limit "
                                    "(requests, tokens).", ["limit"], registry=r)
        self.guard_checks = Counter(PREFIX + "guard_checks", "Continuations the output guard scored.", registry=r)
        self.guard_kl = Histogram(PREFIX + "guard_mean_kl", "Mean per-token KL(served || reference) of each check.",
                                  buckets=(0.001, 0.01, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.0, 5.0), registry=r)
        self.guard_anomalies = Counter(PREFIX + "guard_anomalies", "First answers over the guard's KL threshold.",
                                       registry=r)
        self.guard_resamples = Counter(PREFIX + "guard_resamples", "Generations retried for an anomalous answer.",
                                       registry=r)
        self.guard_resample_successes = Counter(PREFIX + "guard_resample_successes",
                                                "Anomalous answers replaced by a retry under the threshold.",
                                                registry=r)
        self.guard_skipped = Counter(PREFIX + "guard_skipped", "Answers served unchecked: no KV room to score them.",
                                     registry=r)
        self.guard_flagged = Counter(PREFIX + "guard_flagged", "Answers served flagged: every try anomalous.",
                                     registry=r)
        self.guard_abnormal_ratio = Gauge(PREFIX + "guard_abnormal_output_ratio",
                                          "Anomalous first answers / first answers checked.", registry=r)
        self.safety_output = Counter(PREFIX + "safety_output_matches", "Output-filter rule matches, by rule and "
                                     "action.", ["rule", "action"], registry=r)
        self.quality_checks = Counter(PREFIX + "quality_checks", "Quality checks completed.", registry=r)
        self.quality_last_check = Gauge(PREFIX + "quality_last_check_timestamp_seconds",
                                        "Unix time of the last quality check.", registry=r)
        self.cascade_routes = Counter(PREFIX + "cascade_requests", "Engine requests of a cascade, by the model that "
                                      "answered (small, large).", ["route"], registry=r)
        self.cascade_confidence = Histogram(PREFIX + "cascade_confidence", "The small model's mean token "
                                            "log-probability on which each cascade route was decided.",
                                            buckets=(-4.0, -3.0, -2.0, -1.5, -1.0, -0.8, -0.6, -0.4, -0.2, -0.1, 0.0),
                                            registry=r)
        self._preemptions_seen = 0

    def bind_engine(self, running: Callable[[], float], waiting: Callable[[], float],
                    kv_usage: Callable[[], float], prefix_cache: Callable[[], PrefixCacheStats],
                    memory: Callable[[], dict[str, int]] | None = None) -> None:
        """Read the engine gauges, the prefix cache's counters and the engine's memory at scrape time."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)
        self.kv_cache_usage.set_function(kv_usage)
        self.registry.register(_PrefixCacheCollector(prefix_cache))
        if memory is not None:
            self.registry.register(_MemoryCollector(memory))

    def bind_kv_tiers(self, stats: Callable[[], dict[str, dict] | None]) -> None:
        """Export the KV tiers below RAM (`--kv-offload-dir`: "disk"), by tier, read at scrape time."""
        self.registry.register(_KVTierCollector(stats))

    def bind_speculation(self, stats: Callable[[], SpeculationStats | None]) -> None:
        """Export speculative decoding's counters (drafts proposed and kept), read at scrape time."""
        self.registry.register(_SpeculationCollector(stats))

    def bind_semantic_guard(self, counts: Callable[[], dict[str, int]]) -> None:
        """The semantic input guard's verdicts (pass, flag, block), read at scrape time."""
        self.registry.register(_GuardCollector(counts))

    def bind_cascade_small(self, running: Callable[[], float], waiting: Callable[[], float],
                           kv_usage: Callable[[], float]) -> None:
        """A cascade's small engine: its batch, queue and KV use, read at scrape time."""
        for name, doc, read in (
                ("cascade_small_num_requests_running", "Sequences in the small model's running batch.", running),
                ("cascade_small_num_requests_waiting", "Sequences waiting for the small model.", waiting),
                ("cascade_small_kv_cache_usage_ratio", "Share of the small model's KV blocks in use (0..1).",
                 kv_usage)):
            Gauge(PREFIX + name, doc, registry=self.registry).set_function(read)

    def bind_result_cache(self, cache) -> None:
        """Export the result cache's counters and size, read at scrape time."""
        self.registry.register(_ResultCacheCollector(cache))

    def observe_guard_check(self, mean_kl: float) -> None:
        self.guard_checks.inc()
        self.guard_kl.observe(mean_kl)

    def observe_quality(self, perplexity: float, reference: float) -> None:
        """Called from the engine thread after each quality check."""
        self.quality_perplexity.set(perplexity)
        self.quality_reference.set(reference)
        self.quality_change.set(perplexity / reference - 1)
        self.quality_checks.inc()
        self.quality_last_check.set(time.time())

    def observe_step(self, step: StepStats, seconds: float, preemptions: int) -> None:
        """Called from the engine thread after every step (prometheus-client is thread-safe)."""
        if step.interrupted:  # its time and rows were spent on nothing: counted apart
            self.interrupted_steps.inc()
            return
        self.step_batch_size.observe(step.num_seqs)
        self.step_tokens.observe(step.num_tokens)
        self.step_duration.observe(seconds)
        if preemptions > self._preemptions_seen:
            self.preemptions.inc(preemptions - self._preemptions_seen)
            self._preemptions_seen = preemptions

    def track(self) -> RequestTracker:
        return RequestTracker(self)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {sample name: {sorted label pairs: value}}, by prometheus-client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, dict[tuple, float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


class NullTracker:
    """A result-cache hit's tracker: no engine ran, so there is nothing to record."""

    def on_output(self, output: RequestOutput) -> None:
        pass

    def finish(self, outcome: str = "ok") -> None:
        pass


class RequestTracker:
    """Follows one engine request's outputs and records its metrics once, when it ends."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.last: RequestOutput | None = None
        self._last_seen: float | None = None
        self._tokens_seen = 0

    def on_output(self, output: RequestOutput) -> None:
        now = time.monotonic()
        tokens = sum(len(c.token_ids) for c in output.outputs)
        if self._last_seen is not None and tokens > self._tokens_seen:
            gap = (now - self._last_seen) / (tokens - self._tokens_seen)
            for _ in range(tokens - self._tokens_seen):
                self.metrics.inter_token_latency.observe(gap)
        if tokens > self._tokens_seen:
            self._last_seen, self._tokens_seen = now, tokens
        self.last = output

    def finish(self, outcome: str = "ok") -> None:
        """outcome: ok, aborted (client went away) or timeout."""
        m = self.metrics
        if outcome == "aborted":
            m.aborted.inc()
        elif outcome == "timeout":
            m.timed_out.inc()
        out = self.last
        if out is None:
            return
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(sum(len(c.token_ids) for c in out.outputs))
        t = out.metrics
        if t.first_scheduled_time is not None:
            m.queue_time.observe(t.first_scheduled_time - t.arrival_time)
        if t.first_token_time is not None:
            m.time_to_first_token.observe(t.first_token_time - t.arrival_time)
        if t.guard_verdict_time is not None:
            m.guard_verdict_seconds.observe(t.guard_verdict_time - t.arrival_time)
        if not out.finished or t.finished_time is None:
            return
        for completion in out.outputs:
            m.finished.labels(finish_reason=completion.finish_reason or "abort").inc()
        m.e2e_latency.observe(t.finished_time - t.arrival_time)
        num_tokens = max(len(c.token_ids) for c in out.outputs)
        if num_tokens > 1 and t.first_token_time is not None:
            m.time_per_output_token.observe((t.finished_time - t.first_token_time) / (num_tokens - 1))


class _PrefixCacheCollector:
    """The engine's cumulative prefix-cache counts, read at scrape time."""

    def __init__(self, stats: Callable[[], PrefixCacheStats]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
        yield CounterMetricFamily(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                                  value=stats.queries)
        yield CounterMetricFamily(PREFIX + "prefix_cache_hits", "Prompt tokens found in the prefix cache (their "
                                  "KV reused, not computed).", value=stats.hits)


class _KVTierCollector:
    """Each KV tier's cumulative counts (engine/kv_tiers/): blocks and bytes written and read, the seconds they took
    (a mean latency is their rate's ratio), files refused and dropped, and what the tier holds."""

    COUNTERS = (("stored_blocks", "Blocks written to the tier."), ("stored_bytes", "Payload bytes written."),
                ("store_seconds", "Seconds spent writing blocks (off the step)."),
                ("store_errors", "Writes that failed (a full disk, say); the block is dropped."),
                ("dropped_blocks", "Spills not written because the write queue was full."),
                ("loaded_blocks", "Blocks read back from the tier."), ("loaded_bytes", "Payload bytes read."),
                ("load_seconds", "Seconds spent reading and checking blocks (off the step)."),
                ("restored_blocks", "Blocks read back and put into the KV pool."),
                ("rejected_files", "Truncated, corrupt or foreign files found, deleted and never used."),
                ("evicted_files", "Files dropped to stay within the tier's size."))

    def __init__(self, stats: Callable[[], dict[str, dict] | None]) -> None:
        self.stats = stats

    def collect(self):
        tiers = self.stats() or {}
        for name, doc in self.COUNTERS:
            family = CounterMetricFamily(PREFIX + "kv_tier_" + name, doc, labels=["tier"])
            for tier, stats in tiers.items():
                family.add_metric([tier], stats[name])
            yield family
        for name, doc in (("files", "Block files the tier holds."), ("disk_bytes", "Bytes the tier holds.")):
            family = GaugeMetricFamily(PREFIX + "kv_tier_" + name, doc, labels=["tier"])
            for tier, stats in tiers.items():
                family.add_metric([tier], stats[name])
            yield family


class _GuardCollector:
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self.counts = counts

    def collect(self):
        family = CounterMetricFamily(PREFIX + "semantic_guard_verdicts", "Prompts the semantic input guard judged, "
                                     "by verdict (block: ended before its first token; flag: at or over the "
                                     "threshold and served).", labels=["verdict"])
        for verdict, count in self.counts().items():
            family.add_metric([verdict], count)
        yield family


class _SpeculationCollector:
    """Speculative decoding's cumulative counts (vLLM's spec_decode_* names), read at scrape time."""

    def __init__(self, stats: Callable[[], SpeculationStats | None]) -> None:
        self.stats = stats

    def collect(self):
        stats = self.stats()
        if stats is None:
            return
        yield CounterMetricFamily(PREFIX + "spec_decode_num_drafts", "Verifications of drafted tokens (one per "
                                  "request and step).", value=stats.num_drafts)
        yield CounterMetricFamily(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens proposed.",
                                  value=stats.num_draft_tokens)
        yield CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens kept.",
                                  value=stats.num_accepted_tokens)
        per_position = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                           "Draft tokens kept, by position in the draft (0: the first).",
                                           labels=["position"])
        for position, count in enumerate(stats.accepted_per_position):
            per_position.add_metric([str(position)], count)
        yield per_position
        yield GaugeMetricFamily(PREFIX + "spec_decode_mean_accepted_length", "Tokens a verification yields on "
                                "average (kept drafts and the model's own token).", value=stats.mean_accepted_length)


class _MemoryCollector:
    """The engine's memory by part: weights, the KV pool reserved, and the part of the pool ever written."""

    def __init__(self, memory: Callable[[], dict[str, int]]) -> None:
        self.memory = memory

    def collect(self):
        family = GaugeMetricFamily(PREFIX + "memory_bytes", "Engine memory by part: weights, kv_pool (reserved; "
                                   "mapped lazily), kv_pool_touched (the part ever written, so resident).",
                                   labels=["part"])
        for part, value in self.memory().items():
            family.add_metric([part], value)
        yield family


class _ResultCacheCollector:
    def __init__(self, cache) -> None:
        self.cache = cache

    def collect(self):
        stats = self.cache.stats
        for name, doc, value in (("hits", "Requests answered from the result cache.", stats.hits),
                                 ("misses", "Cacheable requests not found in the result cache.", stats.misses),
                                 ("evictions", "Result-cache entries evicted from memory (LRU).", stats.evictions)):
            yield CounterMetricFamily(PREFIX + "result_cache_" + name, doc, value=value)
        yield GaugeMetricFamily(PREFIX + "result_cache_bytes", "Bytes the result cache holds in memory.",
                                value=self.cache.bytes)
        yield GaugeMetricFamily(PREFIX + "result_cache_entries", "Entries the result cache holds in memory.",
                                value=len(self.cache))
