"""`GET /v1/llmaccel/stats`: the numbers a dashboard draws, as one JSON object.

They come from the server's own Prometheus registry, so the page and a Prometheus scrape can never
disagree, and serving records nothing extra: a request to this endpoint reads the registry at most
once per `min_interval_s` into a short ring of snapshots. Rates are the change between the newest
snapshot and the oldest one inside `rate_window_s`; latency percentiles come from the change of
each latency histogram's buckets inside `latency_window_s`, interpolated within a bucket as
Prometheus' histogram_quantile does. Until two snapshots exist, rates and window percentiles are
null, not zero.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]  # sample name -> labels -> value

P = "llmaccel_"
LATENCIES = {"ttft": "time_to_first_token_seconds", "tpot": "time_per_output_token_seconds",
             "itl": "inter_token_latency_seconds", "e2e": "e2e_request_latency_seconds",
             "queue": "request_queue_time_seconds"}
QUANTILES = (0.5, 0.9, 0.99)


def read_samples(registry: CollectorRegistry) -> Samples:
    samples: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            samples.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return samples


def total(samples: Samples, name: str) -> float:
    """The sum of a sample over all its label sets (0 when absent)."""
    return sum(samples.get(name, {}).values())


def by_label(samples: Samples, name: str, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for labels, value in samples.get(name, {}).items():
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """q-quantile of cumulative (upper bound, count) buckets, sorted by bound; None without
    observations. Linear within a bucket; the +Inf bucket answers its lower bound."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            width = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / width if width else 1.0)
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_buckets(samples: Samples, metric: str) -> list[tuple[float, float]]:
    rows = [(float(dict(labels)["le"]), value) for labels, value in samples.get(P + metric + "_bucket", {}).items()]
    return sorted(rows)


@dataclass(frozen=True)
class Snapshot:
    time: float  # time.monotonic()
    samples: Samples


class DashboardStats:
    def __init__(self, registry: CollectorRegistry, engine_info: dict, min_interval_s: float = 0.5,
                 rate_window_s: float = 10.0, latency_window_s: float = 60.0) -> None:
        self.registry = registry
        self.engine_info = engine_info
        self.min_interval_s = min_interval_s
        self.rate_window_s = rate_window_s
        self.latency_window_s = latency_window_s
        self._ring: deque[Snapshot] = deque()
        self._lock = threading.Lock()

    def _sample(self) -> Snapshot:
        now = time.monotonic()
        with self._lock:
            if not self._ring or now - self._ring[-1].time >= self.min_interval_s:
                self._ring.append(Snapshot(now, read_samples(self.registry)))
            while len(self._ring) > 2 and now - self._ring[1].time > self.latency_window_s:
                self._ring.popleft()
            return self._ring[-1]

    def _oldest_within(self, window_s: float, newest: Snapshot) -> Snapshot | None:
        for snapshot in self._ring:  # oldest first
            if newest.time - snapshot.time <= window_s and snapshot is not newest:
                return snapshot
        return self._ring[-2] if len(self._ring) >= 2 else None  # polled less often than the window

    def report(self) -> dict:
        new = self._sample()
        s = new.samples
        with self._lock:
            then = self._oldest_within(self.rate_window_s, new)
            lat = self._oldest_within(self.latency_window_s, new)

        def rate(name: str) -> float | None:
            if then is None:
                return None
            return (total(s, name) - total(then.samples, name)) / (new.time - then.time)

        queries, hits = total(s, P + "prefix_cache_queries_total"), total(s, P + "prefix_cache_hits_total")
        window_hit_rate = None
        if then is not None:
            dq = queries - total(then.samples, P + "prefix_cache_queries_total")
            dh = hits - total(then.samples, P + "prefix_cache_hits_total")
            window_hit_rate = dh / dq if dq > 0 else None
        latency = {}
        for key, metric in LATENCIES.items():
            now_buckets = histogram_buckets(s, metric)
            entry: dict[str, float | None] = {}
            if lat is not None:
                old = dict(histogram_buckets(lat.samples, metric))
                delta = [(bound, count - old.get(bound, 0.0)) for bound, count in now_buckets]
                for q in QUANTILES:
                    value = histogram_quantile(q, delta)
                    entry[f"p{round(q * 100)}_ms"] = None if value is None else value * 1000
                entry["count"] = delta[-1][1] if delta else 0.0
            else:
                entry = {f"p{round(q * 100)}_ms": None for q in QUANTILES} | {"count": 0.0}
            latency[key] = entry
        change = s.get(P + "quality_perplexity_change_ratio", {})
        return {
            "time": time.time(),
            "windows_s": {"rates": self.rate_window_s if then is None else round(new.time - then.time, 3),
                          "latency": self.latency_window_s if lat is None else round(new.time - lat.time, 3)},
            "rates": {"output_tokens_per_s": rate(P + "generation_tokens_total"),
                      "prompt_tokens_per_s": rate(P + "prompt_tokens_total"),
                      "requests_per_s": rate(P + "e2e_request_latency_seconds_count")},
            "engine": {"running": total(s, P + "num_requests_running"),
                       "waiting": total(s, P + "num_requests_waiting"),
                       "kv_cache_usage": total(s, P + "kv_cache_usage_ratio")},
            "prefix_cache": {"hit_rate": window_hit_rate, "hit_rate_total": hits / queries if queries else None,
                             "hit_tokens_total": hits, "queried_tokens_total": queries},
            "latency": latency,
            "kv_tiers": kv_tiers(s),
            "totals": {"requests_finished": total(s, P + "e2e_request_latency_seconds_count"),
                       "generation_tokens": total(s, P + "generation_tokens_total"),
                       "preemptions": total(s, P + "preemptions_total"),
                       "interrupted_steps": total(s, P + "interrupted_steps_total"),
                       "rejected": by_label(s, P + "rejected_requests_total", "reason"),
                       "rate_limited": by_label(s, P + "rate_limited_requests_total", "limit"),
                       "aborted": total(s, P + "aborted_requests_total"),
                       "timed_out": total(s, P + "timed_out_requests_total"),
                       "guard_anomalies": total(s, P + "guard_anomalies_total"),
                       "guard_checks": total(s, P + "guard_checks_total"),
                       "input_filter_matches": by_label(s, P + "safety_input_matches_total", "action"),
                       "result_cache_hits": total(s, P + "result_cache_hits_total")},
            "quality": {"perplexity_change_ratio": next(iter(change.values())) if change else None},
            "config": self.engine_info,
        }


def kv_tiers(s: Samples) -> dict[str, dict]:
    """Each KV tier below RAM (--kv-offload-dir: "disk"): blocks written, read and refused, what it holds, and
    the mean time to write and to read a block."""
    tiers: dict[str, dict] = {}
    for name in ("stored_blocks", "loaded_blocks", "restored_blocks", "rejected_files", "store_errors", "files",
                 "disk_bytes", "store_seconds", "load_seconds"):
        metric = P + "kv_tier_" + name + ("" if name in ("files", "disk_bytes") else "_total")
        for tier, value in by_label(s, metric, "tier").items():
            tiers.setdefault(tier, {})[name] = value
    for stats in tiers.values():
        for kind, blocks in (("store", "stored_blocks"), ("load", "loaded_blocks")):
            seconds = stats.pop(f"{kind}_seconds", 0.0)
            stats[f"mean_{kind}_ms"] = 1000 * seconds / stats[blocks] if stats.get(blocks) else None
    return tiers


def engine_summary(engine, model_names: list[str]) -> dict:
    """The engine's configuration at a glance, for the dashboard's header."""
    config = engine.config
    return {"models": list(model_names), "device": str(engine.device),
            "dtype": str(engine.dtype).removeprefix("torch."),
            "quantization": config.model.quantization, "max_model_len": engine.max_model_len,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
            "kv_blocks": engine.num_blocks, "block_size": config.cache.block_size,
            "prefix_caching": config.cache.enable_prefix_caching, "kv_window": config.cache.kv_window,
            "speculative": config.speculative.speculative_method}
