"""The real default model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to float32) against HF."""

from __future__ import annotations

import pytest

from llmaccel.llm import LLM
from llmaccel.model.loader import hf_dir_for
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.slow

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "请用一句话介绍长城。",
             "Explain what a hash table is in two sentences."]


@pytest.fixture(scope="module")
def llm():
    return LLM("smollm2-135m")


def test_answers_the_capital_question(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0, max_tokens=32))
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


def test_greedy_tokens_match_hf_alone_and_batched(llm):
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = [hf_greedy(hf_dir_for("smollm2-135m"), ids, 40) for ids in prompts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    assert llm.generate(prompts[0], params)[0].outputs[0].token_ids == expected[0]
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == expected


def test_speculative_decoding_keeps_the_greedy_tokens(llm, tmp_path):
    """ngram and a draft model (8 of the default model's 30 layers, made here, untrained) against HF: the
    drafts change how many passes it takes, never a token."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from llmaccel.distill.student import make_student

    teacher = AutoModelForCausalLM.from_pretrained(hf_dir_for("smollm2-135m"), dtype=torch.float32)
    make_student(teacher, [0, 1, 20, 23, 24, 27, 28, 29]).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(hf_dir_for("smollm2-135m")).save_pretrained(tmp_path)
    prompts = [llm.apply_chat_template([{"role": "user", "content": q}]) for q in QUESTIONS]
    expected = [hf_greedy(hf_dir_for("smollm2-135m"), ids, 40) for ids in prompts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    for options in (dict(speculative_method="ngram"), dict(speculative_model=str(tmp_path))):
        speculative = LLM("smollm2-135m", speculative_max_batch=1000, **options)
        assert [o.outputs[0].token_ids for o in speculative.generate(prompts, params)] == expected
        stats = speculative.engine.speculation_stats
        assert stats.num_accepted_tokens > 0, options


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_lone_requests_speculative_output_is_its_plain_output_in_either_dtype(dtype):
    """bf16 kernels are chosen per row count (ops/kernel_choice.py) and round differently: a lone request's
    1 + K verification rows must run the kernel its single decode row runs, or a near-tie flips a token
    (on the AMX Xeon, brgemm for three rows against vnni_stream for one: the 300-token story below
    differed at its 54th token before spec/build.py gave them one kernel)."""
    from llmaccel.bench.compare import SINGLE_PROMPT

    conversation = [{"role": "user", "content": SINGLE_PROMPT}]
    params = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
    plain = LLM("smollm2-135m", dtype=dtype).chat(conversation, params, use_tqdm=False)[0].outputs[0].token_ids
    speculative = LLM("smollm2-135m", dtype=dtype, speculative_method="ngram", speculative_max_batch=1000)
    assert speculative.chat(conversation, params, use_tqdm=False)[0].outputs[0].token_ids == plain
    assert speculative.engine.speculation_stats.num_accepted_tokens > 0
