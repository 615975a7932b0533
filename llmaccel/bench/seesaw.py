"""`llmaccel bench seesaw`: for each acceleration llmaccel offers, what it buys in speed and what it costs in
answers, side by side in one run on one machine.

Arms (one engine each, loaded in turn): float32 (the reference), bf16, int8, int4, the GGUF file's own
Q4_1 kernels, an INT8 KV cache, ngram speculative decoding, prefix caching off, and, given `--student`, a
distilled student alone and as the small half of a cascade. The batching arms (1, 16 and 64 requests at a
time) run the default engine with the questions asked that many at a time.

Speed: W1 (one chat prompt x 128 tokens, tok/s), W2 (64 prompts x 64 tokens, tok/s), TTFT of a new
~400-token prompt and of the same prompt sent again (what the prefix cache saves). Quality
(bench/seesaw_quality.py): accuracy on questions with known answers (English trivia, English and Chinese
cloze), perplexity on 2,048 tokens each of Wikipedia and the Three Kingdoms, greedy answers identical to
float32's, and diversity under sampling at batch 1 against batch 64. One table, one plot (W2 against
accuracy); the recommended point is the fastest arm within `--max-accuracy-drop` points of float32's
accuracy and `--max-ppl-increase` of its perplexity.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.bench.provenance import provenance
from llmaccel.bench.seesaw_quality import Question, distinct_n, question_sets, score, self_bleu
from llmaccel.bench.student import agreement as student_agreement
from llmaccel.data.corpora import load_corpus
from llmaccel.data.prompts import builtin_prompts
from llmaccel.llm import LLM
from llmaccel.platform import machine_record
from llmaccel.quantization.perplexity import perplexity
from llmaccel.sampling_params import SamplingParams

DEFAULT_ARMS = ("float32", "bf16", "int8", "int4", "gguf", "kv-int8", "spec-ngram", "no-prefix-cache", "student",
                "cascade", "batch-1", "batch-16", "batch-64")


@dataclass(frozen=True)
class Arm:
    name: str
    options: dict = field(default_factory=dict)  # engine options
    batch: int | None = None  # the batching arms: questions asked this many at a time
    student: bool = False  # the distilled student instead of the model
    cascade: bool = False  # the student first, the model where the student is unsure


def arms(args: argparse.Namespace) -> list[Arm]:
    table = {
        "float32": Arm("float32", {"dtype": "float32"}), "bf16": Arm("bf16", {"dtype": "bfloat16"}),
        "int8": Arm("int8", {"quantization": "int8"}), "int4": Arm("int4", {"quantization": "int4"}),
        "gguf": Arm("gguf", {"quantization": "gguf"}), "kv-int8": Arm("kv-int8", {"kv_cache_dtype": "int8"}),
        "spec-ngram": Arm("spec-ngram", {"speculative_method": "ngram"}),
        "no-prefix-cache": Arm("no-prefix-cache", {"enable_prefix_caching": False}),
        "student": Arm("student", student=True), "cascade": Arm("cascade", cascade=True),
        **{f"batch-{n}": Arm(f"batch-{n}", batch=n) for n in (1, 16, 64)},
    }
    chosen = [a.strip() for a in args.arms.split(",") if a.strip()]
    unknown = [a for a in chosen if a not in table]
    if unknown:
        raise ValueError(f"unknown arm(s) {', '.join(unknown)}; choose from {', '.join(table)}")
    if chosen[0] != "float32":
        raise ValueError("--arms must start with float32: the reference every agreement is counted against")
    if not args.student and any(table[a].student or table[a].cascade for a in chosen):
        print("no --student: the student and cascade arms are left out", file=sys.stderr)
        chosen = [a for a in chosen if not (table[a].student or table[a].cascade)]
    return [table[a] for a in chosen]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="the model every arm serves (real weights)")
    parser.add_argument("--student", help="a student of `llmaccel distill` for the student and cascade arms")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help="arms to run, float32 first")
    parser.add_argument("--questions", type=int, default=100, help="questions per set (trivia, cloze-en, cloze-zh)")
    parser.add_argument("--ppl-tokens", type=int, default=2048, help="tokens of each corpus scored")
    parser.add_argument("--agreement-prompts", type=int, default=32, help="built-in prompts answered greedily")
    parser.add_argument("--cascade-threshold", type=float, default=-1.0,
                        help="the cascade keeps the student's answer when its mean logprob over the first 32 "
                             "tokens is at least this")
    parser.add_argument("--max-accuracy-drop", type=float, default=2.0,
                        help="the recommended arm loses at most this many accuracy points against float32")
    parser.add_argument("--max-ppl-increase", type=float, default=0.03,
                        help="... and raises perplexity by at most this share")
    parser.add_argument("--result-json", type=Path, default=Path("seesaw.json"), help="the figures")
    parser.add_argument("--plot", type=Path, default=Path("seesaw.png"), help="speed against accuracy (PNG)")


def _chat(llm: LLM, prompts: list[str], params: SamplingParams) -> list:
    return llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)


def speed(llm: LLM, long_prompts: list[str]) -> dict:
    """W1, W2 (medians of two rounds) and TTFT of a new and of a repeated long prompt."""
    chat = [p.prompt for p in builtin_prompts()[:64]]
    _chat(llm, chat[:2], SamplingParams(max_tokens=8))
    w1, w2 = [], []
    for _ in range(2):
        began = time.perf_counter()
        _chat(llm, chat[:1], SamplingParams(temperature=0, max_tokens=128, ignore_eos=True))
        w1.append(128 / (time.perf_counter() - began))
        began = time.perf_counter()
        _chat(llm, chat, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
        w2.append(64 * 64 / (time.perf_counter() - began))
    cold, warm = [], []
    for prompt in long_prompts:
        for times in (cold, warm):
            began = time.perf_counter()
            llm.generate(prompt, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
            times.append((time.perf_counter() - began) * 1000)
    return {"w1_tok_s": statistics.median(w1), "w2_tok_s": statistics.median(w2),
            "ttft_ms": statistics.median(cold), "ttft_repeat_ms": statistics.median(warm)}


def ask(llm: LLM, questions: list[Question], batch: int | None, max_tokens: int = 24) -> list[list[int]]:
    """Greedy replies (token ids), `batch` questions at a time (None: all at once)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    size = batch or len(questions)
    replies: list[list[int]] = []
    for start in range(0, len(questions), size):
        group = questions[start:start + size]
        chat = [q for q in group if q.chat]
        plain = [q for q in group if not q.chat]
        out = {id(q): o for q, o in zip(chat, _chat(llm, [q.prompt for q in chat], params) if chat else [],
                                        strict=True)}
        out |= {id(q): o for q, o in zip(plain, llm.generate([q.prompt for q in plain], params, use_tqdm=False)
                                         if plain else [], strict=True)}
        replies += [list(out[id(q)].outputs[0].token_ids) for q in group]
    return replies


def accuracy(llm: LLM, sets: dict[str, list[Question]], replies: dict[str, list[list[int]]]) -> dict[str, float]:
    out = {name: 100 * statistics.fmean(score(q, llm.tokenizer.decode(r, skip_special_tokens=True))
                                        for q, r in zip(questions, replies[name], strict=True))
           for name, questions in sets.items()}
    out["mean"] = statistics.fmean(out.values())
    return out


def agreement(reference: list[list[int]], answers: list[list[int]]) -> float:
    """Percent of answers token-identical to the reference's (bench student's count)."""
    return 100 * student_agreement(reference, answers)["identical_answers"]


def diversity(llm: LLM, prompts: list[str], samples: int = 4, tokens: int = 48) -> dict:
    """Sampled answers (temperature 0.8, seeded per sample) asked one at a time and all at once beside 32
    other requests: distinct-2 and self-BLEU per prompt, and how many samples came out identical."""
    requests = [(p, seed) for p in prompts for seed in range(samples)]
    params = [SamplingParams(temperature=0.8, top_p=0.95, max_tokens=tokens, seed=seed) for _, seed in requests]
    alone = [list(_chat(llm, [p], q)[0].outputs[0].token_ids) for (p, _), q in zip(requests, params, strict=True)]
    filler = [p.prompt for p in builtin_prompts()[100:132]]
    batched = llm.chat([[{"role": "user", "content": p}] for p, _ in requests] +
                       [[{"role": "user", "content": p}] for p in filler],
                       params + [SamplingParams(temperature=0.8, max_tokens=tokens)] * len(filler), use_tqdm=False)
    together = [list(o.outputs[0].token_ids) for o in batched[:len(requests)]]

    def summary(texts: list[list[int]]) -> dict:
        groups = [texts[i:i + samples] for i in range(0, len(texts), samples)]
        return {"distinct_2": statistics.fmean(distinct_n(g, 2) for g in groups),
                "self_bleu": statistics.fmean(self_bleu(g) for g in groups)}

    return {"batch_1": summary(alone), "batch_64": summary(together),
            "identical_samples_pct": agreement(alone, together)}


def measure_arm(arm: Arm, args: argparse.Namespace, sets: dict[str, list[Question]], long_prompts: list[str],
                reference: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
    model = args.student if arm.student or arm.cascade else args.model
    llm = LLM(model, **arm.options)
    chat = [p.prompt for p in builtin_prompts()[:args.agreement_prompts]]
    try:
        if arm.cascade:
            return _cascade(llm, arm, args, sets, chat, reference)
        figures = {"arm": arm.name, **speed(llm, long_prompts)}
        if arm.batch is not None:  # the batching arms: W2 at this many requests in flight
            figures["w2_tok_s"] = _throughput_at(llm, arm.batch)
        replies = {name: ask(llm, questions, arm.batch) for name, questions in sets.items()}
        figures["accuracy"] = accuracy(llm, sets, replies)
        figures["perplexity"] = {name: perplexity(llm.engine, load_corpus(name), args.ppl_tokens, 512, 256,
                                                  progress=False).perplexity for name in ("enwiki", "sanguo")}
        answers = ask(llm, [Question(p, (), "trivia") for p in chat], arm.batch, max_tokens=64)
        figures["identical_to_float32_pct"] = agreement(reference, answers) if reference is not None else 100.0
        if arm.batch == 64:
            figures["diversity"] = diversity(llm, [p.prompt for p in builtin_prompts()[40:48]])
        return figures, answers
    finally:
        del llm
        gc.collect()


def _throughput_at(llm: LLM, batch: int) -> float:
    prompts = [p.prompt for p in builtin_prompts()[:64]]
    began = time.perf_counter()
    for start in range(0, 64, batch):
        _chat(llm, prompts[start:start + batch], SamplingParams(temperature=0, max_tokens=64, ignore_eos=True))
    return 64 * 64 / (time.perf_counter() - began)


def _cascade(small: LLM, arm: Arm, args: argparse.Namespace, sets: dict[str, list[Question]], chat: list[str],
             reference: list[list[int]] | None) -> tuple[dict, list[list[int]]]:
    """The student answers; where its mean logprob over its first 32 tokens is below the threshold, the model
    answers instead. Speed: the 32 built-in prompts answered one at a time through the cascade."""
    large = LLM(args.model)

    def answer(questions: list[Question], max_tokens: int = 24) -> tuple[list[list[int]], float]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0)
        out, routed = [], 0
        for q in questions:
            reply = _one(small, q, params)
            logprobs = [lp.logprob for lp in reply.logprobs or []][:32]
            if logprobs and statistics.fmean(logprobs) < args.cascade_threshold:
                routed += 1
                reply = _one(large, q, params)
            out.append(list(reply.token_ids))
        return out, routed / len(questions)

    prompts = [Question(p, (), "trivia") for p in chat]
    began = time.perf_counter()
    answers, routed = answer(prompts, 64)
    cascade_s = time.perf_counter() - began
    began = time.perf_counter()
    for q in prompts:
        _chat(large, [q.prompt], SamplingParams(temperature=0, max_tokens=64))
    alone_s = time.perf_counter() - began
    figures = {"arm": arm.name, "routed_pct": 100 * routed, "lone_requests_speedup": alone_s / cascade_s}
    replies = {name: answer(questions)[0] for name, questions in sets.items()}
    figures["accuracy"] = accuracy(large, sets, replies)
    figures["identical_to_float32_pct"] = agreement(reference, answers) if reference is not None else 100.0
    return figures, answers


def _one(llm: LLM, question: Question, params: SamplingParams):
    """One question asked alone: its completion."""
    if question.chat:
        return _chat(llm, [question.prompt], params)[0].outputs[0]
    return llm.generate(question.prompt, params, use_tqdm=False)[0].outputs[0]


def recommend(results: list[dict], max_drop: float, max_ppl_increase: float) -> str | None:
    """The fastest configuration (W2) within the accuracy and perplexity bounds of float32's. The batching arms
    are loads, not configurations, and the cascade has no W2: neither is recommended."""
    base = results[0]
    fit = [r for r in results if "w2_tok_s" in r and not r["arm"].startswith("batch-")
           and r["accuracy"]["mean"] >= base["accuracy"]["mean"] - max_drop
           and all(r["perplexity"][c] <= base["perplexity"][c] * (1 + max_ppl_increase) for c in base["perplexity"])]
    return max(fit, key=lambda r: r["w2_tok_s"])["arm"] if fit else None


def table(results: list[dict], chosen: str | None) -> str:
    base = results[0]
    head = ("| arm | W1 tok/s | W2 tok/s | TTFT ms (new / repeated) | accuracy % (trivia / cloze-en / cloze-zh / "
            "mean) | perplexity enwiki / sanguo (vs float32) | identical to float32 |")
    lines = [head, "|---" * 7 + "|"]
    for r in results:
        acc = r["accuracy"]
        name = f"**{r['arm']}** (recommended)" if r["arm"] == chosen else r["arm"]
        if "w2_tok_s" in r:
            speed = (f"{r['w1_tok_s']:.1f} | {r['w2_tok_s']:.0f} | {r['ttft_ms']:.0f} / {r['ttft_repeat_ms']:.0f}")
            ppl = " / ".join(f"{r['perplexity'][c]:.2f} ({_change(r['perplexity'][c], base['perplexity'][c])})"
                             for c in ("enwiki", "sanguo"))
        else:  # the cascade: lone requests against the model alone
            speed = f"{r['lone_requests_speedup']:.2f}x the model alone, {r['routed_pct']:.0f}% routed | - | -"
            ppl = "-"
        lines.append(f"| {name} | {speed} | {acc['trivia']:.0f} / {acc['cloze-en']:.0f} / {acc['cloze-zh']:.0f} / "
                     f"{acc['mean']:.1f} | {ppl} | {r['identical_to_float32_pct']:.0f}% |")
    return "\n".join(lines)


def _change(value: float, base: float) -> str:
    return f"{100 * (value / base - 1):+.1f}%"


def plot(results: list[dict], chosen: str | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.2), dpi=120)
    points = sorted((r for r in results if "w2_tok_s" in r), key=lambda r: r["w2_tok_s"])
    for index, r in enumerate(points):
        best = r["arm"] == chosen
        ax.scatter(r["w2_tok_s"], r["accuracy"]["mean"], s=120 if best else 40,
                   color="tab:green" if best else "tab:blue", zorder=3, marker="*" if best else "o")
        lift = 6 + 10 * (index % 3) if index % 2 else -12 - 10 * (index % 3)  # alternate labels up and down
        ax.annotate(r["arm"] + (" (recommended)" if best else ""), (r["w2_tok_s"], r["accuracy"]["mean"]),
                    textcoords="offset points", xytext=(4, lift),
                    fontsize=7, arrowprops={"arrowstyle": "-", "color": "0.6", "linewidth": 0.5})
    ax.set_xscale("log")
    ax.set_xlabel("W2 output tok/s (64 requests x 64 tokens)")
    ax.set_ylabel("accuracy on known answers, mean of 3 sets (%)")
    ax.set_title("Speed against answers, per acceleration")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    chosen_arms = arms(args)
    sets = question_sets(args.questions)
    text = load_corpus("enwiki")
    long_prompts = [text[offset:offset + 1600] for offset in (20_000, 60_000, 100_000)]
    results: list[dict] = []
    reference = None
    for arm in tqdm(chosen_arms, desc="seesaw", unit="arm"):
        figures, answers = measure_arm(arm, args, sets, long_prompts, reference)
        reference = answers if reference is None else reference
        results.append(figures)
        tqdm.write(json.dumps(figures))
    chosen = recommend(results, args.max_accuracy_drop, args.max_ppl_increase)
    record = {"model": args.model, "student": args.student, "questions_per_set": args.questions,
              "results": results, "recommended": chosen, "machine": machine_record(), **provenance()}
    args.result_json.parent.mkdir(parents=True, exist_ok=True)
    args.result_json.write_text(json.dumps(record, indent=1))
    plot(results, chosen, args.plot)
    print(table(results, chosen))
    print(f"wrote {args.result_json} and {args.plot}")
    return 0
