"""Distiller: one `llmaccel distill` run's teacher, student, optimizer and data, with the step that trains
the student and the checkpoint that saves and restores them as one (train.py drives it to its budget).

The loss is kl_weight x KL(teacher || student) on the full vocabulary (temperature T, scaled by T^2 as
Hinton et al. do) plus (1 - kl_weight) x cross-entropy on the text.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from llmaccel.distill.corpus import token_corpora, training_batch
from llmaccel.distill.distill_config import DistillConfig, check_resumable, learning_rate, training_dtype
from llmaccel.distill.evaluate import heldout_report
from llmaccel.distill.student import copying_layers, influential_layers, make_student, spaced_layers
from llmaccel.spec.draft_vocab import write_token_counts

# what a resumed run must share with the run that wrote the checkpoint
_RESUME_KEYS = ("teacher", "student_layers", "layer_choice", "corpora", "batch_size", "seq_len", "seed")


@dataclass
class RunState:
    """What a checkpoint holds besides the weights."""

    step: int = 0
    seconds: float = 0.0  # training time over every session of the run
    horizon: int | None = None  # steps the schedule spans when only --minutes bounds the run
    layers: list[int] = field(default_factory=list)
    influence: list[float] | None = None
    attention_scores: dict | None = None  # --layer-choice copy: each layer's induction and previous-token score
    initial_report: dict | None = None
    log: list[dict] = field(default_factory=list)


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 kl_weight: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL a token, cross-entropy a token), all in float32."""
    s, t = student_logits.float(), teacher_logits.float()
    kl = F.kl_div(F.log_softmax(s / temperature, -1).flatten(0, 1), F.log_softmax(t / temperature, -1).flatten(0, 1),
                  log_target=True, reduction="batchmean") * temperature**2
    ce = F.cross_entropy(s.flatten(0, 1), targets.flatten())
    return kl_weight * kl + (1 - kl_weight) * ce, kl, ce


class Distiller:
    """One run: the teacher, the student, the optimizer and the data, saved and restored as one."""

    def __init__(self, config: DistillConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from llmaccel.model.loader import hf_dir_for

        self.config = config
        self.out = Path(config.out).expanduser()
        self.state_dir = self.out / "distill-state"
        self.checkpoint_dir = self.state_dir / "checkpoint"
        self.teacher_dir = hf_dir_for(config.teacher)
        self.tokenizer = AutoTokenizer.from_pretrained(self.teacher_dir)
        self.teacher = AutoModelForCausalLM.from_pretrained(self.teacher_dir, dtype=torch.float32).eval()
        self.teacher.requires_grad_(False)
        self.dtype = training_dtype(config)
        if config.restart and self.checkpoint_dir.exists():
            shutil.rmtree(self.checkpoint_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(self.out)
        self.corpora = token_corpora(list(config.corpora), self.tokenizer, self.teacher_dir, self.state_dir,
                                     config.seq_len, chat_prompts=config.chat_prompts,
                                     chat_max_tokens=config.chat_max_tokens, seed=config.seed)
        # what the student will write most, for a draft head cut to it (spec/draft_vocab.py)
        write_token_counts(self.out, [c.train for c in self.corpora], [c.name for c in self.corpora])
        self.generator = torch.Generator().manual_seed(config.seed)
        if (self.checkpoint_dir / "train_state.pt").is_file():
            self._resume(AutoModelForCausalLM)
        else:
            self._start()

    def _start(self) -> None:
        config, teacher_layers = self.config, self.teacher.config.num_hidden_layers
        self.state = RunState()
        if config.layer_choice == "spaced":
            self.state.layers = spaced_layers(teacher_layers, config.student_layers)
        else:  # on windows of its own generator, so the training draws do not depend on the choice
            probe = training_batch(self.corpora, 4, config.seq_len, torch.Generator().manual_seed(config.seed + 1))
            if config.layer_choice == "copy":
                self.state.layers, self.state.influence, self.state.attention_scores = copying_layers(
                    self.teacher, probe[:, :-1], config.student_layers)
            else:
                self.state.layers, self.state.influence = influential_layers(self.teacher, probe[:, :-1],
                                                                             config.student_layers)
        self.student = make_student(self.teacher, self.state.layers)
        self.optimizer = self._optimizer()
        self.state.initial_report = heldout_report(self.teacher, self.student, self.corpora, config.seq_len,
                                                   config.eval_windows)

    def _resume(self, model_class) -> None:
        saved = torch.load(self.checkpoint_dir / "train_state.pt", weights_only=False)
        check_resumable(saved["config"], asdict(self.config), _RESUME_KEYS, self.out)
        self.student = model_class.from_pretrained(self.checkpoint_dir, dtype=torch.float32)
        self.optimizer = self._optimizer()
        self.optimizer.load_state_dict(saved["optimizer"])
        self.generator.set_state(saved["generator"])
        self.state = RunState(**saved["run"])

    def _optimizer(self) -> torch.optim.Optimizer:
        self.student.train()
        return torch.optim.AdamW(self.student.parameters(), lr=self.config.lr, betas=(0.9, 0.95), weight_decay=0.0)

    def done(self) -> bool:
        config, state = self.config, self.state
        return ((config.max_steps is not None and state.step >= config.max_steps)
                or (config.minutes is not None and state.seconds >= config.minutes * 60))

    def train_step(self) -> dict:
        config, state = self.config, self.state
        began = time.perf_counter()
        batch = training_batch(self.corpora, config.batch_size, config.seq_len, self.generator)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        rate = learning_rate(config, state.step, config.max_steps or state.horizon)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            with torch.no_grad():
                teacher_logits = self.teacher(inputs).logits
            student_logits = self.student(inputs).logits
        loss, kl, ce = distill_loss(student_logits, teacher_logits, targets, config.kl_weight, config.temperature)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.student.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.seconds += time.perf_counter() - began
        if state.horizon is None and state.step == 3:  # the first steps set the pace
            self.estimate_horizon()
        entry = {"step": state.step, "tokens": state.step * config.batch_size * config.seq_len,
                 "loss": loss.item(), "kl": kl.item(), "ce": ce.item(), "lr": rate,
                 "seconds": round(state.seconds, 2)}
        state.log.append(entry)
        return entry

    def estimate_horizon(self) -> None:
        """With only --minutes to bound the run, the steps its schedule spans, at the pace so far: first
        after three steps, then again at each checkpoint while the schedule is short of its floor (three
        steps slowed by anything else on the machine made a 40-minute run's cosine end at step 313 of
        497). A schedule at its floor stays there, a budget extended on resume included."""
        config, state = self.config, self.state
        if config.max_steps is not None or state.step < 3 or state.seconds <= 0:
            return
        if state.horizon is not None and state.step >= state.horizon:
            return
        state.horizon = max(state.step + 1, int(config.minutes * 60 / (state.seconds / state.step)))

    def save(self) -> None:
        """The student and the run state, swapped in whole; then the student exported to --out."""
        fresh = self.state_dir / "checkpoint.new"
        if fresh.exists():
            shutil.rmtree(fresh)
        self.student.save_pretrained(fresh)
        torch.save({"config": asdict(self.config), "optimizer": self.optimizer.state_dict(),
                    "generator": self.generator.get_state(), "run": asdict(self.state)}, fresh / "train_state.pt")
        old = self.state_dir / "checkpoint.old"
        if self.checkpoint_dir.exists():
            self.checkpoint_dir.rename(old)
        fresh.rename(self.checkpoint_dir)
        if old.exists():
            shutil.rmtree(old)
        for item in self.checkpoint_dir.iterdir():  # the student as written above, not serialized again
            if item.name != "train_state.pt":
                shutil.copy2(item, self.out / item.name)
        with open(self.state_dir / "log.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in self.state.log)
