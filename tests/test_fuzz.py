"""Property-based fuzzing: the live server from its own /openapi.json (schemathesis), and SamplingParams
and the engine driven directly with extreme values (hypothesis). Seeds are printed, so a failure can be
replayed with LLMACCEL_FUZZ_SEED=<seed>."""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode
from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

from llmaccel.engine.engine import LLMEngine
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from tests.live_server import live_server
from tests.summary import report

FUZZ_SECONDS = float(os.environ.get("LLMACCEL_FUZZ_SECONDS", 90))
ROUND = 25  # examples per hypothesis run; the time budget is checked between runs


def fuzz_seed() -> int:
    seed = int(os.environ.get("LLMACCEL_FUZZ_SEED") or random.randrange(2**32))
    print(f"\nfuzz seed {seed} (replay with LLMACCEL_FUZZ_SEED={seed})")
    return seed


def assert_openai_error(response) -> None:
    body = response.json()
    assert set(body) == {"error"}, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["message"], body


def assert_no_error_event(text: str) -> None:
    """A streamed 200 may end with an error event; only a timeout or a dead engine may send one."""
    for line in text.splitlines():
        if line.startswith("data: {") and '"error"' in line:
            raise AssertionError(f"error event in a stream: {line}")


# Fields that constrain the output. The document cannot say that only one may be given, that a grammar
# must parse or that tool_choice needs tools, so a schema-valid case carries several and nearly every one
# was refused (17 chat answers in 2,000): a positive case keeps one of them at most, in a quarter of cases.
CONSTRAINT_GROUPS = [("response_format",), ("structured_outputs",), ("guided_json",), ("guided_regex",),
                     ("guided_choice",), ("guided_grammar",), ("tools", "tool_choice")]


def one_constraint(pair):
    case, keep = pair
    if isinstance(case.body, dict):
        present = [group for group in CONSTRAINT_GROUPS if any(name in case.body for name in group)]
        for group in present[1:] if keep == 0 else present:
            for name in group:
                case.body.pop(name, None)
    return case


@pytest.mark.slow
def test_fuzz_the_live_server_from_its_openapi_document(llama_dir):
    seed = fuzz_seed()
    statuses: Counter[int] = Counter()
    by_operation: Counter[str] = Counter()
    with live_server(llama_dir, engine_options={"max_model_len": 96}, max_prompt_chars=4096) as server:
        schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
        answers = [schema[path]["POST"].as_strategy(mode) for path in ("/v1/chat/completions", "/v1/completions")
                   for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
        answers[::2] = [st.tuples(a, st.integers(0, 3)).map(one_constraint) for a in answers[::2]]
        strategy = st.one_of(*answers, schema.as_strategy(GenerationMode.POSITIVE))  # mostly the two that generate
        deadline = time.monotonic() + FUZZ_SECONDS

        @settings(max_examples=ROUND, deadline=None, database=None, phases=[Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def fuzz(case) -> None:
            response = case.call(base_url=server.url, timeout=120)
            statuses[response.status_code] += 1
            by_operation[f"{case.method} {case.path} {response.status_code}"] += 1
            replay = f"\n{case.as_curl_command()}"
            assert response.status_code < 500, f"{response.status_code} {response.text[:500]}{replay}"
            case.validate_response(response, checks=[status_code_conformance, content_type_conformance])
            if response.status_code >= 400:
                assert_openai_error(response)
            elif "text/event-stream" in str(response.headers.get("content-type")):
                assert_no_error_event(response.text)

        rounds = 0
        try:
            while time.monotonic() < deadline:  # rounds of ROUND examples, each seeded from the run's seed
                hypothesis_seed(seed + rounds)(fuzz)()
                rounds += 1
        finally:
            print(f"by operation and status: {dict(sorted(by_operation.items()))}")
            report(f"API fuzz (seed {seed}; replay with LLMACCEL_FUZZ_SEED={seed}): {sum(statuses.values())} "
                   f"requests in {FUZZ_SECONDS:.0f} s, {sum(n for s, n in statuses.items() if s >= 500)} "
                   f"answered >= 500; by status {dict(sorted(statuses.items()))}")
        assert sum(statuses.values()) >= 200
        for path in ("/v1/chat/completions", "/v1/completions"):  # it got past validation often enough
            assert by_operation[f"POST {path} 200"] >= 20
        assert httpx.get(server.url + "/health").json() == {"status": "ok"}
        # ignore_eos: sampled at temperature 1, "Hello" may draw EOS early (it once did, after a clean fuzz)
        normal = httpx.post(server.url + "/v1/completions", timeout=60,
                            json={"prompt": "Hello", "max_tokens": 3, "ignore_eos": True})
        assert normal.status_code == 200 and normal.json()["usage"]["completion_tokens"] == 3
        server.wait_idle(120)  # every request ended and every KV block is free again
        report("API fuzz: after it /health is ok, a normal request is answered and every KV block is free")


# Every SamplingParams field: legal values out to their extremes, and values that must be refused (out of
# range, huge, non-finite, of the wrong kind). Each example takes legal values, with up to two refused ones.
BIG = st.sampled_from([2**31, 2**63 - 1, 2**63, 2**64, 2**64 + 1, 2**200, -(2**63), -(2**200)])
HUGE_FLOAT = st.sampled_from([1e308, 1e30, 2**63])
LEGAL = {
    "n": st.integers(1, 3), "temperature": st.one_of(st.floats(0, 2), st.sampled_from([1e-300, 1e-5, 1e308])),
    "top_p": st.one_of(st.floats(1e-300, 1), st.just(1e-300)), "top_k": st.one_of(st.integers(-1, 500), BIG.filter(
        lambda k: k > 0)), "min_p": st.floats(0, 1), "presence_penalty": st.floats(-2, 2),
    "frequency_penalty": st.floats(-2, 2), "repetition_penalty": st.one_of(st.floats(1e-3, 10), HUGE_FLOAT),
    "seed": st.one_of(st.none(), st.integers(-(2**70), 2**70), BIG), "max_tokens": st.one_of(st.none(),
                                                                                              st.integers(1, 6)),
    "min_tokens": st.integers(0, 2), "stop_token_ids": st.lists(st.integers(0, 399), max_size=3),
    "logprobs": st.one_of(st.none(), st.integers(0, 20)), "stop": st.lists(st.text(min_size=1, max_size=3), max_size=2),
    "ignore_eos": st.booleans(),
}
WRONG = st.one_of(st.floats(allow_nan=True, allow_infinity=True).filter(lambda f: not math.isfinite(f)),
                  st.booleans(), st.sampled_from(["1", None, 1.5, [1]]), BIG)
REFUSED = {
    "n": st.one_of(st.integers(-3, 0), WRONG), "temperature": st.one_of(st.floats(max_value=-1e-9), WRONG),
    "top_p": st.one_of(st.floats(max_value=0), st.floats(min_value=1.0001), WRONG),
    "top_k": st.one_of(st.integers(max_value=-2), WRONG), "min_p": st.one_of(st.floats(min_value=1.01), WRONG),
    "presence_penalty": st.one_of(st.floats(min_value=2.01), WRONG), "repetition_penalty": st.one_of(
        st.floats(max_value=0), WRONG), "max_tokens": st.one_of(st.integers(max_value=0), WRONG),
    "min_tokens": st.one_of(st.integers(max_value=-1), WRONG), "logprobs": st.one_of(st.integers(21), WRONG),
    "stop_token_ids": st.lists(st.one_of(st.integers(max_value=-1), WRONG), min_size=1, max_size=2),
    "seed": st.sampled_from([1.5, "7", True]), "stop": st.sampled_from([[""], [5], (None,)]),
}


@st.composite
def sampling_fields(draw) -> dict:
    fields = draw(st.fixed_dictionaries({}, optional=LEGAL))
    for name in draw(st.lists(st.sampled_from(sorted(REFUSED)), max_size=2, unique=True)):
        fields[name] = draw(REFUSED[name])
    return fields


@pytest.fixture(scope="module", params=["plain", "draft model", "ngram"])
def fuzz_llm(request, llama_dir):
    """The engine plain, and speculating in every step (a draft model, the model itself; prompt lookup)."""
    speculation = {"plain": {}, "draft model": dict(speculative_model=str(llama_dir), speculative_max_batch=1000),
                   "ngram": dict(speculative_method="ngram", prompt_lookup_min=1, speculative_max_batch=1000)}
    return LLM(str(llama_dir), num_kv_blocks=64, max_model_len=48, **speculation[request.param])


def test_sampling_params_and_the_engine_take_extreme_values(fuzz_llm):
    """Every combination either raises ValueError naming a field, or runs to stop/length: never an engine
    error, never a leaked block."""
    engine: LLMEngine = fuzz_llm.engine
    vocab = engine.spec.vocab_size
    outcomes: Counter[str] = Counter()

    seed = fuzz_seed()

    @hypothesis_seed(seed)
    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(fields=sampling_fields(), prompt=st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12),
           bad_token=st.one_of(st.none(), st.sampled_from([-1, vocab, 2**63])))
    def drive(fields, prompt, bad_token) -> None:
        if bad_token is not None:
            prompt = prompt + [bad_token]
        try:
            params = SamplingParams(**fields)
        except ValueError as exc:
            named = [name for name in LEGAL if name in str(exc)]
            assert named, f"{exc} names no field"
            outcomes["refused by SamplingParams"] += 1
            return
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            assert math.isfinite(getattr(params, name))
        assert params.seed is None or 0 <= params.seed < 2**64
        try:
            [output] = fuzz_llm.generate([prompt], params)
        except ValueError as exc:
            assert "prompt" in str(exc) or "stop_token_ids" in str(exc), str(exc)
            outcomes["refused by the engine"] += 1
        else:
            assert output.error is None, output.error
            assert {c.finish_reason for c in output.outputs} <= {"stop", "length"}
            assert all(0 <= t < vocab for c in output.outputs for t in c.token_ids)
            assert all(c.logprobs is None or all(math.isfinite(lp.logprob) for lp in c.logprobs)
                       for c in output.outputs)
            json.dumps([lp.top for c in output.outputs for lp in c.logprobs or []], allow_nan=False)
            outcomes["generated"] += 1
        assert not engine.has_unfinished_requests() and engine.num_free_blocks == engine.num_blocks

    drive()
    report(f"SamplingParams/engine fuzz (seed {seed}): {sum(outcomes.values())} examples, {dict(outcomes)}, "
           "0 engine errors, 0 blocks leaked")
    assert outcomes["generated"] >= 10 and outcomes["refused by SamplingParams"] >= 10
