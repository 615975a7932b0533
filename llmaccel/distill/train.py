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

The run's settings are distill_config.py's DistillConfig; its teacher, student, optimizer and checkpoints,
distiller.py's Distiller. This module drives a run to its budget and reports on it.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.config import DEFAULT_MODEL
from llmaccel.distill.corpus import CORPUS_NAMES
from llmaccel.distill.distill_config import DEFAULT_CORPORA, DistillConfig
from llmaccel.distill.distiller import Distiller
from llmaccel.distill.evaluate import format_report, heldout_report
from llmaccel.distill.student import LAYER_CHOICES


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
