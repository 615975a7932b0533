"""Batched sampling: exact math of penalties, masks and logprobs; seeds independent of the batch."""

from __future__ import annotations

import math

import torch

from llmaccel.sampler import Sampler, SamplingRow
from llmaccel.sampling_params import SamplingParams


def _row(params, prompt=(), output=(), generator=None, suppress=()):
    return SamplingRow(params, list(prompt), list(output), generator, tuple(suppress))


def _seeded(seed):
    g = torch.Generator()
    g.manual_seed(seed)
    return g


def test_greedy_rows_take_the_argmax():
    logits = torch.tensor([[0.1, 2.0, 0.3], [5.0, 1.0, 4.0]])
    tokens, _, _ = Sampler(3, torch.device("cpu")).sample(logits, [_row(SamplingParams(temperature=0))] * 2)
    assert tokens == [1, 0]


def test_top_k_one_samples_the_argmax_at_any_temperature():
    logits = torch.randn(4, 50)
    rows = [_row(SamplingParams(temperature=1.5, top_k=1))] * 4
    tokens, _, _ = Sampler(50, torch.device("cpu")).sample(logits, rows)
    assert tokens == logits.argmax(-1).tolist()


def test_tiny_top_p_keeps_only_the_top_token():
    logits = torch.randn(3, 40)
    tokens, _, _ = Sampler(40, torch.device("cpu")).sample(logits, [_row(SamplingParams(top_p=1e-6))] * 3)
    assert tokens == logits.argmax(-1).tolist()


def test_min_p_drops_tokens_below_the_threshold():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    sampler = Sampler(3, torch.device("cpu"))
    seen = {sampler.sample(logits, [_row(SamplingParams(min_p=0.7), generator=_seeded(s))])[0][0] for s in range(40)}
    assert seen == {0}  # the threshold is 0.7 * 0.5 = 0.35: 0.3 and 0.2 fall below it


def test_penalties_follow_the_openai_and_hf_formulas():
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])
    params = SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=2.0)
    sampler = Sampler(4, torch.device("cpu"))
    got = sampler._apply_penalties(logits.clone(), [_row(params, prompt=[3], output=[0, 0, 1])])
    # token 0: 2/2 - 0.25*2 - 0.5 = 0; token 1: -1*2 - 0.25 - 0.5 = -2.75; token 2 untouched; token 3 (prompt): 1/2
    assert torch.allclose(got, torch.tensor([[0.0, -2.75, 0.5, 0.5]]))


def test_min_tokens_suppresses_eos():
    logits = torch.tensor([[0.0, 9.0, 1.0]])
    tokens, _, _ = Sampler(3, torch.device("cpu")).sample(logits, [_row(SamplingParams(temperature=0), suppress=[1])])
    assert tokens == [2]


def test_logprobs_are_the_raw_log_softmax_with_top_n():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    _, logprobs, _ = Sampler(4, torch.device("cpu")).sample(logits, [_row(SamplingParams(temperature=0, logprobs=2))])
    expected = torch.log_softmax(logits[0], -1)
    assert logprobs[0].token_id == 1
    assert math.isclose(logprobs[0].logprob, float(expected[1]), rel_tol=1e-6)
    assert list(logprobs[0].top) == [1, 2]


def test_a_seeded_row_samples_the_same_whatever_shares_its_batch():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    sampler = Sampler(100, torch.device("cpu"))
    params = SamplingParams(temperature=1.0, seed=42)
    alone = [sampler.sample(logits[3:4], [_row(params, generator=_seeded(42))])[0][0] for _ in range(1)]
    rows = [_row(SamplingParams(temperature=0.8)) for _ in range(8)]
    rows[3] = _row(params, generator=_seeded(42))
    batched = sampler.sample(logits, rows)[0][3]
    assert alone == [batched]
