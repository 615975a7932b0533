"""A bounded soak in CI: identical passes with disconnects, client timeouts and identical requests in
flight lose nothing, every gauge returns to zero after each pass and no KV block is leaked."""

from __future__ import annotations

import asyncio

from llmaccel.bench.soak import SoakConfig, format_table, plan, run_pass
from tests.live_server import live_server, metric

CONFIG = SoakConfig(requests=60, concurrency=24, disconnect_share=0.33, timeout_share=0.15, client_timeout_s=0.05,
                    duplicate_groups=3, duplicate_size=4, max_tokens=24)


def test_every_pass_has_the_same_mix_and_new_duplicate_groups():
    first, second = plan(CONFIG, 0), plan(CONFIG, 1)
    kinds = [kind for kind, _ in first]
    assert kinds == [kind for kind, _ in second] and len(kinds) == 60 + 3 * 4
    assert {"read", "disconnect", "timeout"} <= set(kinds) and kinds.count("duplicate-0") == 4
    duplicates = {body["messages"][0]["content"] for kind, body in first if kind.startswith("duplicate")}
    assert len(duplicates) == 3 and all("soak pass 0" in text for text in duplicates)


def test_soak_passes_lose_nothing_and_leave_every_gauge_at_zero(llama_dir):
    with live_server(llama_dir, result_cache=True, engine_options={"num_kv_blocks": 96}) as server:
        passes = [asyncio.run(run_pass(server.url, CONFIG, i, settle_s=60)) for i in range(3)]
        print("\n" + format_table(passes))
        for p in passes:
            assert p.outcomes["lost"] == 0, p.lost_details
            assert p.settled and p.gauges == {"num_requests_running": 0, "num_requests_waiting": 0,
                                              "kv_cache_usage_ratio": 0}
            planned = [kind for kind, _ in plan(CONFIG, p.index)]
            assert p.outcomes["disconnected"] == planned.count("disconnect")
            # a client that gave up may have seen its answer finish first; none is refused or lost
            assert p.outcomes["timed_out"] + p.outcomes["completed"] == len(planned) - planned.count("disconnect")
            assert 0 < p.memory["kv_pool_touched"] <= p.memory["kv_pool"]
        server.wait_idle()  # no request left in the engine, every KV block free
        assert metric(server, "llmaccel_aborted_requests_total") >= 3 * CONFIG.requests * CONFIG.disconnect_share / 2
        # each group of identical requests ran once in the engine: the others shared its flight or, once it
        # was stored, were answered from the result cache
        answered_without_engine = (metric(server, "llmaccel_result_cache_shared_total")
                                   + metric(server, "llmaccel_result_cache_hits_total"))
        assert answered_without_engine == 3 * CONFIG.duplicate_groups * (CONFIG.duplicate_size - 1)
