"""Bad sampling values fail at construction with a message that names the field."""

from __future__ import annotations

import pytest

from llmaccel.sampling_params import SamplingParams


@pytest.mark.parametrize("kwargs, message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(n=0), r"n must be in \[1, 1024\]"),
    (dict(n=2**31), r"n must be in \[1, 1024\], got 2147483648"),
    (dict(max_tokens=0), "max_tokens must be >= 1"),
    (dict(top_k=-2), "top_k must be >= -1"),
    (dict(min_p=1.5), r"min_p must be in \[0, 1\]"),
    (dict(presence_penalty=3), r"presence_penalty must be in \[-2, 2\]"),
    (dict(repetition_penalty=0), "repetition_penalty must be > 0"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens .5. must not exceed max_tokens .2."),
    (dict(stop=[""]), "every stop string must be a non-empty string"),
    (dict(logprobs=21), r"logprobs must be in \[0, 20\]"),
])
def test_invalid_values_are_rejected_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_defaults_and_normalisation():
    params = SamplingParams(stop="###", top_k=-1, stop_token_ids=[5])
    assert params.stop == ("###",) and params.top_k == 0 and params.stop_token_ids == (5,)
    assert SamplingParams(temperature=0).greedy and not SamplingParams().greedy


def test_logit_bias_is_kept_sorted_and_checked():
    params = SamplingParams(logit_bias={7: -1.5, 2: 100})
    assert params.logit_bias == ((2, 100.0), (7, -1.5))
    assert SamplingParams(logit_bias=[(2, 100), (7, -1.5)]) == params
    for bias, words in (({5: 100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
                        ({-1: 1}, "token id -1 must be >= 0"),
                        ({"5": 1}, "a logit_bias token id must be an integer"),
                        ({5: float("nan")}, r"logit_bias\[5\] must be a finite number"),
                        ({5: "x"}, r"logit_bias\[5\] must be a number"),
                        ([(5, 1), (5, 2)], "names a token id twice"),
                        ([5], "must map token ids to numbers"),
                        ([("a", 1), (3, 1)], "a logit_bias token id must be an integer")):
        with pytest.raises(ValueError, match=words):
            SamplingParams(logit_bias=bias)


def test_prompt_logprobs_take_the_logprobs_range():
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    with pytest.raises(ValueError, match="prompt_logprobs must be"):
        SamplingParams(prompt_logprobs=21)
