"""Teacher against student on held-out windows: each one's perplexity on the text, how often the student's
top token is the teacher's, and the KL divergence KL(teacher || student) per token, all in float32."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from llmaccel.distill.corpus import TokenCorpus, heldout_windows


@torch.no_grad()
def compare_on_windows(teacher, student, windows: torch.Tensor, batch_size: int = 4) -> dict[str, float]:
    """Sums over the windows' predicted tokens: teacher and student negative log-likelihood, top-1
    agreements, KL; and the token count."""
    totals = {"tokens": 0, "teacher_nll": 0.0, "student_nll": 0.0, "agree": 0, "kl": 0.0}
    for start in range(0, len(windows), batch_size):
        batch = windows[start:start + batch_size]
        inputs, targets = batch[:, :-1], batch[:, 1:]
        teacher_logp = F.log_softmax(teacher(inputs).logits.float(), dim=-1)
        student_logp = F.log_softmax(student(inputs).logits.float(), dim=-1)
        totals["tokens"] += targets.numel()
        totals["teacher_nll"] -= teacher_logp.gather(-1, targets[..., None]).sum().item()
        totals["student_nll"] -= student_logp.gather(-1, targets[..., None]).sum().item()
        totals["agree"] += (teacher_logp.argmax(-1) == student_logp.argmax(-1)).sum().item()
        totals["kl"] += F.kl_div(student_logp, teacher_logp, log_target=True, reduction="sum").item()
    return totals


def heldout_report(teacher, student, corpora: list[TokenCorpus], seq_len: int, windows: int) -> dict[str, dict]:
    """Per corpus: teacher and student perplexity, top-1 agreement with the teacher, mean KL a token."""
    report = {}
    was_training = student.training
    student.eval()
    try:
        for corpus in corpora:
            totals = compare_on_windows(teacher, student, heldout_windows(corpus, seq_len, windows))
            n = max(totals["tokens"], 1)
            report[corpus.name] = {
                "tokens": totals["tokens"],
                "teacher_perplexity": math.exp(totals["teacher_nll"] / n),
                "student_perplexity": math.exp(totals["student_nll"] / n),
                "top1_agreement": totals["agree"] / n,
                "kl_per_token": totals["kl"] / n,
            }
    finally:
        student.train(was_training)
    return report


def format_report(report: dict[str, dict]) -> str:
    lines = ["| corpus | tokens | teacher ppl | student ppl | top-1 agreement | KL a token |",
             "|---|---|---|---|---|---|"]
    for name, r in report.items():
        lines.append(f"| {name} | {r['tokens']} | {r['teacher_perplexity']:.2f} | {r['student_perplexity']:.2f} | "
                     f"{r['top1_agreement']:.1%} | {r['kl_per_token']:.3f} |")
    return "\n".join(lines)
