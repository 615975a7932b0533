"""Would a draft head on the target's own hidden states (EAGLE, Li et al. 2024) draft well enough here?

The distilled 8-layer student drafts the default model's next token 31-38% of the time, and a
speculative step needs ~70% for 1.5x (docs/results/issue15/HISTORY.md). EAGLE's draft is one decoder layer that
reads the target's last hidden state at position t together with the embedding of token t + 1, and
predicts the hidden state at t + 1, whose LM-head argmax is the draft for token t + 2: the target's
own features carry most of what it will say next. This trains such a head for a few minutes on the
teacher's features and measures, on held-out text and on the teacher's own greedy answers, how often
its argmax equals the teacher's (the first draft's acceptance under greedy decoding).

    .venv/bin/python tools/draft_head_probe.py --minutes 20 --result-json docs/results/issue15/draft-head-probe.json

The head: fc([f_t, e_{t+1}]) -> a copy of the teacher's last layer (causal, over the sequence) -> the
teacher's final norm -> the teacher's LM head (frozen). Loss: KL(teacher || head) on the teacher's
distribution for token t + 2, plus a smooth-L1 pull of the normed output towards f_{t+1} (EAGLE's
regression term). A probe, not a product: serving such a head is the next step if it drafts well.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, AutoTokenizer

from llmaccel.data.prompts import builtin_prompts
from llmaccel.distill.corpus import heldout_windows, token_corpora, training_batch
from llmaccel.llm import LLM
from llmaccel.model.loader import load_checkpoint
from llmaccel.platform import machine_record
from llmaccel.sampling_params import SamplingParams


class DraftHead(nn.Module):
    def __init__(self, teacher) -> None:
        super().__init__()
        hidden = teacher.config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        with torch.no_grad():  # start as "the feature, plus a little of the token"
            self.fc.weight.zero_()
            self.fc.weight[:, :hidden] = torch.eye(hidden)
            self.fc.weight[:, hidden:] = 0.1 * torch.eye(hidden)
        self.layer = copy.deepcopy(teacher.model.layers[-1])
        self.teacher = [teacher]  # not a submodule: frozen, not saved

    def forward(self, features: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, L, H] (the teacher's normed last hidden states at 0..L-1), next_ids [B, L] (tokens
        1..L). Returns the head's normed prediction of the features at 1..L and its logits."""
        teacher = self.teacher[0]
        x = self.fc(torch.cat([features, teacher.model.embed_tokens(next_ids)], dim=-1))
        positions = torch.arange(1, x.shape[1] + 1)[None].expand(x.shape[0], -1)
        cos_sin = teacher.model.rotary_emb(x, positions)
        mask = torch.full((x.shape[1], x.shape[1]), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)
        out = out[0] if isinstance(out, tuple) else out
        normed = teacher.model.norm(out)
        return normed, teacher.lm_head(normed)


@torch.no_grad()
def teacher_pass(teacher, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The teacher's normed last hidden states and logits for ids [B, L]."""
    out = teacher.model(ids)
    features = out.last_hidden_state
    return features, teacher.lm_head(features)


def loss_and_agreement(head: DraftHead, teacher, ids: torch.Tensor) -> tuple[torch.Tensor, float]:
    """ids [B, L + 1]: features at 0..L-1, the head predicts the teacher's distribution at 1..L-1."""
    features, logits = teacher_pass(teacher, ids[:, :-1])
    normed, head_logits = head(features[:, :-1], ids[:, 1:-1])
    target = logits[:, 1:].float()
    kl = F.kl_div(F.log_softmax(head_logits.float(), -1), F.log_softmax(target, -1), log_target=True,
                  reduction="batchmean") / target.shape[1]
    regression = F.smooth_l1_loss(normed.float(), features[:, 1:].float())
    agree = (head_logits.argmax(-1) == target.argmax(-1)).float().mean().item()
    return kl + regression, agree


def greedy_agreement(head: DraftHead, teacher, tokenizer, model: str, prompts: int, max_tokens: int) -> float:
    """On the teacher's greedy answers to built-in prompts (from the end of the list: not in the chat
    corpus's first 200): how often the head's draft for each answer token equals the teacher's."""
    llm = LLM(model, dtype="float32")
    chosen = builtin_prompts()[-prompts:]
    outputs = llm.chat([[{"role": "user", "content": p.prompt}] for p in chosen],
                       SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    hits = total = 0
    with torch.no_grad():
        for out in outputs:
            ids = torch.tensor([list(out.prompt_token_ids) + list(out.outputs[0].token_ids)])
            start = len(out.prompt_token_ids)
            features, logits = teacher_pass(teacher, ids)
            _, head_logits = head(features[:, :-1], ids[:, 1:])
            # head position j predicts the teacher's distribution at j + 1, i.e. token j + 2
            drafted = head_logits[0, start - 1:-1].argmax(-1)
            wanted = logits[0, start:-1].argmax(-1)
            hits += int((drafted == wanted).sum())
            total += len(wanted)
    return hits / max(total, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--teacher", default="smollm2-135m", help="the target model")
    parser.add_argument("--corpus", action="append", default=None, help="chat, enwiki, sanguo or a file (repeatable)")
    parser.add_argument("--state-dir", type=Path, default=Path("students/probe-state"),
                        help="where the chat corpus (the teacher's answers) is generated once")
    parser.add_argument("--minutes", type=float, default=20, help="training time")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--greedy-prompts", type=int, default=24, help="held-out prompts for the greedy check")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args()
    torch.manual_seed(0)
    teacher_dir = load_checkpoint(args.teacher).hf_dir
    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir, dtype=torch.float32).eval()
    for parameter in teacher.parameters():
        parameter.requires_grad_(False)
    corpora = token_corpora(args.corpus or ["chat", "enwiki"], tokenizer, teacher_dir, args.state_dir, args.seq_len)
    head = DraftHead(teacher)
    trainable = [p for p in head.parameters() if p.requires_grad]
    for p in trainable:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    heldout = torch.cat([heldout_windows(c, args.seq_len, 8) for c in corpora])
    with torch.no_grad():
        before = loss_and_agreement(head, teacher, heldout)[1]
        before_greedy = greedy_agreement(head, teacher, tokenizer, args.teacher, args.greedy_prompts, 128)
    print(f"before training: held-out agreement {before:.1%}, on greedy answers {before_greedy:.1%}", flush=True)
    generator = torch.Generator().manual_seed(0)
    began, step, curve = time.monotonic(), 0, []
    use_bf16 = torch.backends.mkldnn.is_available()
    while time.monotonic() - began < args.minutes * 60:
        batch = training_batch(corpora, args.batch_size, args.seq_len, generator)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=use_bf16):
            loss, agree = loss_and_agreement(head, teacher, batch)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        curve.append((step, round(time.monotonic() - began, 1), loss.item(), agree))
        if step % 10 == 0:
            recent = curve[-10:]
            print(f"step {step} ({recent[-1][1]:.0f} s): loss {statistics.fmean(c[2] for c in recent):.3f}, "
                  f"batch agreement {statistics.fmean(c[3] for c in recent):.1%}", flush=True)
    with torch.no_grad():
        after = loss_and_agreement(head, teacher, heldout)[1]
        after_greedy = greedy_agreement(head, teacher, tokenizer, args.teacher, args.greedy_prompts, 128)
    print(f"after {step} steps ({args.minutes} min): held-out agreement {after:.1%}, on greedy answers "
          f"{after_greedy:.1%}")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            "machine": machine_record(), "args": {k: str(v) for k, v in vars(args).items()}, "steps": step,
            "heldout_agreement": {"before": before, "after": after},
            "greedy_answer_agreement": {"before": before_greedy, "after": after_greedy}, "curve": curve}, indent=1)
            + "\n")


if __name__ == "__main__":
    main()
