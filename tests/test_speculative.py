"""Speculative decoding: the drafters, the verification rule, the 1 + K slots and their rollback, and
the engine's output, which must stay the target's own (greedy: HF's token ids; sampling: its law)."""

from __future__ import annotations

import json
import shutil
from collections import Counter

import pytest
import torch

from llmaccel.config import SchedulerConfig
from llmaccel.engine.kv_cache_manager import KVCacheManager
from llmaccel.engine.request import Request
from llmaccel.engine.scheduler import Scheduler
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.spec.draft_vocab import frequent_tokens, write_token_counts
from llmaccel.spec.ngram import propose_ngram
from llmaccel.spec.policy import SpeculationPolicy
from llmaccel.spec.verify import accepted_greedy, accepted_sampled
from tests.test_matches_hf import PROMPTS
from tests.tiny_models import build_tokenizer, hf_greedy, make_tiny_model

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
ALWAYS = dict(speculative_max_batch=1000)  # speculate in every step (the measured policy has its own test)
REPEATING = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick"


# ---- the drafters and the rule, alone ------------------------------------------------------------
def test_ngram_copies_what_followed_the_latest_earlier_match_of_the_longest_suffix():
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3, 8, 5, 1, 2, 3], 3, 2, 4) == [8, 5, 1]  # latest "1 2 3"
    assert propose_ngram([4, 1, 2, 7, 1, 2], 5, 2, 4) == [7, 1, 2]  # what there is, up to the end
    assert propose_ngram([5, 6, 7, 8, 6, 7], 2, 3, 4) == []  # "6 7" is too short a match for min 3
    assert propose_ngram([5, 6, 7, 8, 6, 7], 2, 2, 4) == [8, 6]
    assert propose_ngram([1, 2, 3], 0, 1, 2) == []


def test_greedy_rule_keeps_drafts_up_to_the_first_miss_then_the_targets_token():
    assert accepted_greedy([5, 6, 7, 8], [5, 6, 7]) == [5, 6, 7, 8]  # all kept, and the bonus
    assert accepted_greedy([5, 6, 7, 8], [5, 9, 7]) == [5, 6]  # the second missed: the target's 6
    assert accepted_greedy([5, 6, 7, 8], [4, 6, 7]) == [5]
    assert accepted_greedy([5], []) == [5]


def test_sampled_rule_draws_exactly_the_targets_distribution():
    """A point-mass draft kept with probability p(d), else a draw from p without d: the first token's
    frequencies over 40,000 trials match p (each within 4 standard errors), whatever the draft."""
    p = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05], [0.2, 0.2, 0.2, 0.2, 0.2]])
    gen = torch.Generator().manual_seed(0)
    for draft in (0, 3):
        counts = torch.zeros(5)
        kept = 0
        trials = 40_000
        for _ in range(trials):
            out = accepted_sampled(p, [draft], bonus=4, generator=gen)
            counts[out[0]] += 1
            kept += len(out) == 2
        freq = counts / trials
        error = (p[0] * (1 - p[0]) / trials).sqrt()
        assert ((freq - p[0]).abs() <= 4 * error).all(), (draft, freq)
        assert abs(kept / trials - p[0, draft].item()) <= 4 * (0.25 / trials) ** 0.5


# ---- the scheduler's 1 + K slots -------------------------------------------------------------------
def test_a_decoding_request_gets_slots_for_its_drafts_and_rejected_ones_are_rolled_back():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    sched.draft_slots = lambda request, running: 3
    request = Request("r", [11, 12, 13], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(request)
    out = sched.schedule()  # prefill: no drafts yet
    assert [(s.num_new_tokens, s.num_draft_slots) for s in out.scheduled] == [(3, 0)]
    sched.update(out, {"r": [14]})
    assert (request.num_computed_tokens, request.block_ids) == (3, [0])

    out = sched.schedule()  # token 14 at position 3 and 3 drafts at 4..6: a second block
    assert [(s.num_new_tokens, s.num_draft_slots) for s in out.scheduled] == [(1, 3)]
    assert out.num_tokens == 4 and request.block_ids == [0, 1]
    sched.update(out, {"r": [15, 16]})  # one draft kept, the target's own token after it
    assert request.all_token_ids == [11, 12, 13, 14, 15, 16]
    assert request.num_computed_tokens == 5  # KV of 14 and 15; the slots of the rejected drafts roll back
    assert kv.pool.lookup(request.block_hashes[0]) == 0  # block 0 is full and computed: cached

    out = sched.schedule()  # 16 at position 5 and drafts at 6..8: a third block, slots 5.. written over
    assert request.block_ids == [0, 1, 2]
    sched.update(out, {"r": [17, 18, 19, 20]})  # all three drafts kept and the bonus token
    assert request.num_computed_tokens == 9 and request.num_tokens == 10
    assert request.num_cached_blocks == 2  # block 1 (positions 4..7) is full and computed now


def test_drafts_are_dropped_before_anyone_is_preempted():
    kv = KVCacheManager(num_blocks=2, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    sched.draft_slots = lambda request, running: 4
    a = Request("a", [1, 2, 3], SamplingParams(max_tokens=20, ignore_eos=True))
    b = Request("b", [4, 5, 6], SamplingParams(max_tokens=20, ignore_eos=True))
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    sched.update(out, {"a": [7], "b": [8]})
    out = sched.schedule()  # a's 1 + 4 slots need a block the pool lacks: a decodes plainly, b stays
    assert [(s.request.request_id, s.num_new_tokens, s.num_draft_slots) for s in out.scheduled] == [
        ("a", 1, 0), ("b", 1, 0)]
    assert not out.preempted and sched.num_preemptions == 0


def test_stop_token_inside_the_kept_drafts_ends_the_request_there():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), kv)
    sched.draft_slots = lambda request, running: 3
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=20, stop_token_ids=[42]))
    sched.add_request(request)
    sched.update(sched.schedule(), {"r": [7]})
    sched.update(sched.schedule(), {"r": [8, 42, 9, 10]})
    assert request.output_token_ids == [7, 8, 42] and request.is_finished
    assert kv.num_free_blocks == 8


def test_the_policy_measures_both_sides_then_keeps_the_faster_and_rechecks_it_ever_less_often():
    policy = SpeculationPolicy(3, max_model_len=100, explore_every=2, max_explore_every=8, trial_budget=1.0)
    decisions = []
    for _ in range(30):
        speculate = policy.speculates(64)
        decisions.append(int(speculate))
        # at 64 requests drafts lose here: 100 tokens/s with them, 200 without
        policy.record_step(64, speculate, 100 if speculate else 200, 1.0)
    # plain first, drafts once, then plain with trials of drafts after 2, 4, 8, 8 steps
    assert decisions == [0, 1, 0, 0, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 1,
                         0, 0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert policy.speculates(1) is False and policy.speculates(64) is False
    alone = []
    for _ in range(16):  # one request: each side over 8 steps (trial_rows); drafts win; buckets decide alone
        speculate = policy.speculates(1)
        alone.append(int(speculate))
        policy.record_step(1, speculate, 3 if speculate else 1, 1.0)
    assert alone == [0] * 8 + [1] * 8
    assert policy.speculates(1) is True and policy.speculates(64) is False
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=5))
    request.output_token_ids = [7, 8]
    assert policy.draft_slots(request, 1) == 2  # 5 - 2 - 1 tokens left to draft: the last one is the target's
    assert SpeculationPolicy(3, 100, max_batch=4).draft_slots(request, 5) == 0


@pytest.mark.parametrize(("drafted_rate", "first_interval"), [(195, 16), (100, 200), (20, 400)])
def test_trials_of_a_losing_side_stay_within_their_budget(drafted_rate, first_interval):
    """Drafts at 0.975x plain: trial steps cost 2.5% more each, so the floor (16) holds; at 0.5x a trial costs
    a whole step more and comes every 200 steps at most (0.5%); at 0.1x every 400 (the cap)."""
    policy = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=400)
    decisions = []
    for _ in range(first_interval + 4):
        speculate = policy.speculates(64)
        decisions.append(speculate)
        policy.record_step(64, speculate, drafted_rate if speculate else 200, 1.0)
    assert decisions[:2] == [False, True]
    assert decisions.index(True, 2) == 2 + first_interval


# ---- the engine: greedy output is HF's ----------------------------------------------------------
@pytest.fixture(scope="module")
def case(tiny_model_dirs, tiny_tokenizer):
    target = tiny_model_dirs["llama-gqa"]
    prompts = [tiny_tokenizer.encode(p) for p in [*PROMPTS, REPEATING]]
    return target, tiny_model_dirs, prompts, [hf_greedy(target, p, 24) for p in prompts]


def _ids(outputs):
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("drafter", ["itself", "another-model", "ngram"])
def test_greedy_output_is_token_identical_to_hf(case, drafter):
    target, dirs, prompts, expected = case
    options = {"itself": dict(speculative_model=str(target)),
               "another-model": dict(speculative_model=str(dirs["llama-tied"])),
               "ngram": dict(speculative_method="ngram", prompt_lookup_min=1)}[drafter]
    llm = LLM(str(target), **options, **ALWAYS)
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.speculation_stats
    assert stats.num_draft_tokens > 0
    if drafter == "itself":  # its own argmax: every draft is kept
        assert stats.num_accepted_tokens == stats.num_draft_tokens
        assert stats.mean_accepted_length == 1 + stats.num_draft_tokens / stats.num_drafts > 2.5  # K = 2
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


@pytest.mark.parametrize("k", [1, 5])
def test_chunked_prefill_preemption_and_prefix_caching_keep_the_output(case, k):
    target, _, prompts, expected = case
    shared = prompts[2]  # requests that share a prompt share its cached blocks
    llm = LLM(str(target), speculative_model=str(target), num_speculative_tokens=k, num_kv_blocks=20, block_size=8,
              max_num_batched_tokens=16, **ALWAYS)
    assert _ids(llm.generate([*prompts, shared, shared], GREEDY)) == [*expected, expected[2], expected[2]]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.prefix_cache_stats.hits > 0
    assert llm.engine.num_free_blocks == 20


def test_requests_added_mid_decode_and_an_abort(case):
    target, _, prompts, expected = case
    engine = LLM(str(target), speculative_model=str(target), **ALWAYS).engine
    for i in range(3):
        engine.add_request(f"early-{i}", prompts[i], GREEDY)
    finished = {}
    for _ in range(3):
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert engine.abort_request("early-1")
    for i in range(3, 9):
        engine.add_request(f"late-{i}", prompts[i], GREEDY)
    while engine.has_unfinished_requests():
        finished.update({o.request_id: o for o in engine.step() if o.finished})
    assert "early-1" not in finished
    for i in [0, 2, *range(3, 9)]:
        assert finished[f"early-{i}" if i < 3 else f"late-{i}"].outputs[0].token_ids == expected[i]
    assert engine.num_free_blocks == engine.num_blocks


def test_stop_strings_max_tokens_and_logprobs_match_decoding_without_drafts(case, tiny_tokenizer):
    target, _, prompts, expected = case
    stop_text = tiny_tokenizer.decode(expected[2][5:7])  # text the output reaches mid-way
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop_text]),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3),
              SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[expected[4][6]])]
    chosen = [prompts[2], prompts[0], prompts[5], prompts[4]]
    plain = LLM(str(target)).generate(chosen, params)
    speculative = LLM(str(target), speculative_model=str(target), **ALWAYS).generate(chosen, params)
    for a, b in zip(plain, speculative, strict=True):
        assert (a.outputs[0].text, a.outputs[0].token_ids, a.outputs[0].finish_reason) == (
            b.outputs[0].text, b.outputs[0].token_ids, b.outputs[0].finish_reason)
    assert len(speculative[0].outputs[0].token_ids) < 24 and speculative[0].outputs[0].finish_reason == "stop"
    assert len(speculative[1].outputs[0].token_ids) == 7
    assert speculative[3].outputs[0].token_ids == expected[4][:7]
    for a, b in zip(plain[2].outputs[0].logprobs, speculative[2].outputs[0].logprobs, strict=True):
        assert a.token_id == b.token_id and a.top.keys() == b.top.keys()
        assert abs(a.logprob - b.logprob) < 1e-4
    assert speculative[2].metrics.spec_accepted_tokens > 0


# ---- the engine: sampling follows the target's law ------------------------------------------------
def _exact_marginals(model_dir, prompt: list[int], top_k: int) -> tuple[dict[int, float], dict[int, float]]:
    """P(second token) and P(third token) under top-k sampling at temperature 1, summed over every path."""
    from tests.tiny_models import _hf_model

    model = _hf_model(model_dir)

    def dist(prefixes: list[list[int]]) -> list[dict[int, float]]:
        with torch.no_grad():
            logits = model(torch.tensor(prefixes)).logits[:, -1].float()
        values, ids = logits.topk(top_k, dim=-1)
        probs = torch.softmax(values, dim=-1)
        return [dict(zip(i.tolist(), p.tolist(), strict=True)) for i, p in zip(ids, probs, strict=True)]

    first = dist([prompt])[0]
    second: dict[int, float] = {}
    third: dict[int, float] = {}
    pairs: list[tuple[int, int, float]] = []
    step2 = dist([prompt + [a] for a in first])
    for (a, pa), row in zip(first.items(), step2, strict=True):
        for b, pb in row.items():
            second[b] = second.get(b, 0) + pa * pb
            pairs.append((a, b, pa * pb))
    step3 = dist([prompt + [a, b] for a, b, _ in pairs])
    for (_, _, pab), row in zip(pairs, step3, strict=True):
        for c, pc in row.items():
            third[c] = third.get(c, 0) + pab * pc
    return second, third


def _chi_square_p(counts: dict[int, int], exact: dict[int, float], trials: int) -> float:
    """Pearson's test, cells with fewer than 5 expected pooled; the p-value."""
    stat, df, pooled_o, pooled_e = 0.0, -1, 0, 0.0
    for token, p in exact.items():
        expected = p * trials
        if expected < 5:
            pooled_o, pooled_e = pooled_o + counts.get(token, 0), pooled_e + expected
            continue
        stat += (counts.get(token, 0) - expected) ** 2 / expected
        df += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        df += 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


@pytest.mark.slow
def test_sampled_tokens_follow_the_targets_distribution(case):
    """3,000 seeded samples of three tokens, drafted by the target itself (so drafts are often kept and
    often rejected): the second and third tokens' frequencies pass a chi-square test against the exact
    marginals computed with HF, where a rule that kept every draft (always the argmax) fails it."""
    target, _, prompts, _ = case
    top_k, trials = 8, 3000
    second, third = _exact_marginals(target, prompts[0], top_k)
    llm = LLM(str(target), speculative_model=str(target), num_speculative_tokens=2, **ALWAYS)
    params = [SamplingParams(temperature=1.0, top_k=top_k, max_tokens=3, ignore_eos=True, seed=i)
              for i in range(trials)]
    outputs = llm.generate([prompts[0]] * trials, params)
    stats = llm.engine.speculation_stats
    assert 0.1 < stats.num_accepted_tokens / stats.num_draft_tokens < 0.9  # both branches of the rule ran
    counts2: dict[int, int] = {}
    counts3: dict[int, int] = {}
    for out in outputs:
        ids = out.outputs[0].token_ids
        counts2[ids[1]] = counts2.get(ids[1], 0) + 1
        counts3[ids[2]] = counts3.get(ids[2], 0) + 1
    assert _chi_square_p(counts2, second, trials) > 1e-3
    assert _chi_square_p(counts3, third, trials) > 1e-3
    argmax = max(second, key=second.get)
    assert _chi_square_p({argmax: trials}, second, trials) < 1e-3  # the test can tell a wrong law


# ---- a draft head cut to the frequent tokens ------------------------------------------------------
def test_the_draft_vocabulary_is_the_most_counted_tokens_and_the_special_ones(tmp_path, tiny_tokenizer):
    specials = sorted(set(tiny_tokenizer.all_special_ids))
    common, rare = [t for t in range(100, 110) if t not in specials][:2], 120
    write_token_counts(tmp_path, [torch.tensor([common[0]] * 5 + [common[1]] * 3), torch.tensor([rare])], ["a", "b"])
    assert frequent_tokens(tmp_path, tiny_tokenizer, len(specials) + 2, 400).tolist() == sorted([*specials, *common])
    assert frequent_tokens(tmp_path, tiny_tokenizer, len(specials) + 3, 400).tolist() == sorted(
        [*specials, *common, rare])
    # more than were ever counted: the rest in id order
    assert frequent_tokens(tmp_path, tiny_tokenizer, len(specials) + 4, 400).tolist() == sorted(
        {*specials, *common, rare, min(set(range(400)) - {*specials, *common, rare})})
    for size in (0, 401):
        with pytest.raises(ValueError, match=f"between 1 and the vocabulary's 400 tokens, got {size}"):
            frequent_tokens(tmp_path, tiny_tokenizer, size, 400)


def test_a_cut_draft_head_keeps_the_output_and_misses_only_tokens_outside_it(case, tmp_path, tiny_tokenizer):
    target, _, prompts, expected = case
    draft = tmp_path / "draft"
    shutil.copytree(target, draft)
    written = sorted({t for out in expected for t in out})
    specials = set(tiny_tokenizer.all_special_ids)
    write_token_counts(draft, [torch.tensor(written)], ["the expected outputs"])
    size = len(specials | set(written))
    llm = LLM(str(target), speculative_model=str(draft), speculative_draft_vocab=size, **ALWAYS)
    assert llm.engine.drafter.vocabulary.token_ids.tolist() == sorted(specials | set(written))
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.speculation_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # itself, and every token it writes kept

    counts = Counter(t for out in expected for t in out)
    missing = counts.most_common(1)[0][0]  # the most written token, left out of the cut
    write_token_counts(draft, [torch.tensor([t for t in written if t != missing])], ["all but one"])
    llm = LLM(str(target), speculative_model=str(draft), speculative_draft_vocab=size - 1, **ALWAYS)
    assert missing not in llm.engine.drafter.vocabulary.token_ids.tolist()
    assert _ids(llm.generate(prompts, GREEDY)) == expected
    stats = llm.engine.speculation_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


# ---- bad settings are refused at start, by name ----------------------------------------------------
def test_bad_speculative_settings_are_refused_naming_the_problem(case, tmp_path):
    target, _, _, _ = case
    other = make_tiny_model("llama-gqa", tmp_path, build_tokenizer(vocab_size=300))
    with pytest.raises(ValueError, match="vocabulary of .* tokens"):
        LLM(str(target), speculative_model=str(other))
    with pytest.raises(ValueError, match="num_speculative_tokens must be between 1 and 16, got 0"):
        LLM(str(target), speculative_model=str(target), num_speculative_tokens=0)
    with pytest.raises(ValueError, match="between 1 and 16, got 1000"):
        LLM(str(target), speculative_method="ngram", num_speculative_tokens=1000)
    with pytest.raises(ValueError, match="needs --speculative-model"):
        LLM(str(target), speculative_method="draft")
    with pytest.raises(ValueError, match="drop --speculative-model"):
        LLM(str(target), speculative_method="ngram", speculative_model=str(target))
    with pytest.raises(ValueError, match="KV window"):
        LLM(str(target), speculative_method="ngram", kv_window=64)
    with pytest.raises(ValueError, match="unknown speculative method"):
        LLM(str(target), speculative_method="medusa")
    with pytest.raises(ValueError, match="--speculative-draft-vocab cuts a draft model's LM head; it needs"):
        LLM(str(target), speculative_method="ngram", speculative_draft_vocab=100)
    with pytest.raises(ValueError, match="between 1 and the vocabulary's 400 tokens, got 401"):
        LLM(str(target), speculative_model=str(target), speculative_draft_vocab=401)


# ---- the benchmark ----------------------------------------------------------------------------------
def test_bench_spec_compares_against_plain_decoding_and_checks_the_outputs(case, tmp_path, capsys):
    from llmaccel.cli import main

    target, _, _, _ = case
    out = tmp_path / "spec.json"
    code = main(["bench", "spec", "--model", str(target), "--draft", str(target), "--workloads", "lone,batch",
                 "--batch-size", "4", "--rounds", "1", "--dtype", "float32", "--result-json", str(out)])
    assert code == 0  # every speculative output equalled the plain one
    rows = {(r["workload"], r["variant"]): r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {(w, v) for w in ("lone", "batch") for v in ("plain", f"draft {target.name}", "ngram")}
    assert all(rows[(w, v)]["identical"] for w in ("lone", "batch") for v in (f"draft {target.name}", "ngram"))
    assert rows[("lone", "plain")]["ratio"] == 1.0 and rows[("lone", "plain")]["paired_ratio"] == 1.0
    assert all(len(r["rounds"]) == 1 and len(r["warmup_rounds"]) == 1 for r in rows.values())
    printed = capsys.readouterr().out
    assert "mean accepted length" in printed and "warm-up 1 lone" in printed


# ---- served: the official openai client, /metrics ---------------------------------------------------
def test_served_with_the_openai_client_usage_and_metrics_count_the_drafts(case):
    import openai

    from tests.live_server import MODEL_NAME, live_server, metric

    target, _, prompts, expected = case
    with live_server(target, engine_options=dict(speculative_model=str(target), **ALWAYS)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model=MODEL_NAME, prompt=prompts[2], max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
        streamed = client.completions.create(model=MODEL_NAME, prompt=prompts[2], max_tokens=24, temperature=0,
                                             extra_body={"ignore_eos": True}, stream=True,
                                             stream_options={"include_usage": True})
        chunks = list(streamed)
        server.wait_idle()
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 0
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
        assert "".join(c.choices[0].text for c in chunks if c.choices) == reply.choices[0].text
        assert chunks[-1].usage.completion_tokens_details == details  # the same drafts, the same verdicts
        drafts = metric(server, "llmaccel_spec_decode_num_draft_tokens_total")
        kept = metric(server, "llmaccel_spec_decode_num_accepted_tokens_total")
        assert kept == 2 * details.accepted_prediction_tokens
        assert drafts == 2 * (details.accepted_prediction_tokens + details.rejected_prediction_tokens)
        assert metric(server, "llmaccel_spec_decode_mean_accepted_length") > 1
    assert reply.usage.completion_tokens == 24


def test_a_trial_measures_its_side_afresh():
    """Drafts lost at 100 against 200 tokens/s; the machine then slows to 40% of its speed. Plain steps follow
    it (80); the next trial of drafts runs at 40, and that, not a blend with the stale 100 (88, which
    would beat 80), decides: plain stays."""
    policy = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=64, trial_budget=1.0)
    speed = 1.0
    for step in range(200):
        if step == 20:
            speed = 0.4
        speculate = policy.speculates(64)
        if speculate and step > 20:
            policy.record_step(64, True, 100 * speed, 1.0)
            assert policy.speculates(64) is False
            return
        policy.record_step(64, speculate, (100 if speculate else 200) * speed, 1.0)
    raise AssertionError("no trial of drafts after the slowdown")


def test_a_draft_models_catch_up_counts_in_the_cost_of_a_trial():
    """Drafts at 190 against 200 tokens/s alone would be re-tried every 16 steps (a trial step costs 5% more:
    ceil(0.0526 / 0.005) = 11 < 16); a catch-up step of 2 s, 6.25 plain steps of 64 tokens at 200 tokens/s,
    pushes the next trial out to ceil((0.0526 + 6.25) / 0.005) steps, capped at 400."""
    policy = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=400)
    policy.record_step(64, False, 200, 1.0)
    policy.record_step(64, True, 64, 2.0, caught_up=True)
    assert (policy.bucket(64), True) not in policy.rates  # the catch-up is the trial's fee, not its rate
    policy.record_step(64, True, 190, 1.0)
    assert policy.intervals[policy.bucket(64)] == 400
    plain_only = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=400)
    plain_only.record_step(64, False, 200, 1.0)
    plain_only.record_step(64, True, 190, 1.0)
    assert plain_only.intervals[plain_only.bucket(64)] == 16  # 5% more every 16 steps: 0.3%, within 0.5%
    on_the_margin = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=400)
    on_the_margin.record_step(64, False, 200, 1.0)
    on_the_margin.record_step(64, True, 64, 2.0, caught_up=True)
    on_the_margin.record_step(64, True, 210, 1.0)  # faster per step, short of the 20% margin: plain
    assert on_the_margin.speculates(64) is False
    assert on_the_margin.intervals[on_the_margin.bucket(64)] == 400  # the catch-up still prices its trials


def test_catching_up_step_after_step_is_a_rate_not_a_fee():
    """With prompt lookup first, or requests arriving every step, the draft catches some request up at every
    step with drafts: only the first after plain steps is the trial's fee. Had every one been a fee, a trial
    at 64 would have drafted for the whole batch (measured: 63 steps in a row, 0.69x)."""
    policy = SpeculationPolicy(2, max_model_len=1000)
    policy.record_step(64, False, 200, 1.0)
    assert policy.speculates(64) is True
    policy.record_step(64, True, 64, 2.0, caught_up=True)
    assert policy.speculates(64) is True
    policy.record_step(64, True, 100, 1.0, caught_up=True)
    assert policy.rates[(policy.bucket(64), True)] == 100
    assert policy.speculates(64) is False


def test_a_lone_requests_trial_spans_steps_and_weighs_tokens_by_time():
    """Prompt lookup first: drafted steps alternate 3 tokens and 1 token (the draft's miss, slower), plain
    makes 1.5 a second. Over its 8 steps the trial yields 16 tokens in 10 s (1.6/s) and wins; a one-step
    trial on a miss (0.8/s) would have chosen plain for the next 16+ steps. A trial that overturns the
    choice starts the interval afresh rather than trying the old side at once."""
    policy = SpeculationPolicy(2, max_model_len=1000, explore_every=16)
    decisions, misses, measured = [], 0, None
    for _ in range(40):
        if len(decisions) == 16:
            measured = policy.rates[(1, True)]
        speculate = policy.speculates(1)
        decisions.append(int(speculate))
        if speculate:
            misses += 1
            policy.record_step(1, True, 1 if misses % 2 else 3, 1.5 if misses % 2 else 1.0)
        else:
            policy.record_step(1, False, 3, 2.0)
    assert decisions[:16] == [0] * 8 + [1] * 8
    assert measured == pytest.approx(16 / 10)
    assert 0 not in decisions[16:16 + 16]  # chosen: drafts, and the first trial of plain comes later


@pytest.mark.parametrize(("plain_after", "switches"), [(200, False), (90, True)])
def test_a_trial_that_beats_the_choice_is_checked_against_the_choice_measured_afresh(plain_after, switches):
    """Plain at 200 tokens/s, drafts at 150; a slow stretch drags plain's moving average to ~100, and the
    next trial of drafts (150) beats 1.2x that. Before switching, plain is measured again: back at 200, it
    stays chosen (and the trial counts as confirming it); still slow (90), drafts take over."""
    policy = SpeculationPolicy(2, max_model_len=1000, explore_every=16, max_explore_every=64, trial_budget=1.0)
    slow = False
    for step in range(400):
        speculate = policy.speculates(64)
        if step == 40:
            slow = True
        if speculate and slow:  # the trial of drafts
            policy.record_step(64, True, 150, 1.0)
            assert policy.rechecks == {policy.bucket(64)} and policy.speculates(64) is False
            policy.record_step(64, False, plain_after, 1.0)
            assert policy.rechecks == set() and policy.speculates(64) is switches
            return
        policy.record_step(64, speculate, 150 if speculate else (100 if slow else 200), 1.0)
    raise AssertionError("no trial of drafts after the slow stretch")


def test_several_requests_need_drafts_to_win_by_the_margin_one_request_by_any():
    """Drafts at 1.1x plain per step: one request takes them, 64 do not (a closed batch's tail costs more
    than that: ngram measured 0.93x overall at 64 while its steps ran 1.05-1.11x); at 1.25x both do."""
    for drafted_rate, at_64 in ((110, False), (125, True)):
        policy = SpeculationPolicy(2, max_model_len=1000, trial_rows=1)
        for num_running in (1, 64):
            policy.record_step(num_running, False, 100, 1.0)
            policy.record_step(num_running, True, drafted_rate, 1.0)
        assert policy.speculates(1) is True
        assert policy.speculates(64) is at_64
