"""The offline API: order, fields, timing, n, stop, logprobs, chat; seeds independent of the batch."""

from __future__ import annotations

import pytest
import torch

from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir))


def test_outputs_come_back_in_input_order_with_timing(llm):
    prompts = ["The quick brown fox", "A", "你好，世界"]
    lengths = [5, 9, 3]
    outs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths])
    assert [o.prompt for o in outs] == prompts
    assert [len(o.outputs[0].token_ids) for o in outs] == lengths
    for out in outs:
        m = out.metrics
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert out.prompt_token_ids == llm.tokenizer.encode(out.prompt)


def test_token_id_prompts_are_accepted(llm):
    ids = llm.tokenizer.encode("The quick brown fox")
    by_text = llm.generate("The quick brown fox", SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    by_ids = llm.generate([ids], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert by_text[0].outputs[0].token_ids == by_ids[0].outputs[0].token_ids


def test_dict_prompts_as_in_vllm(llm):
    ids = llm.get_tokenizer().encode("The quick brown fox")
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    by_ids, by_text = llm.generate([{"prompt_token_ids": ids}, {"prompt": "The quick brown fox"}], params)
    assert by_ids.outputs[0].token_ids == by_text.outputs[0].token_ids
    with pytest.raises(ValueError, match="a dict prompt needs 'prompt' or 'prompt_token_ids'"):
        llm.generate([{"text": "hi"}], params)


def test_the_same_seed_gives_the_same_text_alone_and_in_a_batch_of_16(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate("Tell me a story about a dragon.", params)[0].outputs[0]
    others = [SamplingParams(temperature=0.9, max_tokens=8 + i, ignore_eos=True, seed=i if i % 2 else None)
              for i in range(15)]
    prompts = ["Tell me a story about a dragon."] + [f"prompt number {i} " * (i % 4 + 1) for i in range(15)]
    batch = llm.generate(prompts, [params] + others)
    assert batch[0].outputs[0].token_ids == alone.token_ids
    assert batch[0].outputs[0].text == alone.text
    unseeded = llm.generate(["Tell me a story about a dragon."] * 2,
                            SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids  # sampling does vary


def test_n_returns_n_different_samples(llm):
    out = llm.generate("The quick brown fox", SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12,
                                                              ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_string_ends_generation_and_is_not_returned(llm):
    full = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    stop = full.text[5:8]
    assert len(stop) == 3 and stop not in full.text[:7]
    cut = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop


def test_stop_token_ids_and_eos(llm):
    full = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    token = full.token_ids[3]
    first = full.token_ids.index(token)
    out = llm.generate("The quick", SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[token]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == token


def test_logit_bias_matches_hfs_sequence_bias(llm, llama_dir):
    """HF's generate takes the same single-token biases as `sequence_bias`: greedy output token for token,
    one request with the bias beside one without in the same batch; an id outside the vocabulary is refused."""
    from transformers import GenerationConfig

    from llmaccel.errors import InvalidRequestError
    from tests.tiny_models import _hf_model

    ids = llm.tokenizer.encode("The quick brown fox")
    plain = llm.generate([ids], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    bias = {plain[0]: -100.0, plain[3]: 4.0, 17: 2.5}
    outs = llm.generate([ids, ids], [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias=bias),
                                     SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    config = GenerationConfig(max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0,
                              sequence_bias={(token,): value for token, value in bias.items()})
    mask = torch.ones(1, len(ids), dtype=torch.long)
    with torch.no_grad():
        hf = _hf_model(llama_dir).generate(torch.tensor([ids]), attention_mask=mask, generation_config=config)
    hf = hf[0, len(ids):].tolist()
    assert outs[0].outputs[0].token_ids == hf != plain
    assert outs[1].outputs[0].token_ids == plain
    with pytest.raises(InvalidRequestError, match="logit_bias: token id 99999 is outside the vocabulary"):
        llm.generate([ids], SamplingParams(logit_bias={99999: 1}))


@pytest.mark.parametrize("chunked", [False, True])
def test_prompt_logprobs_match_hf_at_every_position(llm, llama_dir, chunked):
    """Each prompt token's logprob under HF's logits at the position before it, its top 3 and its rank;
    None for the first. The same prompt ran before, so its blocks are cached: a prompt_logprobs request
    computes them anyway. Chunked: a 16-token step budget splits the 43-token prompt into three chunks."""
    from tests.tiny_models import _hf_model

    engine = LLM(str(llama_dir), max_num_batched_tokens=16) if chunked else llm
    ids = engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好，世界! " * 3)[:43]
    engine.generate([ids], SamplingParams(temperature=0, max_tokens=2))
    out = engine.generate([ids], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=3))[0]
    with torch.no_grad():
        expected = torch.log_softmax(_hf_model(llama_dir)(torch.tensor([ids])).logits[0].float(), -1)
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    for position, entry in enumerate(out.prompt_logprobs[1:], start=1):
        row = expected[position - 1]
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(float(row[ids[position]]), abs=1e-4)
        assert list(entry.top) == row.topk(3).indices.tolist()
        assert entry.rank == int((row > row[ids[position]]).sum()) + 1
    assert engine.generate([ids], SamplingParams(temperature=0, max_tokens=2))[0].prompt_logprobs is None


def test_logprobs_match_hf_log_softmax(llm, llama_dir):
    from tests.tiny_models import _hf_model

    ids = llm.tokenizer.encode("The quick brown fox")
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=1, logprobs=3))[0].outputs[0]
    with torch.no_grad():
        hf_logits = _hf_model(llama_dir)(torch.tensor([ids])).logits[0, -1]
    expected = torch.log_softmax(hf_logits.float(), -1)
    top = expected.topk(3)
    assert out.logprobs[0].token_id == out.token_ids[0] == int(top.indices[0])
    assert list(out.logprobs[0].top) == top.indices.tolist()
    assert out.logprobs[0].logprob == pytest.approx(float(top.values[0]), abs=1e-4)


def test_chat_applies_the_template(llm):
    conversation = [{"role": "user", "content": "hello"}]
    out = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))[0]
    expected = llm.tokenizer.encode("<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n",
                                    add_special_tokens=False)
    assert out.prompt_token_ids == expected
