"""`llmaccel distill` on tiny teachers made here: which layers the student keeps and that they are the
teacher's, that the output directory is a model llmaccel serves token-identical to HF, that an
interrupted run resumes to the very weights an uninterrupted one reaches, and that training brings the
student closer to its teacher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from llmaccel import LLM
from llmaccel.distill.distill_config import DistillConfig
from llmaccel.distill.distiller import Distiller
from llmaccel.distill.student import (
    attention_pattern_scores,
    choose_copying_layers,
    copying_layers,
    influential_layers,
    make_student,
    spaced_layers,
)
from llmaccel.distill.train import distill
from llmaccel.sampling_params import SamplingParams
from tests.tiny_models import CORPUS, _common, hf_greedy


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """A four-layer tiny Llama with tied embeddings."""
    config = LlamaConfig(**{**_common(tiny_tokenizer), "num_hidden_layers": 4}, num_attention_heads=4,
                         num_key_value_heads=2, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(7)
    out = tmp_path_factory.mktemp("teacher")
    LlamaForCausalLM(config).eval().save_pretrained(out)
    tiny_tokenizer.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def corpus_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text("\n".join(CORPUS * 6), encoding="utf-8")
    return path


def _config(out: Path, teacher_dir: Path, corpus_file: Path, **overrides) -> DistillConfig:
    options = dict(out=out, teacher=str(teacher_dir), student_layers=2, corpora=(str(corpus_file),), minutes=None,
                   max_steps=4, batch_size=2, seq_len=16, lr=3e-3, warmup_steps=2, eval_windows=2, progress=False)
    return DistillConfig(**{**options, **overrides})


def test_spaced_layers_keep_the_first_and_the_last():
    assert spaced_layers(30, 8) == [0, 4, 8, 12, 17, 21, 25, 29]
    assert spaced_layers(4, 4) == [0, 1, 2, 3]
    assert spaced_layers(4, 2) == [0, 3]
    assert spaced_layers(4, 1) == [3]
    for keep in (0, 5):
        with pytest.raises(ValueError, match="--student-layers"):
            spaced_layers(4, keep)


def test_a_student_with_every_layer_computes_what_the_teacher_does(teacher_dir):
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    student = make_student(teacher, [0, 1, 2, 3]).eval()
    ids = torch.tensor([[5, 9, 17, 33, 2, 71, 8]])
    with torch.no_grad():
        assert torch.equal(student(ids).logits, teacher(ids).logits)


def test_the_kept_layers_are_the_teachers(teacher_dir):
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    student = make_student(teacher, [1, 3])
    assert student.config.num_hidden_layers == 2
    for mine, theirs in ((0, 1), (1, 3)):
        for name, tensor in student.model.layers[mine].state_dict().items():
            assert torch.equal(tensor, teacher.model.layers[theirs].state_dict()[name]), name
    assert torch.equal(student.model.embed_tokens.weight, teacher.model.embed_tokens.weight)
    assert student.lm_head.weight.data_ptr() == student.model.embed_tokens.weight.data_ptr()  # still tied
    with pytest.raises(ValueError, match="distinct teacher layer indices"):
        make_student(teacher, [3, 1])


def test_influence_drops_a_layer_that_leaves_the_hidden_state_as_it_was(teacher_dir):
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    with torch.no_grad():  # layer 2 adds nothing to the residual stream: its output is its input
        teacher.model.layers[2].self_attn.o_proj.weight.zero_()
        teacher.model.layers[2].mlp.down_proj.weight.zero_()
    windows = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    chosen, scores = influential_layers(teacher, windows, keep=3)
    assert scores[2] == pytest.approx(0.0, abs=1e-6)
    assert chosen == [0, 1, 3]


def test_copy_keeps_the_induction_layer_the_previous_token_layer_before_it_the_ends_then_influence():
    induction = [0.9, 0.1, 0.2, 0.8, 0.3, 0.1]  # layer 0's score never counts: an induction head reads an earlier one
    previous = [0.1, 0.3, 0.7, 0.2, 0.9, 0.1]  # layer 4 is the strongest, but it comes after the induction layer
    influence = [0.9, 0.5, 0.1, 0.2, 0.6, 0.3]
    assert choose_copying_layers(induction, previous, influence, 2) == [2, 3]
    assert choose_copying_layers(induction, previous, influence, 4) == [0, 2, 3, 5]
    assert choose_copying_layers(induction, previous, influence, 5) == [0, 2, 3, 4, 5]  # then 4, by influence
    assert choose_copying_layers([0.0], [0.0], [1.0], 1) == [0]


def test_the_attention_scores_are_read_per_layer_and_the_attention_kernel_is_restored(teacher_dir):
    teacher = LlamaForCausalLM.from_pretrained(teacher_dir).eval()
    kernel = teacher.config._attn_implementation
    induction, previous = attention_pattern_scores(teacher)
    assert len(induction) == len(previous) == teacher.config.num_hidden_layers
    assert all(0.0 <= x <= 1.0 for x in induction + previous)
    assert teacher.config._attn_implementation == kernel
    windows = torch.randint(3, 300, (2, 12), generator=torch.Generator().manual_seed(0))
    chosen, influence, scores = copying_layers(teacher, windows, 2)
    assert scores == {"induction": induction, "previous_token": previous}  # the same seeded sequence
    assert chosen == choose_copying_layers(induction, previous, influence, 2)


def test_the_student_is_a_model_llmaccel_serves_as_hf_runs_it(tmp_path, teacher_dir, corpus_file):
    summary = distill(_config(tmp_path / "student", teacher_dir, corpus_file, max_steps=3))
    out = tmp_path / "student"
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert summary["steps"] == 3 and summary["tokens"] == 3 * 2 * 16
    assert len(summary["student_layers"]) == 2 and summary["heldout_after"][str(corpus_file)]["tokens"] == 2 * 16
    assert (out / "distill-state" / "training-curve.png").stat().st_size > 0
    llm = LLM(str(out), dtype="float32")
    prompt = [5, 9, 17, 33, 2, 71, 8]
    got = llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=12, temperature=0.0,
                                                                     ignore_eos=True))[0].outputs[0].token_ids
    assert list(got) == hf_greedy(out, prompt, 12)


def test_an_interrupted_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path, teacher_dir, corpus_file,
                                                                           monkeypatch):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    distill(_config(straight, teacher_dir, corpus_file, max_steps=4))
    real_step = Distiller.train_step

    def interrupted_after_two(self):  # Ctrl-C as the third step starts
        if self.state.step == 2:
            raise KeyboardInterrupt
        return real_step(self)

    monkeypatch.setattr(Distiller, "train_step", interrupted_after_two)
    with pytest.raises(KeyboardInterrupt):
        distill(_config(resumed, teacher_dir, corpus_file, max_steps=4))
    monkeypatch.setattr(Distiller, "train_step", real_step)
    first_half = [json.loads(line) for line in (resumed / "distill-state" / "log.jsonl").read_text().splitlines()]
    assert [entry["step"] for entry in first_half] == [1, 2]
    distill(_config(resumed, teacher_dir, corpus_file, max_steps=4))
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    losses = [[json.loads(line)["loss"] for line in (d / "distill-state" / "log.jsonl").read_text().splitlines()]
              for d in (straight, resumed)]
    assert losses[0] == losses[1] and len(losses[0]) == 4
    with pytest.raises(ValueError, match="student_layers = 2, not 3"):
        distill(_config(resumed, teacher_dir, corpus_file, student_layers=3, max_steps=6))


def test_a_minutes_budget_re_estimates_its_schedule_until_the_floor(tmp_path, teacher_dir, corpus_file):
    run = Distiller(_config(tmp_path / "s", teacher_dir, corpus_file, max_steps=None, minutes=10.0))
    for _ in range(3):
        run.train_step()
    state = run.state
    assert state.horizon == max(4, int(600 / (state.seconds / 3)))  # from the first three steps' pace
    state.seconds = 3 * 2.0  # as if they had taken 2 s each: 300 steps fit in 10 minutes
    run.estimate_horizon()
    assert state.horizon == 300
    state.step, state.seconds = 300, 300 * 0.5  # at the floor: a faster pace no longer moves it
    run.estimate_horizon()
    assert state.horizon == 300


def test_training_brings_the_student_closer_to_its_teacher(tmp_path, teacher_dir, corpus_file):
    summary = distill(_config(tmp_path / "s", teacher_dir, corpus_file, student_layers=1, max_steps=80,
                              kl_weight=1.0))
    name = str(corpus_file)
    before, after = summary["heldout_before"][name], summary["heldout_after"][name]
    assert after["kl_per_token"] < 0.8 * before["kl_per_token"]


def test_the_chat_corpora_are_the_teachers_answers_sampled_and_greedy(tmp_path, teacher_dir):
    out = tmp_path / "s"
    distill(DistillConfig(out=out, teacher=str(teacher_dir), student_layers=2, corpora=("chat", "chat-greedy"),
                          minutes=None, max_steps=1, batch_size=2, seq_len=16, eval_windows=1, chat_prompts=6,
                          chat_max_tokens=24, progress=False))
    for name in ("chat", "chat-greedy"):
        lines = (out / "distill-state" / f"{name}-corpus.jsonl").read_text().splitlines()
        answers = [json.loads(line) for line in lines]
        assert len(answers) == 6 and all(a["prompt"] and isinstance(a["answer"], str) for a in answers)
        text = (out / "distill-state" / f"{name}-corpus.txt").read_text()
        assert text.count("<|im_start|>assistant") == 6
    greedy = LLM(str(teacher_dir)).chat([[{"role": "user", "content": a["prompt"]}] for a in answers],
                                        SamplingParams(temperature=0, max_tokens=24))
    assert [a["answer"] for a in answers] == [g.outputs[0].text for g in greedy]
    # the training text's token counts, for a draft head cut to the frequent tokens
    counts = json.loads((out / "token_counts.json").read_text())
    assert counts["sources"] == ["chat", "chat-greedy"]
    tokenizer = AutoTokenizer.from_pretrained(out)
    train = [tokenizer((out / "distill-state" / f"{n}-corpus.txt").read_text(), add_special_tokens=False)["input_ids"]
             for n in ("chat", "chat-greedy")]
    assert sum(counts["counts"].values()) == sum(int(len(ids) * (1 - 0.05)) for ids in train)


def test_self_chat_is_the_teachers_own_questions_answered_greedily(tmp_path, teacher_dir, tiny_tokenizer):
    from llmaccel.distill.corpus import self_chat_text

    cache = tmp_path / "self-chat-corpus.txt"
    text = self_chat_text(teacher_dir, cache, conversations=60, max_tokens=16, seed=0)
    chats = [json.loads(line) for line in cache.with_suffix(".jsonl").read_text().splitlines()]
    questions = [c["prompt"] for c in chats]
    assert 3 <= len(chats) < 60  # unfinished and too short questions dropped
    assert len(set(questions)) == len(questions) and all(len(q) >= 10 for q in questions)
    # each question is what the teacher samples at the start of a user turn, seed by seed, up to its end
    start = tiny_tokenizer("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    asked = LLM(str(teacher_dir)).generate([start] * 60, [SamplingParams(temperature=1.0, top_p=0.95, max_tokens=96,
                                                                         seed=i, stop=["<|im_end|>"])
                                                          for i in range(60)])
    finished = [o.outputs[0].text.strip() for o in asked if o.outputs[0].finish_reason == "stop"]
    assert set(questions) <= set(finished)
    greedy = LLM(str(teacher_dir)).chat([[{"role": "user", "content": q}] for q in questions],
                                        SamplingParams(temperature=0, max_tokens=16))
    assert [c["answer"] for c in chats] == [g.outputs[0].text for g in greedy]
    assert text.count("<|im_start|>assistant") == len(chats) and self_chat_text(teacher_dir, cache, 1, 1, 1) == text


@pytest.mark.parametrize("overrides, message", [
    ({"corpora": ("no-such-corpus",)}, "'no-such-corpus' is neither a file nor one of"),
    ({"kl_weight": 1.5}, "--kl-weight must be in"),
    ({"max_steps": None, "minutes": None}, "give --minutes or --max-steps"),
    ({"layer_choice": "random"}, "--layer-choice 'random'"),
    ({"seq_len": 0}, "--seq-len must be at least 1"),
])
def test_bad_settings_are_refused_with_their_name(tmp_path, teacher_dir, corpus_file, overrides, message):
    with pytest.raises(ValueError, match=message):
        _config(tmp_path / "s", teacher_dir, corpus_file, **overrides)


def test_more_layers_than_the_teacher_has_is_refused(tmp_path, teacher_dir, corpus_file):
    with pytest.raises(ValueError, match="the teacher has 4 layers"):
        distill(_config(tmp_path / "s", teacher_dir, corpus_file, student_layers=5, layer_choice="spaced"))
