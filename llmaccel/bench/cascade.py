"""`llmaccel bench cascade`: what a small/large cascade would cost and agree, at every threshold.

A cascade answers each request with the small model first and hands it to the large one when the
small one is unsure. This benchmark answers the built-in chat prompts with both models (greedy), and
for every threshold on the small model's confidence (the mean log-probability of its answer's first
`--decide-tokens` tokens, the rule `llmaccel serve --cascade-small` applies) computes, over the prompts:
- cost: compute per request against large-only, from each model's measured seconds per token of a lone
  request (the small answer is paid in full when kept, up to the decision when routed; the large one
  only when routed);
- latency: the same sum in seconds (a routed request waits for both);
- agreement: the share of served answers identical to the large model's own;
- the large model's judgement: its mean log-likelihood per token of the served answers (its own
  answers score highest; an offline judge with no third model).
It plots agreement and judgement against cost, marks a recommended threshold (the cheapest whose
judgement keeps 90% of the way from small-only to large-only), and writes a JSON of the curve.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from llmaccel.bench.report import write_result
from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the large model")
    parser.add_argument("--small", required=True, help="the small model (e.g. a student from `llmaccel distill`)")
    parser.add_argument("--num-prompts", type=int, default=200, help="built-in chat prompts answered")
    parser.add_argument("--max-tokens", type=int, default=128, help="answer length limit (EOS honoured)")
    parser.add_argument("--decide-tokens", type=int, default=32,
                        help="the confidence is taken over the answer's first N tokens, as `serve "
                             "--cascade-decide-tokens` does (0: the whole answer)")
    parser.add_argument("--timing-prompts", type=int, default=4, help="lone requests timed per model for the cost")
    parser.add_argument("--keep", type=float, default=0.9,
                        help="the recommended point keeps this share of the judgement gained from small to large")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--result-json", type=Path, help="write the curve, the point and the machine here")
    parser.add_argument("--plot", type=Path, help="write the cost/agreement plot here (PNG)")


def answers(llm: LLM, conversations: list, max_tokens: int,
            decide_tokens: int | None = None) -> list[tuple[list[int], list[int], float]]:
    """(prompt ids, answer ids, mean logprob of the answer's first `decide_tokens` tokens (None: all))
    per conversation, greedy."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
    out = []
    for o in llm.chat(conversations, params, use_tqdm=False):
        tokens = list(o.outputs[0].token_ids)
        logprobs = [lp.logprob for lp in o.outputs[0].logprobs or []][:decide_tokens]
        out.append((list(o.prompt_token_ids), tokens, statistics.fmean(logprobs) if logprobs else 0.0))
    return out


def seconds_per_token(llm: LLM, conversations: list, max_tokens: int) -> float:
    """A lone request's seconds per generated token, over a few requests one at a time."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    llm.chat(conversations[:1], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm-up
    began = time.perf_counter()
    for conversation in conversations:
        llm.chat([conversation], params, use_tqdm=False)
    return (time.perf_counter() - began) / (len(conversations) * max_tokens)


def judged(large: LLM, prompt: list[int], answer: list[int]) -> float:
    """The large model's mean log-likelihood per token of `answer` after `prompt`."""
    if not answer:
        return 0.0
    logprobs = large.engine.score(prompt + answer)
    return statistics.fmean(logprobs[len(prompt) - 1:])


def sweep(small: list, large: list, small_judged: list[float], large_judged: list[float], small_spt: float,
          large_spt: float, decide_tokens: int | None = None) -> list[dict]:
    """One point per distinct threshold (route to large when confidence < threshold). A routed request
    paid the small model's first `decide_tokens` tokens (None: its whole answer)."""
    confidences = sorted({conf for _, _, conf in small})
    thresholds = [float("-inf")] + confidences + [float("inf")]
    large_only = sum(large_spt * len(a) for _, a, _ in large)
    points = []
    for threshold in thresholds:
        routed = [s[2] < threshold for s in small]
        cost = sum(small_spt * len(s[1][:decide_tokens if r else None]) + (large_spt * len(lg[1]) if r else 0)
                   for s, lg, r in zip(small, large, routed, strict=True))
        points.append({
            "threshold": threshold, "routed_to_large": sum(routed) / len(routed), "cost": cost / large_only,
            "latency_s": cost / len(routed),
            "agreement": statistics.fmean(1.0 if r else float(s[1] == lg[1])
                                          for s, lg, r in zip(small, large, routed, strict=True)),
            "judged": statistics.fmean(lj if r else sj
                                       for sj, lj, r in zip(small_judged, large_judged, routed, strict=True))})
    return points


def recommend(points: list[dict], keep: float) -> dict:
    """The cheapest point whose judgement keeps `keep` of the way from small-only to large-only."""
    small_only, large_only = points[0]["judged"], points[-1]["judged"]
    goal = small_only + keep * (large_only - small_only)
    return min((p for p in points if p["judged"] >= goal), key=lambda p: p["cost"])


def plot(points: list[dict], chosen: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    costs = [p["cost"] for p in points]
    left.plot(costs, [p["agreement"] for p in points], marker=".")
    left.set(xlabel="compute per request (large-only = 1)", ylabel="answers identical to large-only",
             title="agreement")
    right.plot(costs, [p["judged"] for p in points], marker=".")
    right.set(xlabel="compute per request (large-only = 1)",
              ylabel="large model's mean log-likelihood / token", title="judged by the large model")
    for axis, key in ((left, "agreement"), (right, "judged")):
        axis.scatter([chosen["cost"]], [chosen[key]], color="red", zorder=3,
                     label=f"threshold {chosen['threshold']:.2f}")
        axis.grid(alpha=0.3)
        axis.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def run(args: argparse.Namespace) -> int:
    prompts = builtin_prompts()[:args.num_prompts]
    conversations = [[{"role": "user", "content": p.prompt}] for p in prompts]
    large, small = LLM(args.model, dtype=args.dtype), LLM(args.small, dtype=args.dtype)
    large_spt = seconds_per_token(large, conversations[:args.timing_prompts], args.max_tokens)
    small_spt = seconds_per_token(small, conversations[:args.timing_prompts], args.max_tokens)
    decide = args.decide_tokens or None
    large_answers = answers(large, conversations, args.max_tokens)
    small_answers = answers(small, conversations, args.max_tokens, decide)
    large_judged = [judged(large, p, a) for p, a, _ in large_answers]
    small_judged = [judged(large, p, a) for p, a, _ in small_answers]
    points = sweep(small_answers, large_answers, small_judged, large_judged, small_spt, large_spt, decide)
    chosen = recommend(points, args.keep)
    print(f"lone-request seconds per token: large {large_spt * 1000:.2f} ms, small {small_spt * 1000:.2f} ms")
    print(f"{'threshold':>10s} {'to large':>9s} {'cost':>6s} {'agree':>6s} {'judged':>7s}")
    shown = points[:: max(1, len(points) // 12)] + [points[-1]]
    for p in shown:
        print(f"{p['threshold']:10.3f} {p['routed_to_large']:9.0%} {p['cost']:6.2f} {p['agreement']:6.0%} "
              f"{p['judged']:7.3f}")
    print(f"recommended: route to large below {chosen['threshold']:.3f} (mean logprob of the first "
          f"{decide or 'all'} tokens): "
          f"{chosen['routed_to_large']:.0%} routed, cost {chosen['cost']:.2f}x large-only, "
          f"agreement {chosen['agreement']:.0%}, judged {chosen['judged']:.3f} "
          f"(small-only {points[0]['judged']:.3f}, large-only {points[-1]['judged']:.3f})")
    if args.plot:
        plot(points, chosen, args.plot)
    if args.result_json:
        clean = [{k: (None if isinstance(v, float) and abs(v) == float("inf") else v) for k, v in p.items()}
                 for p in points]
        write_result(args.result_json, args, seconds_per_token={"large": large_spt, "small": small_spt},
                     recommended=clean[points.index(chosen)], points=clean)
    return 0
