"""Batched sampling: exact math of penalties, masks and logprobs; seeds independent of the batch; the
C++ draw against the torch path."""

from __future__ import annotations

import math

import pytest
import torch

from llmaccel.sampler import Sampler, SamplingRow, draw_reference, sampling_kernels
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


@pytest.mark.parametrize("use_kernel", [True, False])
def test_logit_bias_moves_the_choice_not_the_logprobs(use_kernel, monkeypatch):
    """+5 on token 0 makes it the greedy choice of row 0; -100 bans row 1's argmax; row 2 (no bias, same
    batch) is untouched; a sampled row with a +100 bias draws that token. Logprobs stay the raw ones."""
    if not use_kernel:
        monkeypatch.setattr("llmaccel.sampler._kernels_for", lambda logits: None)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]] * 4)
    rows = [_row(SamplingParams(temperature=0, logprobs=0, logit_bias={0: 5.0})),
            _row(SamplingParams(temperature=0, logit_bias={1: -100})),
            _row(SamplingParams(temperature=0)),
            _row(SamplingParams(temperature=1.0, logit_bias={3: 100}), generator=_seeded(1))]
    tokens, logprobs, _ = Sampler(4, torch.device("cpu")).sample(logits, rows)
    assert tokens == [0, 2, 1, 3]
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[0]))
    assert logits[0].tolist() == [1.0, 3.0, 2.0, 0.0]  # the caller's logits are not changed


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


def _draws(logits, params, uniforms, use_kernel):
    """Tokens drawn for one row of logits at each uniform number, by the C++ kernel or the torch path."""
    sampler = Sampler(logits.shape[-1], torch.device("cpu"))
    rows = [_row(params)] * len(uniforms)
    batch = logits.expand(len(uniforms), -1).contiguous()
    uniform = torch.tensor(uniforms, dtype=torch.float64)
    if use_kernel:
        p = params
        column = torch.tensor
        tokens, _ = kernels.sample_rows(batch, column([p.temperature] * len(rows)), column([p.top_k] * len(rows)),
                                        column([p.top_p] * len(rows)), column([p.min_p] * len(rows)), uniform)
        return tokens.tolist()
    return draw_reference(sampler._probs(batch, rows), uniform)[0].tolist()


kernels = sampling_kernels()
needs_kernel = pytest.mark.skipif(kernels is None, reason="C++ kernels unavailable on this machine")


@pytest.mark.parametrize("use_kernel", [pytest.param(True, marks=needs_kernel), False])
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.5, top_k=3),
                                    SamplingParams(temperature=1.2, top_p=0.8), SamplingParams(min_p=0.2)])
def test_the_inverse_cdf_draw_hits_each_token_in_proportion(params, use_kernel):
    """Evenly spaced uniforms give each kept token a count within one of probability x N, in vocabulary
    order; tokens cut by top-k / top-p / min-p and masked (-inf) tokens are never drawn."""
    logits = torch.tensor([[0.5, -1.0, 2.0, float("-inf"), 1.0, 0.0, 1.5, -3.0]])
    sampler = Sampler(8, torch.device("cpu"))
    probs = sampler._probs(logits, [_row(params)])[0].double()
    probs /= probs.sum()
    n = 2000
    tokens = _draws(logits, params, [(j + 0.5) / n for j in range(n)], use_kernel)
    counts = torch.bincount(torch.tensor(tokens), minlength=8).double()
    assert (counts - probs * n).abs().max() <= 1
    assert counts[3] == 0 and tokens == sorted(tokens)  # the masked token; the scan runs in vocabulary order
    if params.top_k == 3:
        assert set(tokens) == {2, 4, 6}


@needs_kernel
def test_the_kernel_draws_the_reference_token():
    """The C++ draw and the torch path pick the same token for the same uniform number, over random
    vocabularies, temperatures and every truncation (top-k beyond the vocabulary, top-p, min-p, mixed)."""
    gen = torch.Generator().manual_seed(1)
    for _ in range(60):
        vocab, batch = int(torch.randint(2, 3000, (1,), generator=gen)), 8
        logits = torch.randn(batch, vocab, generator=gen) * float(torch.rand(1, generator=gen) * 6)
        temps = torch.rand(batch, generator=gen) * 2 + 0.05
        top_k = torch.randint(0, vocab + 5, (batch,), generator=gen) * (torch.rand(batch, generator=gen) < 0.5)
        top_p = torch.where(torch.rand(batch, generator=gen) < 0.5, torch.rand(batch, generator=gen), torch.ones(batch))
        min_p = torch.where(torch.rand(batch, generator=gen) < 0.3, torch.rand(batch, generator=gen) * 0.3,
                            torch.zeros(batch))
        uniform = torch.rand(batch, generator=gen, dtype=torch.float64)
        tokens, top = kernels.sample_rows(logits, temps, top_k, top_p, min_p, uniform)
        rows = [_row(SamplingParams(temperature=float(t), top_k=int(k), top_p=float(p), min_p=float(m)))
                for t, k, p, m in zip(temps, top_k, top_p, min_p, strict=True)]
        want, want_top = draw_reference(Sampler(vocab, torch.device("cpu"))._probs(logits, rows), uniform)
        assert tokens.tolist() == want.tolist()
        assert torch.allclose(top, want_top.float(), rtol=1e-4)


@needs_kernel
def test_top_k_keeps_exactly_k_of_tied_tokens():
    logits = torch.zeros(1, 10)  # ten equal tokens: the first three in vocabulary order form the top 3
    tokens = _draws(logits, SamplingParams(top_k=3), [(j + 0.5) / 30 for j in range(30)], use_kernel=True)
    assert tokens == [0] * 10 + [1] * 10 + [2] * 10


@needs_kernel
def test_the_kernel_argmax_is_torchs():
    logits = torch.randn(70, 5000, generator=torch.Generator().manual_seed(2))
    logits[3, 10] = logits[3, 4000] = 99.0  # a tie: the first index
    logits[5, 20] = float("nan")  # NaN counts as the largest, as in torch
    logits[6] = float("-inf")
    assert kernels.argmax_rows(logits).tolist() == logits.argmax(-1).tolist()
    assert kernels.argmax_rows(logits[:, :4000]).tolist() == logits[:, :4000].argmax(-1).tolist()  # strided rows
