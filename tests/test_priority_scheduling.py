"""The priority policy on a tiny fake KV spec: who is admitted, who is preempted for whom, how owners share the
budget, with exact request ids and block ids."""

from __future__ import annotations

import pytest

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.priority_scheduling import PriorityScheduler, build_scheduler
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import Scheduler
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams


def make(num_blocks: int = 32, max_num_seqs: int = 8, budget: int = 64, policy: str = "priority") -> Scheduler:
    kv = KVCacheManager(num_blocks=num_blocks, block_size=4, enable_prefix_caching=False)
    sched = build_scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy),
                            kv)
    assert isinstance(sched, PriorityScheduler) == (policy == "priority") and isinstance(sched, Scheduler)
    return sched


def request(rid: str, priority: int = 0, owner: str = "", tokens: int = 4, arrival: float = 0.0) -> Request:
    return Request(rid, list(range(1, tokens + 1)), SamplingParams(max_tokens=8, ignore_eos=True),
                   arrival_time=arrival, priority=priority, owner=owner)


def ids(out) -> list[str]:
    return [s.request.request_id for s in out.scheduled]


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = make(max_num_seqs=2)
    for rid, priority, arrival in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0)):
        sched.add_request(request(rid, priority, arrival=arrival))
    assert ids(sched.schedule()) == ["b", "d"]
    fcfs = make(max_num_seqs=2, policy="fcfs")
    for rid, priority, arrival in (("a", 5, 1.0), ("b", 0, 2.0), ("c", 1, 3.0), ("d", 0, 4.0)):
        fcfs.add_request(request(rid, priority, arrival=arrival))
    assert ids(fcfs.schedule()) == ["a", "b"]


def test_a_higher_priority_arrival_preempts_the_worst_running_request_and_an_equal_one_does_not():
    sched = make(max_num_seqs=2)
    low1, low2 = request("low1", 5, arrival=1.0), request("low2", 5, arrival=2.0)
    sched.add_request(low1)
    sched.add_request(low2)
    sched.schedule()
    assert low2.block_ids == [1]
    sched.add_request(request("same", 5, arrival=3.0))
    out = sched.schedule()
    assert ids(out) == ["low1", "low2"] and out.preempted == []
    sched.add_request(request("high", 0, arrival=4.0))
    out = sched.schedule()
    # high goes first, alone (its prompt runs: nothing worse shares the step); low2 (the worst: priority 5,
    # latest) gives up its sequence slot and block 1
    assert ids(out) == ["high"] and [r.request_id for r in out.preempted] == ["low2"]
    assert sched.running[-1].block_ids == [1] and low2.block_ids == [] and low2.num_computed_tokens == 0


def test_owners_share_the_token_budget_in_turn():
    sched = make(budget=8)
    for i in range(6):
        sched.add_request(request(f"heavy{i}", owner="heavy", arrival=float(i)))
    sched.add_request(request("light", owner="light", arrival=10.0))
    assert ids(sched.schedule()) == ["heavy0", "light"]  # 4 tokens each; FCFS would give heavy1 the second half
    fcfs = make(budget=8, policy="fcfs")
    for i in range(6):
        fcfs.add_request(request(f"heavy{i}", owner="heavy", arrival=float(i)))
    fcfs.add_request(request("light", owner="light", arrival=10.0))
    assert ids(fcfs.schedule()) == ["heavy0", "heavy1"]


def test_a_running_request_short_of_blocks_preempts_the_worst_one_not_yet_scheduled():
    sched = make(num_blocks=2, max_num_seqs=2)
    bad = request("bad", 3, arrival=1.0)
    sched.add_request(bad)
    sched.update(sched.schedule(), {"bad": [7]})
    good = request("good", 0, arrival=2.0)
    sched.add_request(good)
    out = sched.schedule()
    assert ids(out) == ["good"] and bad.block_ids == [0] and good.block_ids == [1]  # bad sits out good's prompt
    sched.update(out, {"good": [7]})
    out = sched.schedule()  # good's fifth token needs a second block: bad (worse) gives back block 0
    assert ids(out) == ["good"] and [r.request_id for r in out.preempted] == ["bad"]
    assert good.block_ids == [1, 0] and bad.block_ids == []


def test_an_unknown_policy_is_a_named_error():
    with pytest.raises(ValueError, match="unknown scheduling policy 'lifo'; choose fcfs or priority"):
        SchedulerConfig(policy="lifo")


def test_priorities_reach_the_engine_and_every_block_comes_back(llama_dir):
    llm = LLM(str(llama_dir), policy="priority", max_num_seqs=1)
    engine = llm.engine
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    engine.add_request("later", [5, 6, 7], params, priority=9)
    engine.add_request("first", [8, 9, 10], params, priority=-1)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step(emit_unfinished=False)]
    assert order == ["first", "later"]
    assert engine.num_free_blocks == engine.num_blocks


def test_a_high_priority_request_over_http_overtakes_a_queue_of_low_ones(llama_dir):
    import asyncio

    import httpx
    import openai

    from tests.live_server import MODEL_NAME, live_server, wait_until

    with live_server(llama_dir, engine_options={"policy": "priority", "max_num_seqs": 1}) as server:
        bad = httpx.post(server.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "x", "priority": "high"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "priority"
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none")
        engine = server.state.engine.engine
        finished = []

        async def ask(name: str, priority: int, tokens: int) -> None:
            await client.completions.create(model=MODEL_NAME, prompt=f"count {name}", max_tokens=tokens, temperature=0,
                                            extra_body={"priority": priority, "ignore_eos": True})
            finished.append(name)

        async def run() -> None:
            lows = [asyncio.create_task(ask(f"low{i}", 5, 300)) for i in range(4)]
            await asyncio.to_thread(wait_until, lambda: engine.num_waiting_seqs == 3, 30, "three queued requests")
            await asyncio.gather(ask("high", 0, 8), *lows)

        asyncio.run(run())
        assert finished[0] == "high" and sorted(finished[1:]) == ["low0", "low1", "low2", "low3"]
        server.wait_idle()
        assert engine.num_free_blocks == engine.num_blocks


def test_an_arrival_outranks_the_step_in_flight_only_with_a_better_rank():
    sched = make()
    assert not sched.outranks_step(0, "")  # no step in flight
    sched.add_request(request("low", 5))
    sched.schedule()
    assert sched.outranks_step(4, "") and not sched.outranks_step(5, "") and not sched.outranks_step(9, "")
    fcfs = make(policy="fcfs")
    fcfs.add_request(request("low", 5))
    fcfs.schedule()
    assert not fcfs.outranks_step(0, "")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_owner_shares_decay_with_their_half_life_and_name_the_owners_behind():
    from llmaccel.engine.owner_shares import OwnerShares

    clock = Clock()
    shares = OwnerShares(half_life_s=2.0, clock=clock)
    shares.record({"heavy": 100, "light": 10})
    assert shares.behind({"heavy", "light"}) == {"light"}  # 10 < 0.5 * 55
    assert shares.behind({"heavy"}) == frozenset() and shares.behind({"light", "new"}) == {"new"}
    clock.now = 2.0
    shares.record({"light": 40})
    assert shares.served("heavy") == 50.0 and shares.served("light") == 45.0
    assert shares.behind({"heavy", "light"}) == frozenset()  # about equal: nobody is behind
    clock.now = 20.0
    shares.record({})
    assert shares.served("heavy") == 0.0  # under half a token after ten half-lives: forgotten


def test_a_light_owner_behind_its_share_runs_its_prompt_before_the_heavy_owners_rows_and_outranks_them():
    sched = make(budget=64)
    heavy = [request(f"heavy{i}", owner="heavy", arrival=float(i)) for i in range(3)]
    for r in heavy:
        sched.add_request(r)
    out = sched.schedule()
    sched.update(out, {r.request_id: [7] for r in heavy})  # heavy is served 12 tokens, light nothing yet
    assert not sched.outranks_step(0, "heavy") and sched.outranks_step(0, "light")  # light is not among the ahead
    sched.add_request(request("light", owner="light", arrival=10.0))
    out = sched.schedule()
    assert ids(out) == ["light"]  # its prompt alone: heavy's decode rows wait a step
    sched.update(out, {"light": [7]})
    # 4 tokens against heavy's 12 is no longer under half the mean: the owners take turns again, everyone decodes
    assert ids(sched.schedule()) == ["heavy0", "light", "heavy1", "heavy2"]


def test_fair_share_stops_steps_from_a_bucket_that_refills_and_priorities_always():
    from llmaccel.engine.priority_scheduling import FAIR_STOPS, FAIR_STOPS_PER_S

    clock = Clock()
    kv = KVCacheManager(num_blocks=32, block_size=4, enable_prefix_caching=False)
    sched = PriorityScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="priority"), kv,
                              clock=clock)
    heavy = [request(f"heavy{i}", priority=5, owner="heavy", arrival=float(i)) for i in range(3)]
    for r in heavy:
        sched.add_request(r)
    sched.update(sched.schedule(), {r.request_id: [7] for r in heavy})
    sched.schedule()  # heavy decodes: the step in flight; any new key is behind
    assert FAIR_STOPS == 2 and all(sched.outranks_step(5, f"new{i}") for i in range(2))  # arrivals together
    assert not sched.outranks_step(5, "new2")  # a stream of new keys: not every step is thrown away
    assert sched.outranks_step(4, "new3") and sched.outranks_step(0, "new4")  # a better priority always stops it
    clock.now = 1 / FAIR_STOPS_PER_S
    assert sched.outranks_step(5, "new2") and not sched.outranks_step(5, "new5")
