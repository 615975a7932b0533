"""The replicas' engine figures and the routers' own, on the ingress's /metrics.

Per-replica series carry a `replica` label (Ray Serve's replica id); the unlabelled engine series
the single-process server exports (llmaccel_num_requests_running, llmaccel_prefix_cache_hits, ...)
are the sums over the live replicas.
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from llmaccel.cluster import routing
from llmaccel.server.metrics import PREFIX

_REPLICA_GAUGES = (("running", "replica_num_requests_running", "Sequences in the replica's running batch."),
                   ("waiting", "replica_num_requests_waiting", "Sequences waiting in the replica's engine."),
                   ("kv_cache_usage", "replica_kv_cache_usage_ratio", "Share of the replica's KV blocks in use."))
_REPLICA_COUNTERS = (("prefix_queries", "replica_prefix_cache_queries", "Prompt tokens the replica looked up."),
                     ("prefix_hits", "replica_prefix_cache_hits", "Prompt tokens found in the replica's cache."),
                     ("requests", "replica_requests", "Requests the replica received."),
                     ("generated_tokens", "replica_generation_tokens", "Tokens the replica generated."),
                     ("preemptions", "replica_preemptions", "Sequences the replica's scheduler preempted."))


class ClusterCollector:
    def __init__(self, engine) -> None:
        self.engine = engine  # a ReplicatedEngine: replica_stats is refreshed every second

    def collect(self):
        stats = self.engine.replica_stats
        yield GaugeMetricFamily(PREFIX + "replicas", "Engine replicas reporting.", value=len(stats))
        info = GaugeMetricFamily(PREFIX + "replica_info", "One per live replica: its process id.",
                                 labels=["replica", "pid"])
        for replica, s in sorted(stats.items()):
            info.add_metric([replica, str(s.get("pid", ""))], 1)
        yield info
        for key, name, doc in _REPLICA_GAUGES:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=["replica"])
            for replica, s in sorted(stats.items()):
                family.add_metric([replica], s.get(key, 0))
            yield family
        for key, name, doc in _REPLICA_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=["replica"])
            for replica, s in sorted(stats.items()):
                family.add_metric([replica], s.get(key, 0))
            yield family
        routed = routing.ROUTER_STATS
        with routed.lock:
            decisions = dict(routed.decisions)
            matched, blocks, retries = routed.matched_blocks, routed.prompt_blocks, routed.retries
        family = CounterMetricFamily(PREFIX + "router_decisions", "Requests routed, by router and reason "
                                     "(affinity: to the replica holding the prefix; balance: a holder was too "
                                     "busy; no_match: nobody held it).", labels=["router", "reason"])
        for (router, why), count in sorted(decisions.items()):
            family.add_metric([router, why], count)
        yield family
        yield CounterMetricFamily(PREFIX + "router_matched_blocks", "Prompt KV blocks the chosen replica held "
                                  "when the request was routed (cache-aware router).", value=matched)
        yield CounterMetricFamily(PREFIX + "router_prompt_blocks", "Full prompt KV blocks routed "
                                  "(cache-aware router).", value=blocks)
        yield CounterMetricFamily(PREFIX + "router_retries", "Requests sent again because their replica stopped "
                                  "before answering.", value=retries)
