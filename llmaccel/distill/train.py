"""`llmaccel distill`: train a student (a subset of the teacher's layers) on the teacher's next-token
distributions, on this machine's fast dtype, with checkpoints it resumes from.

    llmaccel distill --teacher smollm2-135m --student-layers 8 --corpus enwiki --corpus sanguo \\
        --corpus chat --minutes 30 --out students/smollm2-8l

The loss is kl_weight x KL(teacher || student) on the full vocabulary (temperature T, scaled by T^2 as
Hinton et al. do) plus (1 - kl_weight) x cross-entropy on the text. The teacher's logits are computed on
the fly: a run sees each window once, so caching them would not save a forward pass. The learning rate
warms up, then follows a cosine to a tenth over the run (its length from --max-steps, or estimated from
the first steps' speed and --minutes, and kept with the checkpoints).

`--out` is an ordinary model directory (`--model DIR` serves it) once the first checkpoint is written;
`DIR/distill-state/` holds the optimizer and data state, the loss log and the teacher's chat answers.
Run the same command again after an interruption and it resumes where the last checkpoint was.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from llmaccel.config import DEFAULT_MODEL
from llmaccel.distill.corpus import CORPUS_NAMES, check_corpus_names, token_corpora, training_batch
from llmaccel.distill.evaluate import format_report, heldout_report
from llmaccel.distill.student import LAYER_CHOICES, copying_layers, influential_layers, make_student, spaced_layers
from llmaccel.spec.draft_vocab import write_token_counts

DEFAULT_CORPORA = ("enwiki", "sanguo", "chat")
# what a resumed run must share with the run that wrote the checkpoint
_RESUME_KEYS = ("teacher", "student_layers", "layer_choice", "corpora", "batch_size", "seq_len", "seed")


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


def learning_rate(config: DistillConfig, step: int, horizon: int | None) -> float:
    warm = min(1.0, (step + 1) / config.warmup_steps)
    if horizon is None or step < config.warmup_steps:
        return config.lr * warm
    progress = min(1.0, (step - config.warmup_steps) / max(1, horizon - config.warmup_steps))
    return config.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, targets: torch.Tensor,
                 kl_weight: float, temperature: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, KL a token, cross-entropy a token), all in float32."""
    s, t = student_logits.float(), teacher_logits.float()
    kl = F.kl_div(F.log_softmax(s / temperature, -1).flatten(0, 1), F.log_softmax(t / temperature, -1).flatten(0, 1),
                  log_target=True, reduction="batchmean") * temperature**2
    ce = F.cross_entropy(s.flatten(0, 1), targets.flatten())
    return kl_weight * kl + (1 - kl_weight) * ce, kl, ce


def check_resumable(saved: dict, mine: dict, keys: tuple[str, ...], out: Path) -> None:
    """A ValueError naming the first of `keys` on which the checkpoint's run and this one differ."""
    for key in keys:
        theirs, ours = saved[key], mine[key]
        if (list(theirs) if isinstance(theirs, tuple | list) else theirs) != (
                list(ours) if isinstance(ours, tuple | list) else ours):
            raise ValueError(f"{out} holds a run with {key} = {theirs!r}, not {ours!r}: give the same "
                             "flags to resume it, --restart to start over, or another --out")


def _training_dtype(config: DistillConfig) -> torch.dtype:
    from llmaccel.platform import auto_dtype

    name = auto_dtype("cpu") if config.dtype == "auto" else config.dtype
    return torch.bfloat16 if name == "bfloat16" else torch.float32


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
        self.dtype = _training_dtype(config)
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


def plot_curve(log: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = [entry["tokens"] / 1e6 for entry in log]
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, label in (("loss", "loss"), ("kl", "KL(teacher || student)"), ("ce", "cross-entropy")):
        ax.plot(tokens, [entry[key] for entry in log], label=label, linewidth=1)
    ax.set_xlabel("training tokens (millions)")
    ax.set_ylabel("nats a token")
    ax.set_title("llmaccel distill: training curve")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def distill(config: DistillConfig) -> dict:
    """Run (or resume) a distillation to its budget; returns the summary written to --out/distill.json.
    A KeyboardInterrupt saves a checkpoint first, then propagates."""
    from llmaccel.platform import describe

    run = Distiller(config)
    state = run.state
    resumed = state.step > 0
    if resumed:
        print(f"resuming {run.out} at step {state.step} ({state.seconds / 60:.1f} min trained)")
    print(f"student: teacher layers {state.layers} of {run.teacher.config.num_hidden_layers} ({config.layer_choice}); "
          f"training in {str(run.dtype).removeprefix('torch.')}")
    total = config.max_steps or state.horizon
    if total is not None and total <= state.step:  # a budget extended past the schedule's estimate
        total = None
    bar = tqdm(total=total, initial=state.step, desc="distill", unit="step", disable=not config.progress)
    last_save = time.monotonic()
    try:
        while not run.done():
            entry = run.train_step()
            if not bar.total and state.horizon is not None and state.horizon > state.step:
                bar.total = state.horizon
                bar.refresh()
            bar.update(1)
            bar.set_postfix(loss=f"{entry['loss']:.3f}", kl=f"{entry['kl']:.3f}", ce=f"{entry['ce']:.3f}",
                            tok_s=f"{entry['tokens'] / max(entry['seconds'], 1e-9):.0f}")
            if time.monotonic() - last_save >= config.checkpoint_minutes * 60:
                run.estimate_horizon()
                if bar.total and state.horizon is not None and state.horizon > state.step:
                    bar.total = state.horizon
                run.save()
                last_save = time.monotonic()
    except KeyboardInterrupt:
        bar.close()
        run.save()
        print(f"interrupted at step {state.step}; saved. Run the same command again to resume.")
        raise
    bar.close()
    run.save()
    final = heldout_report(run.teacher, run.student, run.corpora, config.seq_len, config.eval_windows)
    plot_curve(state.log, run.state_dir / "training-curve.png")
    teacher_params = sum(p.numel() for p in run.teacher.parameters())
    student_params = sum(p.numel() for p in run.student.parameters())
    summary = {
        "teacher": config.teacher, "teacher_dir": str(run.teacher_dir), "student_layers": state.layers,
        "block_influence": state.influence, "attention_scores": state.attention_scores,
        "teacher_parameters": teacher_params,
        "student_parameters": student_params, "steps": state.step,
        "tokens": state.step * config.batch_size * config.seq_len, "training_minutes": round(state.seconds / 60, 2),
        "training_dtype": str(run.dtype).removeprefix("torch."), "machine": describe(),
        "heldout_before": state.initial_report, "heldout_after": final,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()},
    }
    (run.out / "distill.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False), encoding="utf-8")
    print(f"\n{run.out}: {state.step} steps, {summary['tokens']:,} tokens, {summary['training_minutes']} min; "
          f"{student_params / 1e6:.1f}M parameters against the teacher's {teacher_params / 1e6:.1f}M")
    if state.initial_report:
        print("\nheld out, before training:\n" + format_report(state.initial_report))
    print("\nheld out, after:\n" + format_report(final))
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the student's directory (a model directory --model loads)")
    parser.add_argument("--teacher", default=DEFAULT_MODEL, help="teacher: model alias, GGUF file or HF directory")
    parser.add_argument("--student-layers", type=int, default=8, help="decoder layers the student keeps")
    parser.add_argument("--layer-choice", choices=LAYER_CHOICES, default="influence",
                        help="which teacher layers: spaced (every k-th, first and last kept), influence (those "
                             "that change the hidden state most on the corpus, ShortGPT's block influence) or copy "
                             "(the teacher's induction and previous-token layers, the first and last, the rest by "
                             "influence: for a draft model, which must continue what the context repeats)")
    parser.add_argument("--corpus", action="append", dest="corpora",
                        help=f"training text: {', '.join(CORPUS_NAMES)} (chat: the teacher's answers to the built-in "
                             "chat prompts sampled at temperature 0.7; chat-greedy: its greedy answers, the text a "
                             "draft model meets) or a UTF-8 file; repeatable "
                             f"(default: {', '.join(DEFAULT_CORPORA)})")
    parser.add_argument("--minutes", type=float, default=30.0,
                        help="training time budget over the whole run, resumed sessions included")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (also sets the schedule)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows a step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a window")
    parser.add_argument("--lr", type=float, default=5e-4, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps of linear warm-up")
    parser.add_argument("--kl-weight", type=float, default=0.5,
                        help="share of KL(teacher || student) in the loss; the rest is cross-entropy on the text")
    parser.add_argument("--temperature", type=float, default=1.0, help="softmax temperature of the KL term")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 autocast where the CPU computes it natively (AMX or AVX512-BF16), "
                             "else float32; or float32, bfloat16")
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0, help="minutes between checkpoints")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows a corpus in the report")
    parser.add_argument("--chat-prompts", type=int, default=200, help="built-in prompts the chat corpus answers")
    parser.add_argument("--chat-max-tokens", type=int, default=320, help="longest teacher answer in the chat corpus")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data draws and the chat answers")
    parser.add_argument("--restart", action="store_true", help="discard a checkpoint in --out and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary still prints)")


def run(args: argparse.Namespace) -> int:
    config = DistillConfig(out=Path(args.out), teacher=args.teacher, student_layers=args.student_layers,
                           layer_choice=args.layer_choice, corpora=tuple(args.corpora or DEFAULT_CORPORA),
                           minutes=args.minutes, max_steps=args.max_steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                           kl_weight=args.kl_weight, temperature=args.temperature, dtype=args.dtype,
                           checkpoint_minutes=args.checkpoint_minutes, eval_windows=args.eval_windows,
                           chat_prompts=args.chat_prompts, chat_max_tokens=args.chat_max_tokens, seed=args.seed,
                           restart=args.restart, progress=not args.no_progress)
    try:
        distill(config)
    except KeyboardInterrupt:
        return 130
    return 0
