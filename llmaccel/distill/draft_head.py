"""`llmaccel distill-head`: train an EAGLE-style draft head (distill/head_model.py) on a model's own
features, for `--speculative-model DIR`.

    llmaccel distill-head --model smollm2-135m --corpus self-chat --corpus chat-greedy --minutes 40 \\
        --out students/smollm2-head

Each step runs the target (frozen) over windows of the corpora (each drawn in proportion to its size;
by default the target's own greedy answers, which is what it verifies) for its final hidden states f and
trains the head to predict f_p from (token p, f_{p-1}): cross-entropy against the target's next-token
distribution over the draft vocabulary (the `--draft-vocab` most frequent tokens, which the head drafts
over when served) plus `--feature-weight` x smooth-L1 on f_p itself (EAGLE's two losses). Drafting K
tokens feeds the head its own predictions after the first, so each step also runs a second pass on the
first pass's predicted features (EAGLE-3's training-time test, one step deep). The decoder layer starts
from the target's last layer. Checkpoints every few minutes; the same command resumes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from llmaccel.config import DEFAULT_MODEL
from llmaccel.distill.corpus import CORPUS_NAMES, check_corpus_names, heldout_windows, token_corpora, training_batch
from llmaccel.distill.distill_config import check_resumable, check_run_settings, learning_rate, training_dtype
from llmaccel.distill.head_model import TrainableHead, head_spec, save_head
from llmaccel.spec.draft_vocab import frequent_tokens, write_token_counts

DEFAULT_CORPORA = ("self-chat", "chat-greedy")
_RESUME_KEYS = ("model", "corpora", "batch_size", "seq_len", "draft_vocab", "seed", "self_chat_conversations")


@dataclass(frozen=True)
class HeadConfig:
    out: Path
    model: str = DEFAULT_MODEL
    corpora: tuple[str, ...] = DEFAULT_CORPORA
    minutes: float | None = 30.0
    max_steps: int | None = None
    batch_size: int = 8
    seq_len: int = 256
    lr: float = 1e-3
    warmup_steps: int = 20
    draft_vocab: int = 8192
    feature_weight: float = 1.0
    noise: float = 0.05
    dtype: str = "auto"
    checkpoint_minutes: float = 5.0
    eval_windows: int = 16
    chat_prompts: int = 200
    chat_max_tokens: int = 320
    self_chat_conversations: int = 2000
    seed: int = 0
    restart: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        check_corpus_names(list(self.corpora))
        check_run_settings(self.minutes, self.max_steps, self.dtype,
                           positive=(("--minutes", self.minutes), ("--lr", self.lr),
                                     ("--checkpoint-minutes", self.checkpoint_minutes)),
                           at_least_one=(("--max-steps", self.max_steps), ("--batch-size", self.batch_size),
                                         ("--seq-len", self.seq_len), ("--draft-vocab", self.draft_vocab),
                                         ("--eval-windows", self.eval_windows),
                                         ("--self-chat-conversations", self.self_chat_conversations)))
        if self.feature_weight < 0 or self.noise < 0:
            raise ValueError("--feature-weight and --noise must not be negative")


@dataclass
class HeadState:
    step: int = 0
    seconds: float = 0.0
    horizon: int | None = None
    log: list[dict] = field(default_factory=list)


class HeadTrainer:
    def __init__(self, config: HeadConfig) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from llmaccel.model.loader import hf_dir_for

        self.config = config
        self.out = Path(config.out).expanduser()
        self.state_dir = self.out / "distill-state"
        self.model_dir = hf_dir_for(config.model)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        self.target = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32).eval()
        self.target.requires_grad_(False)
        self.dtype = training_dtype(config)
        if config.restart and self.state_dir.exists():
            shutil.rmtree(self.state_dir / "checkpoint", ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.tokenizer.save_pretrained(self.out)
        self.corpora = token_corpora(list(config.corpora), self.tokenizer, self.model_dir, self.state_dir,
                                     config.seq_len, chat_prompts=config.chat_prompts,
                                     chat_max_tokens=config.chat_max_tokens, seed=config.seed,
                                     self_chat_conversations=config.self_chat_conversations)
        write_token_counts(self.out, [c.train for c in self.corpora], [c.name for c in self.corpora])
        vocab = self.target.config.vocab_size
        self.token_ids = frequent_tokens(self.out, self.tokenizer, min(config.draft_vocab, vocab), vocab)
        self.cut_head = self.target.lm_head.weight[self.token_ids].detach()
        with torch.random.fork_rng():  # fc starts at random, the same for the same --seed
            torch.manual_seed(config.seed)
            self.head = TrainableHead(head_spec(self.model_dir))
        self.generator = torch.Generator().manual_seed(config.seed)
        self.state = HeadState()
        checkpoint = self.state_dir / "checkpoint" / "train_state.pt"
        if checkpoint.is_file():
            saved = torch.load(checkpoint, weights_only=False)
            check_resumable(saved["config"], asdict(config), _RESUME_KEYS, self.out)
            self.head.load_engine_weights(saved["weights"])
            self.state = HeadState(**saved["run"])
        else:
            self.head.init_from(self.target, self.target.config.num_hidden_layers - 1)
        self.optimizer = torch.optim.AdamW(self.head.parameters(), lr=config.lr, betas=(0.9, 0.95), weight_decay=0.0)
        if checkpoint.is_file():
            self.optimizer.load_state_dict(saved["optimizer"])
            self.generator.set_state(saved["generator"])
        self.initial_report = self.evaluate() if self.state.step == 0 else None

    @torch.no_grad()
    def _target_side(self, batch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(embeds of tokens 1.., features at 0.. as the head's inputs, features at 1.. as its targets)."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            features = self.target.model(batch).last_hidden_state.float()
        embeds = self.target.model.embed_tokens(batch[:, 1:]).float()
        return embeds, features[:, :-1], features[:, 1:]

    def _losses(self, embeds: torch.Tensor, inputs: torch.Tensor, targets: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(predicted features, token cross-entropy, feature smooth-L1) of one pass."""
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.dtype == torch.bfloat16):
            predicted = self.head(embeds, inputs)
            logits = predicted @ self.cut_head.to(predicted.dtype).T
            with torch.no_grad():
                target_logits = targets @ self.cut_head.T
        ce = torch.sum(-F.softmax(target_logits.float(), -1) * F.log_softmax(logits.float(), -1), -1).mean()
        return predicted, ce, F.smooth_l1_loss(predicted.float(), targets)

    def train_step(self) -> dict:
        config, state = self.config, self.state
        began = time.perf_counter()
        batch = training_batch(self.corpora, config.batch_size, config.seq_len, self.generator, by_size=True)
        embeds, inputs, targets = self._target_side(batch)
        rate = learning_rate(config, state.step, config.max_steps or state.horizon)
        for group in self.optimizer.param_groups:
            group["lr"] = rate
        noisy = inputs + (torch.rand(inputs.shape, generator=self.generator) * 2 - 1) * config.noise
        predicted, ce1, feat1 = self._losses(embeds, noisy, targets)
        # the second draft reads the first's prediction: position p sees the head's f_{p-1}, not the target's
        shifted = torch.cat([inputs[:, :1], predicted[:, :-1].detach().float()], dim=1)
        _, ce2, feat2 = self._losses(embeds, shifted, targets)
        loss = ce1 + ce2 + config.feature_weight * (feat1 + feat2)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 1.0)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        state.step += 1
        state.seconds += time.perf_counter() - began
        if state.step == 3 or (state.horizon is not None and state.step < state.horizon and state.step % 50 == 0):
            if config.max_steps is None:
                state.horizon = max(state.step + 1, int(config.minutes * 60 / (state.seconds / state.step)))
        entry = {"step": state.step, "tokens": state.step * config.batch_size * config.seq_len, "loss": loss.item(),
                 "ce": ce1.item(), "ce_second": ce2.item(), "feature": feat1.item(), "lr": rate,
                 "seconds": round(state.seconds, 2)}
        state.log.append(entry)
        return entry

    @torch.no_grad()
    def evaluate(self) -> dict[str, dict[str, float]]:
        """Per corpus, on held-out windows: how often the head's top draft token (over the draft vocabulary)
        is the target's top token (over the whole vocabulary), reading the target's feature (first draft)
        and reading its own (second draft)."""
        report = {}
        for corpus in self.corpora:
            windows = heldout_windows(corpus, self.config.seq_len, self.config.eval_windows)
            hits = [0, 0]
            total = 0
            for start in range(0, len(windows), 4):
                batch = windows[start:start + 4]
                embeds, inputs, targets = self._target_side(batch)
                wanted = self.target.lm_head(targets).argmax(-1)
                first, _, _ = self._losses(embeds, inputs, targets)
                shifted = torch.cat([inputs[:, :1], first[:, :-1].float()], dim=1)
                second, _, _ = self._losses(embeds, shifted, targets)
                for i, predicted in enumerate((first, second)):
                    drafted = self.token_ids[(predicted.float() @ self.cut_head.T).argmax(-1)]
                    hits[i] += (drafted == wanted).sum().item()
                total += wanted.numel()
            report[corpus.name] = {"first_draft_agreement": hits[0] / total, "second_draft_agreement": hits[1] / total,
                                   "tokens": total}
        return report

    def save(self) -> None:
        fresh = self.state_dir / "checkpoint.new"
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir(parents=True)
        torch.save({"config": asdict(self.config), "weights": self.head.engine_weights(),
                    "optimizer": self.optimizer.state_dict(), "generator": self.generator.get_state(),
                    "run": asdict(self.state)}, fresh / "train_state.pt")
        checkpoint = self.state_dir / "checkpoint"
        shutil.rmtree(checkpoint, ignore_errors=True)
        fresh.rename(checkpoint)
        save_head(self.head, self.model_dir, self.out,
                  {"kind": "eagle", "target": self.config.model, "draft_vocab": len(self.token_ids),
                   "steps": self.state.step})
        with open(self.state_dir / "log.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(entry) + "\n" for entry in self.state.log)

    def done(self) -> bool:
        config, state = self.config, self.state
        return ((config.max_steps is not None and state.step >= config.max_steps)
                or (config.minutes is not None and state.seconds >= config.minutes * 60))


def distill_head(config: HeadConfig) -> dict:
    """Train (or resume) a draft head to its budget; returns the summary written to --out/distill.json."""
    from llmaccel.platform import describe

    run = HeadTrainer(config)
    state = run.state
    bar = tqdm(total=config.max_steps or state.horizon, initial=state.step, desc="distill-head", unit="step",
               disable=not config.progress)
    last_save = time.monotonic()
    try:
        while not run.done():
            entry = run.train_step()
            if state.horizon is not None and bar.total != state.horizon and not config.max_steps:
                bar.total = state.horizon
            bar.update(1)
            bar.set_postfix(ce=f"{entry['ce']:.3f}", ce2=f"{entry['ce_second']:.3f}", feat=f"{entry['feature']:.3f}",
                            tok_s=f"{entry['tokens'] / max(entry['seconds'], 1e-9):.0f}")
            if time.monotonic() - last_save >= config.checkpoint_minutes * 60:
                run.save()
                last_save = time.monotonic()
    except KeyboardInterrupt:
        bar.close()
        run.save()
        print(f"interrupted at step {state.step}; saved. Run the same command again to resume.")
        raise
    bar.close()
    run.save()
    final = run.evaluate()
    head_params = sum(p.numel() for p in run.head.parameters())
    summary = {"model": config.model, "model_dir": str(run.model_dir), "head_parameters": head_params,
               "target_parameters": sum(p.numel() for p in run.target.parameters()), "steps": state.step,
               "tokens": state.step * config.batch_size * config.seq_len,
               "training_minutes": round(state.seconds / 60, 2),
               "training_dtype": str(run.dtype).removeprefix("torch."),
               "machine": describe(), "heldout_before": run.initial_report, "heldout_after": final,
               "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(config).items()}}
    (run.out / "distill.json").write_text(json.dumps(summary, indent=1, ensure_ascii=False), encoding="utf-8")
    print(f"\n{run.out}: {state.step} steps, {summary['tokens']:,} tokens, {summary['training_minutes']} min; "
          f"a head of {head_params / 1e6:.1f}M parameters")
    for name, row in final.items():
        print(f"  {name:12s} first draft = target's token {row['first_draft_agreement']:.1%}, "
              f"second {row['second_draft_agreement']:.1%} ({row['tokens']} held-out tokens)")
    return summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", required=True, help="the head's directory (give it to --speculative-model)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="the target the head drafts for: model alias or HF directory")
    parser.add_argument("--corpus", action="append", dest="corpora",
                        help=f"training text: {', '.join(CORPUS_NAMES)} or a UTF-8 file; repeatable "
                             f"(default: {', '.join(DEFAULT_CORPORA)}); chat-greedy: the target's greedy answers to "
                             "the built-in prompts, the text it verifies when decoding greedily; self-chat: its greedy "
                             "answers to questions it wrote itself (Magpie), as many as --self-chat-conversations")
    parser.add_argument("--minutes", type=float, default=30.0, help="training time budget, resumed sessions included")
    parser.add_argument("--max-steps", type=int, help="stop after this many optimizer steps (also sets the schedule)")
    parser.add_argument("--batch-size", type=int, default=8, help="windows a step")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens a window")
    parser.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (AdamW)")
    parser.add_argument("--warmup-steps", type=int, default=20, help="steps of linear warm-up")
    parser.add_argument("--draft-vocab", type=int, default=8192,
                        help="the frequent tokens the head is trained to draft over (and drafts over when served)")
    parser.add_argument("--feature-weight", type=float, default=1.0,
                        help="weight of the smooth-L1 loss on the predicted features beside the token cross-entropy")
    parser.add_argument("--noise", type=float, default=0.05,
                        help="uniform noise (+-) added to the target's features the head reads, as EAGLE does")
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU has it natively), float32, "
                                                        "bfloat16")
    parser.add_argument("--checkpoint-minutes", type=float, default=5.0, help="minutes between checkpoints")
    parser.add_argument("--eval-windows", type=int, default=16, help="held-out windows a corpus in the report")
    parser.add_argument("--chat-prompts", type=int, default=200, help="built-in prompts the chat corpora answer")
    parser.add_argument("--chat-max-tokens", type=int, default=320, help="longest answer in the chat corpora")
    parser.add_argument("--self-chat-conversations", type=int, default=2000,
                        help="questions the target writes itself for the self-chat corpus (some are dropped: "
                             "unfinished, too short or repeated)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data draws and the chat answers")
    parser.add_argument("--restart", action="store_true", help="discard a checkpoint in --out and start over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar (the summary still prints)")


def run(args: argparse.Namespace) -> int:
    config = HeadConfig(out=Path(args.out), model=args.model, corpora=tuple(args.corpora or DEFAULT_CORPORA),
                        minutes=args.minutes, max_steps=args.max_steps, batch_size=args.batch_size,
                        seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps, draft_vocab=args.draft_vocab,
                        feature_weight=args.feature_weight, noise=args.noise, dtype=args.dtype,
                        checkpoint_minutes=args.checkpoint_minutes, eval_windows=args.eval_windows,
                        chat_prompts=args.chat_prompts, chat_max_tokens=args.chat_max_tokens, seed=args.seed,
                        self_chat_conversations=args.self_chat_conversations, restart=args.restart,
                        progress=not args.no_progress)
    try:
        distill_head(config)
    except KeyboardInterrupt:
        return 130
    return 0
