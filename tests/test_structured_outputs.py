"""Structured outputs in the engine: grammar-masked greedy decoding token for token against HF's model
masked by an independent matcher; outputs of the real model validated with jsonschema; errors."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import llguidance.hf
import pytest
import torch

from llmaccel.errors import InvalidRequestError
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.structured.compiler import unpack_masks
from llmaccel.structured.params import MAX_SPEC_BYTES, StructuredOutputsParams
from tests.tiny_models import _hf_model

BOUNDED = {"type": "object", "properties": {
    "id": {"type": "integer", "minimum": 0, "maximum": 999},
    "tag": {"type": "string", "maxLength": 4},
    "ok": {"type": "boolean"}}, "required": ["id", "tag", "ok"], "additionalProperties": False}
TINY_CONSTRAINTS = [StructuredOutputsParams(regex=r"[0-9]{2,4}(-[a-z]{1,3})?"),
                    StructuredOutputsParams(choice=("Paris", "London", "the quick brown fox")),
                    StructuredOutputsParams(json=BOUNDED),
                    StructuredOutputsParams(grammar='start: "yes" | "no" | NUMBER\nNUMBER: /[0-9]{1,3}/'),
                    StructuredOutputsParams(grammar='root ::= "[" [a-c]{1,3} "]"')]  # GBNF


@pytest.fixture(scope="module")
def llm(llama_dir):
    return LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)


def hf_masked_greedy(model_dir, tokenizer, prompt_ids: list[int], constraint: StructuredOutputsParams,
                     eos: int, max_new_tokens: int) -> list[int]:
    """HF's model, greedy, each step masked by a fresh llguidance matcher of the constraint: the oracle."""
    model = _hf_model(model_dir)
    vocab = model.config.vocab_size
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab, eos_token=eos),
                                   constraint.grammar_text())
    ids, out = list(prompt_ids), []
    with torch.no_grad():
        while len(out) < max_new_tokens and not matcher.is_stopped():
            logits = model(torch.tensor([ids])).logits[0, -1]
            mask = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)[None]
            token = int(logits.masked_fill(~unpack_masks(mask, vocab)[0], float("-inf")).argmax())
            assert matcher.consume_token(token)
            ids.append(token)
            out.append(token)
    return out


def test_masked_greedy_matches_hf_in_a_mixed_batch(llm, llama_dir):
    """Constrained and free requests share steps; each gets exactly its own oracle's tokens."""
    tok, eos = llm.tokenizer, llm.engine.spec.eos_token_ids[0]
    prompts = ["The quick brown fox", "What is the capital of France?", "你好，世界", "def hello():", "A"]
    params = [SamplingParams(temperature=0, max_tokens=40, structured_outputs=c) for c in TINY_CONSTRAINTS]
    free = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompts + prompts[:2], params + [free, free])
    for prompt, constraint, out in zip(prompts, TINY_CONSTRAINTS, outs, strict=False):
        want = hf_masked_greedy(llama_dir, tok, tok.encode(prompt), constraint, eos, 40)
        got = out.outputs[0].token_ids
        assert got == want, constraint
        assert out.outputs[0].finish_reason == "stop"  # the grammar completed: ended without an EOS step
    text = [o.outputs[0].text for o in outs]
    assert re.fullmatch(r"[0-9]{2,4}(-[a-z]{1,3})?", text[0])
    assert text[1] in ("Paris", "London", "the quick brown fox")
    jsonschema.validate(json.loads(text[2]), BOUNDED)
    assert re.fullmatch(r"yes|no|[0-9]{1,3}", text[3]) and re.fullmatch(r"\[[a-c]{1,3}\]", text[4])
    free_alone = llm.generate(prompts[:2], free)
    assert [o.outputs[0].token_ids for o in outs[5:]] == [o.outputs[0].token_ids for o in free_alone]


def test_masks_hold_through_preemption_and_speculation(llama_dir):
    """A tight KV pool preempts and recomputes; ngram drafts are masked row by row and rolled back:
    the constrained greedy tokens stay the unconstrained engine's oracle's."""
    base = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64)
    tight = LLM(str(llama_dir), dtype="float32", num_kv_blocks=24, block_size=4, speculative_method="ngram",
                num_speculative_tokens=3)
    constraint = StructuredOutputsParams(regex=r"(the quick brown fox ){1,4}jumps")
    prompts = ["The quick brown fox jumps over the lazy dog. The quick brown fox", "A paged KV cache stores",
               "Continuous batching packs every", "What is the capital"]
    params = SamplingParams(temperature=0, max_tokens=60, structured_outputs=constraint)
    want = [o.outputs[0].token_ids for o in base.generate(prompts, params)]
    assert [o.outputs[0].token_ids for o in tight.generate(prompts, params)] == want
    assert tight.engine.num_preemptions > 0 and tight.engine.speculation_stats.num_draft_tokens > 0
    assert tight.engine.num_free_blocks == tight.engine.num_blocks


def test_seeded_sampling_stays_in_the_grammar(llm):
    constraint = StructuredOutputsParams(json=BOUNDED)
    outs = llm.generate(["The quick brown fox"] * 6, [SamplingParams(temperature=1.2, seed=s, max_tokens=60,
                                                                      structured_outputs=constraint) for s in range(6)])
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), BOUNDED)
    assert len({o.outputs[0].text for o in outs}) > 1


@pytest.mark.parametrize(("constraint", "message"), [
    ({"json": {"type": "wat"}}, "the JSON schema is invalid"),
    ({"regex": "[a-"}, "the regex is invalid"),
    ({"grammar": "start: undefined_rule"}, "the grammar is invalid"),
])
def test_an_invalid_constraint_is_refused_naming_it(llm, constraint, message):
    params = SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(**constraint, source="x"))
    with pytest.raises(InvalidRequestError, match=message) as info:
        llm.engine.add_request("bad", "A", params)
    assert info.value.param == "x" and not llm.engine.has_unfinished_requests()


@pytest.mark.parametrize(("fields", "message"), [
    ({}, "exactly one of"),
    ({"regex": "a", "choice": ("a",)}, r"exactly one of .* \(got regex, choice\)"),
    ({"choice": ()}, "non-empty list of strings"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "must be an object"),
    ({"regex": "a" * (MAX_SPEC_BYTES + 1)}, "at most 65536"),
])
def test_structured_outputs_params_check_their_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        StructuredOutputsParams(**fields)


def test_equal_schemas_are_one_key_and_property_order_is_kept():
    a = StructuredOutputsParams(json={"type": "object", "properties": {"b": {}, "a": {}}})
    b = StructuredOutputsParams(json='{"type": "object",  "properties": {"b": {}, "a": {}}}', source="guided_json")
    assert a == b and hash(a) == hash(b) and a.json.index('"b"') < a.json.index('"a"')
    assert SamplingParams(structured_outputs={"choice": ["x", "y"]}).structured_outputs.choice == ("x", "y")


def test_the_mask_kernel_equals_torch_on_odd_vocabularies():
    """The C++ kernel (skip, fill and bit-by-bit words, a last partial word) against torch's unpack."""
    from llmaccel.sampler import apply_masks, mask_kernels

    if mask_kernels() is None:
        pytest.skip("no C++ kernels on this machine")
    gen = torch.Generator().manual_seed(3)
    for vocab in (31, 32, 1000, 49155):
        logits = torch.randn(7, vocab, generator=gen)
        masks = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), generator=gen, dtype=torch.int32)
        masks[0, ::3], masks[1, ::2] = 0, -1
        want = logits.clone()
        want[[6, 1, 3, 0]] = want[[6, 1, 3, 0]].masked_fill(~unpack_masks(masks, vocab), float("-inf"))
        assert torch.equal(apply_masks(logits.clone(), [6, 1, 3, 0], masks), want)


def test_logprobs_of_a_constrained_request_stay_the_models_own(llama_dir):
    """The mask chooses, but the logprobs are the raw model's (as vLLM's), drafted tokens' too."""
    llm = LLM(str(llama_dir), dtype="float32", num_kv_blocks=64, speculative_method="ngram")
    constraint = StructuredOutputsParams(regex=r"(the quick brown fox ){2,3}")
    prompt = llm.tokenizer.encode("The quick brown fox jumps. the quick brown fox")
    (out,) = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=40, logprobs=0,
                                                    structured_outputs=constraint))
    ids = out.outputs[0].token_ids
    model = _hf_model(llama_dir)
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), dim=-1)
    want = [float(raw[len(prompt) - 1 + j, token]) for j, token in enumerate(ids)]
    got = [lp.logprob for lp in out.outputs[0].logprobs]
    assert got == pytest.approx(want, abs=1e-4) and min(got) < -1  # the mask forced some unlikely tokens
