"""`llmaccel bench kv-offload`: returning chat turns whose history left RAM, with the disk tier and without.

Many more conversations than the KV pool holds take turns in rotation, one request at a time: each starts with a
long document (`--doc-tokens` of enwiki or sanguo text, alternating) and a question, and every later turn resends
the whole history with the reply and a new question, as chat clients do. By the time a conversation returns, the
other conversations have pushed its blocks out of the RAM pool: without a tier its history is computed again;
with `--kv-offload-dir` its blocks are read back from disk. Both arms run in one process, one after the other, on
the same conversations (each arm follows its own replies), and report the time to first token of the returning
turns (p50 and p99), which replies were identical, and then, after a restart of each engine (the tier's on the
same directory), the prefix-cache hit rate of the next turn of every conversation.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from tqdm.auto import tqdm

from llmaccel.bench.provenance import provenance
from llmaccel.bench.serve_metrics import percentile
from llmaccel.data.prompts import SYSTEM_PROMPT

QUESTIONS = ["Summarize the text above in two sentences.", "Who or what is the text mainly about?",
             "Name three facts the text states.", "What happens next, in your own words?",
             "Which sentence of the text matters most, and why?"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--conversations", type=int, default=40, help="conversations taking turns")
    parser.add_argument("--pool-conversations", type=int, default=4,
                        help="the RAM pool holds this many conversations at their longest history (so "
                             "--conversations / this is how many times over the chats exceed it)")
    parser.add_argument("--turns", type=int, default=3, help="turns per conversation (all but the first return)")
    parser.add_argument("--doc-tokens", type=int, default=2000, help="tokens of the document each chat starts with")
    parser.add_argument("--reply-tokens", type=int, default=32, help="tokens of every reply (EOS ignored)")
    parser.add_argument("--dtype", default="auto", help="auto, float32 or bfloat16")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="both engines with --batch-invariant (a warm prefix then changes no logit, so the "
                             "replies must be identical)")
    parser.add_argument("--offload-dir", type=Path,
                        help="the disk tier's directory (default: a fresh temporary one, deleted after)")
    parser.add_argument("--result-json", type=Path, help="write the figures and the machine here")


def _documents(tokenizer, count: int, length: int) -> list[str]:
    from llmaccel.data.corpora import load_corpus

    texts = {name: tokenizer.encode(load_corpus(name), add_special_tokens=False) for name in ("enwiki", "sanguo")}
    documents = []
    for i in range(count):
        ids = texts["enwiki" if i % 2 == 0 else "sanguo"]
        start = (i // 2) * length % max(1, len(ids) - length)
        documents.append(tokenizer.decode(ids[start:start + length]))
    return documents


def _turn(llm, history: list[dict], params) -> tuple[dict, list[int]]:
    """Send one chat turn alone; its time to first token, prompt and cached tokens, and the reply's token ids."""
    engine = llm.engine
    ids = llm.apply_chat_template(history)
    request_id = engine.add_request(None, ids, params)
    output = None
    while engine.has_unfinished_requests():
        for finished in engine.step(emit_unfinished=False):
            if finished.request_id == request_id:
                output = finished
    metrics = output.metrics
    reply = output.outputs[0]
    return ({"ttft_s": metrics.first_token_time - metrics.arrival_time, "prompt_tokens": len(ids),
             "cached_tokens": output.num_cached_tokens, "text": reply.text}, list(reply.token_ids))


def run_arm(args: argparse.Namespace, documents: list[str], offload_dir: Path | None, num_blocks: int) -> dict:
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    options = dict(dtype=args.dtype, num_kv_blocks=num_blocks, batch_invariant=args.batch_invariant)
    if offload_dir is not None:
        options["kv_offload_dir"] = str(offload_dir)
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    histories = [[{"role": "system", "content": SYSTEM_PROMPT},
                  {"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"}] for doc in documents]
    turns: list[dict] = []
    replies: list[list[int]] = []
    label = "disk tier" if offload_dir is not None else "no tier"
    llm = LLM(args.model, **options)
    bar = tqdm(total=args.turns * len(histories), desc=label, unit="turn")
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            if turn:
                history.append({"role": "user", "content": QUESTIONS[turn % len(QUESTIONS)]})
            result, ids = _turn(llm, history, params)
            history.append({"role": "assistant", "content": result.pop("text")})
            turns.append({"conversation": c, "turn": turn, **result})
            replies.append(ids)
            bar.update(1)
    bar.close()
    tier = llm.engine.kv_tier_stats
    llm.close()
    del llm
    # a restart: a new engine (on the same directory for the tier), the next turn of every conversation
    restarted = LLM(args.model, **options)
    queries = hits = 0
    for history in tqdm(histories, desc=f"{label}, restarted", unit="turn"):
        history.append({"role": "user", "content": QUESTIONS[args.turns % len(QUESTIONS)]})
        result, _ = _turn(restarted, history, params)
        queries += result["prompt_tokens"]
        hits += result["cached_tokens"]
    restarted.close()
    returning = [t["ttft_s"] for t in turns if t["turn"] > 0]
    return {"arm": label, "turns": turns, "replies": replies, "tier": tier,
            "returning_ttft_p50_s": statistics.median(returning),
            "returning_ttft_p99_s": percentile(sorted(returning), 99),
            "returning_history_tokens_min": min(t["prompt_tokens"] for t in turns if t["turn"] > 0),
            "restart_hit_rate": hits / queries}


def run(args: argparse.Namespace) -> int:
    from llmaccel.model.loader import load_checkpoint
    from llmaccel.platform import describe

    tokenizer = load_checkpoint(args.model).tokenizer
    documents = _documents(tokenizer, args.conversations, args.doc_tokens)
    longest = args.doc_tokens + 200 + args.turns * (args.reply_tokens + 30)  # template, questions, replies
    num_blocks = max(16, args.pool_conversations * longest // 16)
    with tempfile.TemporaryDirectory(prefix="llmaccel-kv-offload-") as scratch:
        directory = args.offload_dir or Path(scratch)
        arms = [run_arm(args, documents, None, num_blocks), run_arm(args, documents, directory, num_blocks)]
    plain, tiered = arms
    same = sum(a == b for a, b in zip(plain.pop("replies"), tiered.pop("replies"), strict=True))
    count = len(plain["turns"])
    print(f"{args.conversations} conversations x {args.turns} turns through a pool of {num_blocks} blocks "
          f"(~{args.pool_conversations} conversations); returning turns' histories >= "
          f"{plain['returning_history_tokens_min']} tokens", file=sys.stderr)
    print("| arm | returning turns: TTFT p50 | TTFT p99 | hit rate after a restart |")
    print("|---|---|---|---|")
    for arm in arms:
        p50_ms, p99_ms = arm["returning_ttft_p50_s"] * 1000, arm["returning_ttft_p99_s"] * 1000
        print(f"| {arm['arm']} | {p50_ms:.0f} ms | {p99_ms:.0f} ms | {arm['restart_hit_rate']:.1%} |")
    p50 = plain["returning_ttft_p50_s"] / tiered["returning_ttft_p50_s"]
    p99 = plain["returning_ttft_p99_s"] / tiered["returning_ttft_p99_s"]
    print(f"disk tier: p50 {p50:.1f}x, p99 {p99:.1f}x faster; identical replies {same}/{count}")
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps({
            **provenance(), "machine": describe(), "model": args.model, "dtype": args.dtype,
            "batch_invariant": args.batch_invariant, "conversations": args.conversations, "turns": args.turns,
            "doc_tokens": args.doc_tokens, "reply_tokens": args.reply_tokens, "num_kv_blocks": num_blocks,
            "ttft_p50_ratio": p50, "ttft_p99_ratio": p99, "identical_replies": same, "replies": count,
            "arms": arms}, indent=1))
    return 0
