"""`llmaccel bench multiturn`: multi-turn chats with prefix caching on and off, in one run.

Every conversation starts with the same system prompt; each turn adds a user message (the built-in
chat prompts, in order) and the assistant's reply, and the next turn resends the whole history, as
chat clients do. All conversations advance one turn at a time, the turn's requests batched. Each
mode runs in the same process on the same prompts (greedy, so both produce the same replies) and
reports the prompt tokens the engine really computed, the prefix-cache hits and the throughput.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from llmaccel.data.prompts import SYSTEM_PROMPT


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="model alias, GGUF file or HF directory")
    parser.add_argument("--conversations", type=int, default=100, help="how many conversations run side by side")
    parser.add_argument("--turns", type=int, default=4, help="user turns per conversation")
    parser.add_argument("--reply-tokens", type=int, default=48, help="tokens of every assistant reply (EOS ignored)")
    parser.add_argument("--kv-cache-memory", default="2GiB", help="KV cache budget of each engine")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    parser.add_argument("--result-json", type=Path, help="write the figures to this JSON file")
    parser.add_argument("--replicas", type=int, metavar="N",
                        help="instead: the same chats over HTTP against `llmaccel serve --replicas N` with each of "
                             "--routers (and one process for reference); prefix-cache hit rate per router "
                             "(llmaccel bench replicas --skip-throughput)")
    parser.add_argument("--routers", default="cache-aware,round-robin,ray-prefix",
                        help="with --replicas: the routers to compare, comma-separated")
    parser.add_argument("--seed", type=int, default=0, help="with --replicas: the order conversations arrive in")


def run_mode(args: argparse.Namespace, prefix_caching: bool) -> dict:
    from llmaccel.data.prompts import builtin_prompts
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    llm = LLM(args.model, kv_cache_memory=args.kv_cache_memory, max_num_seqs=args.max_num_seqs,
              enable_prefix_caching=prefix_caching)
    engine, tokenizer = llm.engine, llm.tokenizer
    questions = [p.prompt for p in builtin_prompts()]
    histories = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(args.conversations)]
    params = SamplingParams(temperature=0, max_tokens=args.reply_tokens, ignore_eos=True)
    computed = generated = requests = prompt_tokens = 0
    replies: list[str] = []
    start = time.perf_counter()
    for turn in range(args.turns):
        for c, history in enumerate(histories):
            history.append({"role": "user", "content": questions[(c * args.turns + turn) % len(questions)]})
            text = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            engine.add_request(f"c{c}-t{turn}", ids, params)
            prompt_tokens += len(ids)
            requests += 1
        finished = {}
        while engine.has_unfinished_requests():
            for output in engine.step(emit_unfinished=False):
                finished[output.request_id] = output
            computed += engine.last_step.num_tokens
        for c, history in enumerate(histories):
            reply = finished[f"c{c}-t{turn}"].outputs[0]
            generated += len(reply.token_ids)
            history.append({"role": "assistant", "content": reply.text})
            replies.append(reply.text)
    seconds = time.perf_counter() - start
    stats = engine.prefix_cache_stats
    # each request's first token comes from its prefill; the other n - 1 were fed back one step each
    prefill_computed = computed - (generated - requests)
    return {"prefix_caching": prefix_caching, "requests": requests, "prompt_tokens": prompt_tokens,
            "prefill_tokens_computed": prefill_computed, "prefix_cache_hit_tokens": stats.hits,
            "output_tokens": generated, "seconds": seconds, "output_tok_per_s": generated / seconds,
            "replies": replies}


def run(args: argparse.Namespace) -> int:
    if args.replicas is not None:
        from llmaccel.bench import replicas

        args.skip_throughput, args.skip_multiturn = True, False
        return replicas.run(args)
    results = [run_mode(args, prefix_caching) for prefix_caching in (False, True)]
    off, on = results
    same = off.pop("replies") == on.pop("replies")
    print(f"{args.conversations} conversations x {args.turns} turns, {args.reply_tokens}-token replies; "
          f"replies identical with and without prefix caching: {same}", file=sys.stderr)
    print("| prefix caching | prompt tokens | prefill tokens computed | cache hits | output tok/s | seconds |")
    print("|---|---|---|---|---|---|")
    for r in results:
        print(f"| {'on' if r['prefix_caching'] else 'off'} | {r['prompt_tokens']} | {r['prefill_tokens_computed']} "
              f"| {r['prefix_cache_hit_tokens']} | {r['output_tok_per_s']:.1f} | {r['seconds']:.1f} |")
    saved = 1 - on["prefill_tokens_computed"] / off["prefill_tokens_computed"]
    print(f"prefill computed: -{saved:.0%}; output throughput: {on['output_tok_per_s'] / off['output_tok_per_s']:.2f}x")
    if args.result_json:
        args.result_json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()},
                                                "results": results, "replies_identical": same}, indent=1))
    return 0
