"""DistillConfig, the settings of a `llmaccel distill` run, checked at construction; and what follows from
a training run's settings, shared with `llmaccel distill-head` (draft_head.py): the checks of its flags,
whether a checkpoint's run may be resumed, the learning-rate schedule, the training dtype.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch

from llmaccel.config import DEFAULT_MODEL
from llmaccel.distill.corpus import check_corpus_names
from llmaccel.distill.student import LAYER_CHOICES

DEFAULT_CORPORA = ("enwiki", "sanguo", "chat")


@dataclass(frozen=True)
class DistillConfig:
    out: Path
    teacher: str = DEFAULT_MODEL
    student_layers: int = 8
    layer_choice: str = "influence"
    corpora: tuple[str, ...] = DEFAULT_CORPORA
    minutes: float | None = 30.0
    max_steps: int | None = None
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 5e-4
    warmup_steps: int = 20
    kl_weight: float = 0.5
    temperature: float = 1.0
    dtype: str = "auto"
    checkpoint_minutes: float = 5.0
    eval_windows: int = 16
    chat_prompts: int = 200
    chat_max_tokens: int = 320
    seed: int = 0
    restart: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if self.layer_choice not in LAYER_CHOICES:
            raise ValueError(f"--layer-choice {self.layer_choice!r}: choose {' or '.join(LAYER_CHOICES)}")
        check_corpus_names(list(self.corpora))
        check_run_settings(self.minutes, self.max_steps, self.dtype,
                           positive=(("--minutes", self.minutes), ("--checkpoint-minutes", self.checkpoint_minutes),
                                     ("--lr", self.lr), ("--temperature", self.temperature)),
                           at_least_one=(("--max-steps", self.max_steps), ("--batch-size", self.batch_size),
                                         ("--seq-len", self.seq_len), ("--eval-windows", self.eval_windows)))
        if not 0.0 <= self.kl_weight <= 1.0:
            raise ValueError(f"--kl-weight must be in [0, 1], got {self.kl_weight}")


def check_run_settings(minutes: float | None, max_steps: int | None, dtype: str,
                       positive: tuple[tuple[str, float | None], ...],
                       at_least_one: tuple[tuple[str, int | None], ...]) -> None:
    """What the flags of every training run (distill, distill-head) must hold: a budget, positive rates
    and durations, counts of at least 1 (None: not given), a dtype the trainers know."""
    if minutes is None and max_steps is None:
        raise ValueError("give --minutes or --max-steps (or both): the run needs a budget")
    for name, value in positive:
        if value is not None and not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")
    for name, value in at_least_one:
        if value is not None and value < 1:
            raise ValueError(f"{name} must be at least 1, got {value}")
    if dtype not in ("auto", "float32", "bfloat16"):
        raise ValueError(f"--dtype {dtype!r}: choose auto, float32 or bfloat16")


def learning_rate(config: DistillConfig, step: int, horizon: int | None) -> float:
    warm = min(1.0, (step + 1) / config.warmup_steps)
    if horizon is None or step < config.warmup_steps:
        return config.lr * warm
    progress = min(1.0, (step - config.warmup_steps) / max(1, horizon - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def check_resumable(saved: dict, mine: dict, keys: tuple[str, ...], out: Path) -> None:
    """A ValueError naming the first of `keys` on which the checkpoint's run and this one differ."""
    for key in keys:
        theirs, ours = saved[key], mine[key]
        if (list(theirs) if isinstance(theirs, tuple | list) else theirs) != (
                list(ours) if isinstance(ours, tuple | list) else ours):
            raise ValueError(f"{out} holds a run with {key} = {theirs!r}, not {ours!r}: give the same "
                             "flags to resume it, --restart to start over, or another --out")


def training_dtype(config: DistillConfig) -> torch.dtype:
    from llmaccel.platform import auto_dtype

    name = auto_dtype("cpu") if config.dtype == "auto" else config.dtype
    return torch.bfloat16 if name == "bfloat16" else torch.float32
