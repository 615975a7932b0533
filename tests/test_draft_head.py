"""The EAGLE-style draft head: the engine's paged head computes what the trained dense head computes,
reading the target's feature at the position before each token; the output stays HF's under every
scenario the draft model passes; `llmaccel distill-head` writes a head the engine loads and training
brings its cross-entropy against the target down; bad heads are refused at start."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from llmaccel.distill.draft_head import HeadConfig, HeadTrainer, distill_head
from llmaccel.distill.head_model import TrainableHead, head_spec, save_head
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams
from llmaccel.spec.draft_head import HeadDrafter
from llmaccel.spec.head_dir import is_draft_head
from tests.test_matches_hf import PROMPTS
from tests.test_speculative import ALWAYS, GREEDY, REPEATING
from tests.tiny_models import CORPUS, hf_greedy


def _random_head(target_dir: Path, out: Path, tokenizer, seed: int = 3, scale: float = 0.3) -> Path:
    torch.manual_seed(seed)
    head = TrainableHead(head_spec(target_dir))
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0, scale / p.shape[1] ** 0.5 * 4)
    save_head(head, target_dir, out, {"kind": "eagle", "target": str(target_dir), "draft_vocab": None})
    tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def setup(tiny_model_dirs, tiny_tokenizer, tmp_path_factory):
    target = tiny_model_dirs["llama-gqa"]
    head_dir = _random_head(target, tmp_path_factory.mktemp("head"), tiny_tokenizer)
    prompts = [tiny_tokenizer.encode(p) for p in [*PROMPTS, REPEATING]]
    return target, head_dir, prompts, [hf_greedy(target, p, 24) for p in prompts]


def _dense_drafts(target_dir: Path, head_dir: Path, tokens: list[int], k: int) -> list[int]:
    """The drafts after `tokens` by the dense head on HF's features: the first reads the target's feature
    at the last token's predecessor, each later one the head's own prediction."""
    from safetensors.torch import load_file

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    head = TrainableHead(head_spec(target_dir))
    head.load_engine_weights(load_file(str(head_dir / "model.safetensors")))
    with torch.no_grad():
        features = model.model(torch.tensor([tokens])).last_hidden_state[0]
        inputs = torch.cat([torch.zeros(1, features.shape[1]), features[:-1]])  # row p reads f_{p-1}
        seq, drafts = list(tokens), []
        for _ in range(k):
            embeds = model.model.embed_tokens(torch.tensor([seq]))
            predicted = head(embeds, inputs[None])[0]
            drafts.append(int(model.lm_head(predicted[-1]).argmax()))
            seq.append(drafts[-1])
            inputs = torch.cat([inputs, predicted[-1:]])
    return drafts


def _recording(drafter: HeadDrafter) -> list[tuple[list[int], list[int]]]:
    """(the request's tokens, its drafts) of every proposal, in order, by wrapping propose."""
    seen, propose = [], drafter.propose

    def wrapped(items):
        contexts = {item.request.request_id: list(item.request.all_token_ids) for item in items}
        drafts = propose(items)
        seen.extend((contexts[rid], tokens) for rid, tokens in drafts.items())
        return drafts

    drafter.propose = wrapped
    return seen


def test_a_draft_head_directory_is_recognised(setup, tiny_model_dirs):
    target, head_dir, _, _ = setup
    assert is_draft_head(head_dir) and not is_draft_head(target) and not is_draft_head("smollm2-135m")
    config = json.loads((head_dir / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["llmaccel_draft_head"]["kind"] == "eagle"


def test_the_engine_head_drafts_what_the_dense_head_does_on_the_targets_features(setup):
    target, head_dir, prompts, _ = setup
    llm = LLM(str(target), speculative_model=str(head_dir), num_speculative_tokens=3, **ALWAYS)
    assert isinstance(llm.engine.drafter, HeadDrafter)
    seen = _recording(llm.engine.drafter)
    llm.generate(prompts[:3], GREEDY)
    assert len(seen) > 10
    for tokens, drafts in seen[::3]:  # the catch-up after prefill, steady steps, after rejections
        assert drafts == _dense_drafts(target, head_dir, tokens, len(drafts))


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_output_stays_hfs_with_chunks_preemption_and_a_cached_prefix(setup, k):
    target, head_dir, prompts, expected = setup
    shared = prompts[2]
    llm = LLM(str(target), speculative_model=str(head_dir), num_speculative_tokens=k, num_kv_blocks=20, block_size=8,
              max_num_batched_tokens=16, **ALWAYS)
    assert [o.outputs[0].token_ids for o in llm.generate([*prompts, shared, shared], GREEDY)] == [
        *expected, expected[2], expected[2]]
    assert llm.engine.scheduler.num_preemptions > 0 and llm.engine.prefix_cache_stats.hits > 0
    assert llm.engine.speculation_stats.num_draft_tokens > 0
    assert llm.engine.num_free_blocks == 20
    assert not llm.engine.drafter._features  # nothing kept for finished requests


def test_sampled_requests_and_a_cut_vocabulary_run(setup, tiny_tokenizer):
    target, head_dir, prompts, expected = setup
    llm = LLM(str(target), speculative_model=str(head_dir), speculative_draft_vocab=50, **ALWAYS)
    assert llm.engine.drafter.vocabulary is not None and len(llm.engine.drafter.vocabulary.token_ids) == 50
    out = llm.generate(prompts[:2], [GREEDY, SamplingParams(temperature=0.8, seed=5, max_tokens=16)])
    assert out[0].outputs[0].token_ids == expected[0] and len(out[1].outputs[0].token_ids) == 16


def test_a_head_for_another_width_or_tokenizer_is_refused(setup, tiny_model_dirs, tiny_tokenizer, tmp_path):
    from tests.tiny_models import build_tokenizer

    target, head_dir, _, _ = setup
    wide = tmp_path / "wide"
    config = json.loads((target / "config.json").read_text())
    config["hidden_size"], config["intermediate_size"] = 96, 128
    (tmp_path / "wide-target").mkdir()
    (tmp_path / "wide-target" / "config.json").write_text(json.dumps(config))
    _random_head(tmp_path / "wide-target", wide, tiny_tokenizer)
    with pytest.raises(ValueError, match="trained for a model 96 wide, not this model's 64"):
        LLM(str(target), speculative_model=str(wide))
    other = tmp_path / "other-tokenizer"
    _random_head(target, other, build_tokenizer(vocab_size=380))
    with pytest.raises(ValueError, match="draft head .* must share the model's tokenizer"):
        LLM(str(target), speculative_model=str(other))


# ---- llmaccel distill-head ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(CORPUS * 6), encoding="utf-8")
    return path


def _config(out: Path, target: Path, corpus: Path, **overrides) -> HeadConfig:
    options = dict(out=out, model=str(target), corpora=(str(corpus),), minutes=None, max_steps=60, batch_size=4,
                   seq_len=16, lr=1e-2, warmup_steps=2, eval_windows=4, draft_vocab=1000, progress=False)
    return HeadConfig(**{**options, **overrides})


def test_distill_head_trains_a_head_the_engine_serves_and_its_loss_falls(setup, tmp_path, corpus_file):
    target, _, prompts, expected = setup
    summary = distill_head(_config(tmp_path / "head", target, corpus_file))
    assert summary["steps"] == 60 and set(summary["heldout_after"]) == {str(corpus_file)}
    # a random tiny target's next-token distribution is nearly flat (its top token is noise), so the
    # measure here is the cross-entropy against it, which the head brings down
    log = [json.loads(line) for line in (tmp_path / "head" / "distill-state" / "log.jsonl").read_text().splitlines()]
    first, last = (sum(e["ce"] for e in part) / len(part) for part in (log[:10], log[-10:]))
    assert last < 0.9 * first
    assert is_draft_head(tmp_path / "head") and (tmp_path / "head" / "token_counts.json").is_file()
    llm = LLM(str(target), speculative_model=str(tmp_path / "head"), **ALWAYS)
    assert llm.engine.drafter.vocabulary is None  # trained on the whole (tiny) vocabulary
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.speculation_stats.num_draft_tokens > 0


def test_an_interrupted_head_run_resumes_where_it_stopped(setup, tmp_path, corpus_file):
    target, _, _, _ = setup
    whole = HeadTrainer(_config(tmp_path / "whole", target, corpus_file, max_steps=4, draft_vocab=120))
    for _ in range(4):
        whole.train_step()
    first = HeadTrainer(_config(tmp_path / "parts", target, corpus_file, max_steps=4, draft_vocab=120))
    for _ in range(2):
        first.train_step()
    first.save()
    served = LLM(str(target), speculative_model=str(tmp_path / "parts"), **ALWAYS)
    assert len(served.engine.drafter.vocabulary.token_ids) == 120  # by default, the vocabulary it was trained on
    resumed = HeadTrainer(_config(tmp_path / "parts", target, corpus_file, max_steps=4, draft_vocab=120))
    assert resumed.state.step == 2
    for _ in range(2):
        resumed.train_step()
    for name, weight in whole.head.engine_weights().items():
        assert torch.allclose(weight, resumed.head.engine_weights()[name], atol=1e-6), name
    with pytest.raises(ValueError, match="seq_len = 16, not 32"):
        HeadTrainer(_config(tmp_path / "parts", target, corpus_file, seq_len=32, draft_vocab=120))


@pytest.mark.parametrize("overrides, message", [
    (dict(minutes=None, max_steps=None), "needs a budget"),
    (dict(draft_vocab=0), "--draft-vocab must be at least 1"),
    (dict(corpora=("nowhere.txt",)), "neither a file nor one of"),
    (dict(dtype="float8"), "--dtype 'float8': choose auto, float32 or bfloat16"),
])
def test_bad_head_settings_are_refused_with_their_name(tmp_path, setup, corpus_file, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path, setup[0], corpus_file, **overrides)


def test_lookup_first_copies_where_the_context_repeats_and_asks_the_head_elsewhere(setup):
    from llmaccel.spec.drafters import LookupFirstDrafter
    from llmaccel.spec.ngram import propose_ngram

    target, head_dir, prompts, expected = setup
    llm = LLM(str(target), speculative_model=str(head_dir), speculative_lookup=True, num_speculative_tokens=3,
              **ALWAYS)
    assert isinstance(llm.engine.drafter, LookupFirstDrafter)
    seen = _recording(llm.engine.drafter)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY)] == expected
    copied = [(tokens, drafts) for tokens, drafts in seen if propose_ngram(tokens, 3, 2, 4)]
    assert copied and len(copied) < len(seen)
    for tokens, drafts in copied:
        assert drafts == propose_ngram(tokens, 3, 2, 4)
    for tokens, drafts in [s for s in seen if not propose_ngram(s[0], 3, 2, 4)][::4]:
        assert drafts == _dense_drafts(target, head_dir, tokens, len(drafts))  # caught up over the copied stretch
    assert llm.engine.num_free_blocks == llm.engine.num_blocks


def test_pending_features_keep_what_the_target_kept_and_at_most_max_pending(monkeypatch):
    """A verification's rows past the kept drafts are replaced by the next step's; a stretch without drafts
    keeps its last MAX_PENDING positions (plus at most one step's chunk)."""
    from llmaccel.spec import draft_head

    def rows(first, count):
        return torch.arange(first, first + count, dtype=torch.float32).unsqueeze(1)

    pending = draft_head.PendingFeatures(10)
    pending.add(10, rows(10, 5))  # a prompt chunk: positions 10..14
    pending.add(15, rows(15, 3))  # a verification: 15 and two drafts
    pending.add(16, rows(16, 3))  # one draft kept: 17 and on are replaced
    pending.add(17, rows(17, 1))
    assert (pending.start, pending.end) == (10, 18)
    assert pending.rows().squeeze(1).tolist() == list(range(10, 18))
    monkeypatch.setattr(draft_head, "MAX_PENDING", 4)
    pending.add(18, rows(18, 2))
    pending.add(20, rows(20, 3))
    assert pending.start == 18 and pending.rows().squeeze(1).tolist() == list(range(18, 23))


def test_lookup_without_a_draft_model_is_refused():
    with pytest.raises(ValueError, match="--speculative-lookup puts prompt lookup before a draft model"):
        LLM("smollm2-135m", speculative_lookup=True)
