"""Command line: `llmaccel serve | chat | generate | quantize | distill | tune | eval | bench`."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from llmaccel.config_file import expand_config
from llmaccel.engine_args import add_engine_arguments, engine_options
from llmaccel.platform import keep_freed_memory


def _add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=256, help="most tokens to generate")
    parser.add_argument("--min-tokens", type=int, default=0, help="generate at least this many before EOS may stop")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    parser.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: all)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    parser.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI presence penalty, [-2, 2]")
    parser.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI frequency penalty, [-2, 2]")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="HF-style repetition penalty (> 0)")
    parser.add_argument("--seed", type=int, help="per-request seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating past EOS")
    parser.add_argument("--n", type=int, default=1, help="number of samples")


def _generate(args: argparse.Namespace) -> int:
    from llmaccel.llm import LLM
    from llmaccel.sampling_params import SamplingParams

    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            min_p=args.min_p, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty, repetition_penalty=args.repetition_penalty,
                            seed=args.seed, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                            stop=tuple(args.stop), ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **engine_options(args))
    if args.chat:
        outputs = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        outputs = llm.generate(args.prompt, params)
    out = outputs[0]
    for completion in out.outputs:
        print(completion.text)
    if args.verbose:
        m = out.metrics
        tokens = sum(len(c.token_ids) for c in out.outputs)
        took = (m.finished_time or 0) - m.arrival_time
        print(f"[{len(out.prompt_token_ids)} prompt tokens, {tokens} generated, {took:.2f} s, "
              f"{tokens / max(took, 1e-9):.1f} tok/s, finish: {out.outputs[0].finish_reason}]", file=sys.stderr)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from llmaccel.cluster import launch as cluster_launch
    from llmaccel.cluster import options as cluster_options
    from llmaccel.server import launch

    options = {**engine_options(args), **launch.guard_options(args)}
    if cluster_options.wants_replicas(args):
        if args.lora_modules or args.enable_lora:
            raise SystemExit("llmaccel serve: LoRA adapters are served by one process; --replicas does not carry "
                             "them yet (drop --replicas, or the LoRA flags)")
        return cluster_launch.serve(args.model, options, launch.server_config(args),
                                    cluster_options.cluster_config(args), args.log_level, access_log=args.access_log)
    return launch.serve(args.model, options, launch.server_config(args), args.log_level, access_log=args.access_log)


def _chat(args: argparse.Namespace) -> int:
    from llmaccel import chat

    return chat.run(args, engine_options(args))


_BENCH_COMMANDS = [  # name, module in llmaccel.bench, help, its add-arguments function, its run function
    ("serve", "serve", "load-test any OpenAI-compatible server: TTFT, TPOT, ITL, E2EL, throughput, goodput",
     "add_arguments", "run"),
    ("sweep", "sweep", "bench serve at several concurrencies or request rates, then plot",
     "add_sweep_arguments", "run_sweep"),
    ("plot", "sweep", "markdown table and PNG plots from bench serve/sweep result files", "add_plot_arguments",
     "run_plot"),
    ("compare", "compare", "the headline table: HF baseline server vs llmaccel (and peers)", "add_arguments", "run"),
    ("hf-server", "hf_server", "the HF transformers baseline server (one request at a time)", "add_arguments", "run"),
    ("offline", "offline", "llmaccel vs HF transformers on the same prompts, in one run", "add_arguments", "run"),
    ("families", "families", "every model family (Llama, Qwen3, Phi-3, Gemma 1/2/3, GPT-2) at the default model's "
     "shape with random weights: HF transformers against llmaccel, one request and a batch", "add_arguments", "run"),
    ("cascade", "cascade", "a small/large cascade at every confidence threshold: compute per request against "
     "agreement with the large model's answers and its judgement of them; a plot and a recommended point",
     "add_arguments", "run"),
    ("cascade-served", "cascade_served", "a cascade as served (`serve --cascade-small`) against the large model "
     "served alone, prompts alternating between them: share routed, latency by route, identical answers",
     "add_arguments", "run"),
    ("student", "student", "a distilled student against its teacher in one process: tokens/s at batch 1 and a "
     "batch in alternating rounds, weight memory, and how often their greedy answers agree", "add_arguments", "run"),
    ("spec", "speculative", "speculative decoding (draft models, ngram) against plain decoding in one process: "
     "tokens/s on a lone request, a copy-heavy one and a batch, and whether the outputs stayed identical",
     "add_arguments", "run"),
    ("structured", "structured", "what grammar-constrained requests (structured outputs) cost a batch of 64: "
     "tokens/s with half of them constrained against none, and the mask time per step", "add_arguments", "run"),
    ("multiturn", "multiturn", "multi-turn chats with prefix caching off and on: prefill computed, throughput",
     "add_arguments", "run"),
    ("replicas", "replicas", "llmaccel serve --replicas N against one process (throughput, same burst) and its "
     "routers against each other on multi-turn chats (prefix-cache hit rate), in one run", "add_arguments", "run"),
    ("safety", "safety", "input-filter latency by prompt length, and detection / false-positive rates on labelled "
     "jailbreak and ordinary prompt sets", "add_arguments", "run"),
    ("guard-cost", "guard_cost", "what the in-engine semantic guard costs a server under load: output tok/s with "
     "the rules alone against rules + semantic guard, in rotated rounds with a null arm", "add_arguments", "run"),
    ("soak", "soak", "identical passes of streamed traffic with disconnects, client timeouts and identical "
     "requests: lost requests, gauges after each pass, RSS per pass (does it level off?)", "add_arguments", "run"),
    ("guard", "guard", "the output guard per served variant on the built-in prompts: abnormal-output ratio, "
     "resample success rate, KL percentiles", "add_arguments", "run"),
    ("kv", "kv_cache", "the KV cache's element types (--kv-cache-dtype) side by side in one process: tokens per "
     "budget, perplexity, identical greedy continuations, decode tok/s in a batch and at a long context",
     "add_arguments", "run"),
    ("long-context", "long_context", "a 32k-token document and a chat past it with full attention, an INT8 KV cache, "
     "a KV window with sinks and both: KV written, peak RSS, prefill seconds, decode tok/s", "add_arguments", "run"),
    ("kv-positions", "kv_positions", "perplexity far past a KV window (2x, 4x, 8x W) with the sinks at their "
     "places in the cache (StreamingLLM) against in the text, beside the window read afresh", "add_arguments", "run"),
    ("kv-offload", "kv_offload", "returning chat turns whose history left the RAM pool, with the disk tier "
     "(--kv-offload-dir) and without: TTFT p50/p99, identical replies, prefix-cache hits after a restart",
     "add_arguments", "run"),
    ("kv-restore", "kv_restore", "one conversation's KV saved to disk and restored: llmaccel's disk tier across a "
     "restart against llama.cpp's slot save/restore on the same GGUF file, per prompt length", "add_arguments", "run"),
    ("priority", "priority", "a high-priority request's TTFT behind a queue of low-priority ones, and a light API "
     "key's beside a heavy key's 10x flood: --scheduling-policy priority against fcfs", "add_arguments", "run"),
    ("invariance", "invariance", "whether a greedy answer changes with the load (alone, batches of 2/16/64, chunked "
     "prefill, a warm prefix cache) in the default mode and with --batch-invariant, and what the mode costs",
     "add_arguments", "run"),
    ("lora", "lora", "many LoRA adapters in one batch: output tok/s of 64 requests spread over 8 adapters (and on "
     "one) against the base model alone, alternating rounds in one engine", "add_arguments", "run"),
    ("bf16-layouts", "bf16_layouts", "the plain and the compact (12 bits a weight, lossless) bf16 layouts' kernels "
     "on a published shape's projections, from memory, in alternating rounds: ms, GB/s, speedup",
     "add_arguments", "run"),
    ("load-memory", "load_memory", "what `llmaccel serve` holds at start, per model: peak and resident memory when "
     "/health answers, weight and KV pool bytes, against weights + KV pool + 15%%, and seconds to serve",
     "add_arguments", "run"),
    ("make-model", "make_model", "a checkpoint of random weights at a published shape (llama-1b/3b/8b, "
     "qwen-0.5b/7b) as an HF directory or a GGUF file of llama.cpp's types, for speed and memory benchmarks only",
     "add_arguments", "run"),
    ("seesaw", "seesaw", "every acceleration (float32, bf16, int8, int4, GGUF, INT8 KV, speculation, prefix caching, "
     "a student and a cascade, batch sizes) side by side: speed against accuracy on known answers, perplexity, "
     "agreement with float32 and diversity under sampling; a table, a plot and a recommended point",
     "add_arguments", "run"),
    ("report", "headline", "the headline tables of docs/benchmarks.md from `bench compare` result files: one "
     "section per machine kind, W1 (side by side), W2, memory, start, date and commit", "add_arguments", "run"),
    ("report-offline", "report", "markdown table and a PNG bar chart from offline result files", "add_arguments",
     "run"),
]


def _add_module_command(subparsers, name: str, module_path: str, help_text: str, add_args: str = "add_arguments",
                        run: str = "run") -> None:
    """A subcommand whose flags and behaviour live in a module's add-arguments and run functions."""
    module = importlib.import_module(module_path)
    sub = subparsers.add_parser(name, help=help_text, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    getattr(module, add_args)(sub)
    sub.set_defaults(func=getattr(module, run))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llmaccel", description="LLM inference accelerator")
    parser.add_argument("--log-level", default="INFO", help="llmaccel's log level: DEBUG, INFO, WARNING or ERROR")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="serve a model over the OpenAI API (chat and text completions)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    from llmaccel.cluster import options as cluster_options

    cluster_options.add_serve_arguments(serve)
    serve.add_argument("--config", metavar="FILE.yaml",
                       help="read flags from a YAML file ({flag-name: value}, as `llmaccel tune` writes them); "
                            "flags given on the command line win over the file's")
    serve.set_defaults(func=_serve)

    chat = commands.add_parser("chat", help="interactive terminal chat, streamed (a local model or a server's)",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add_engine_arguments(chat)
    from llmaccel import chat as chat_module

    chat_module.add_arguments(chat)
    chat.set_defaults(func=_chat, model=None)

    gen = commands.add_parser("generate", help="generate text for one prompt (offline, no server)",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    gen.add_argument("--prompt", required=True, help="the prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    gen.add_argument("-v", "--verbose", action="store_true", help="print token counts and speed to stderr")
    add_engine_arguments(gen)
    _add_sampling_arguments(gen)
    gen.set_defaults(func=_generate)

    _add_module_command(commands, "quantize", "llmaccel.quantization.checkpoint",
                        "write a weight-only INT8/INT4 checkpoint that --model loads")
    _add_module_command(commands, "distill", "llmaccel.distill.train",
                        "train a smaller student of a model on its own next-token distributions (resumable)")
    _add_module_command(commands, "distill-head", "llmaccel.distill.draft_head",
                        "train an EAGLE-style draft head on a model's own features, for --speculative-model")
    _add_module_command(commands, "tune", "llmaccel.tune.command",
                        "search --max-num-seqs / --max-num-batched-tokens (and weight formats) for the highest "
                        "goodput at a latency SLO; writes a config file for `serve --config`")
    safety = commands.add_parser("safety", help="the safety stages' tools")
    safety_commands = safety.add_subparsers(dest="safety_command", required=True)
    _add_module_command(safety_commands, "train-guard", "llmaccel.safety.guard_train",
                        "train the semantic input guard's classifier for a model on its own hidden states, and "
                        "evaluate it with whole prompt sets held out")
    evaluate = commands.add_parser("eval", help="quality evaluations")
    eval_commands = evaluate.add_subparsers(dest="eval_command", required=True)
    _add_module_command(eval_commands, "ppl", "llmaccel.quantization.perplexity",
                        "sliding-window perplexity of a model or its quantized variants")
    bench = commands.add_parser("bench", help="benchmarks: serving load tests, comparisons, offline throughput")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    for name, module_name, help_text, add_args, run in _BENCH_COMMANDS:
        _add_module_command(bench_commands, name, f"llmaccel.bench.{module_name}", help_text, add_args, run)
    return parser


def _with_config_files(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """`serve --config FILE`: the file's flags spliced in before the command line's."""
    at = 0
    while at < len(argv) and argv[at].startswith("-"):
        at += 2 if argv[at] == "--log-level" else 1
    if at >= len(argv) or argv[at] != "serve":
        return argv
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return expand_config(argv, at + 1, commands.choices["serve"])


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        argv = _with_config_files(parser, list(sys.argv[1:] if argv is None else argv))
    except ValueError as exc:
        print(f"llmaccel: error: {exc}", file=sys.stderr)
        return 2
    args = parser.parse_args(argv)
    level = getattr(logging, str(args.log_level).upper(), None)
    if not isinstance(level, int):
        parser.error(f"--log-level {args.log_level!r}: choose DEBUG, INFO, WARNING or ERROR")
    logging.getLogger("llmaccel").setLevel(level)
    keep_freed_memory()  # before any thread starts: the server's threads then share the one kept heap
    try:
        return args.func(args)
    except ValueError as exc:  # every user mistake is a ValueError with a message that says what to change
        print(f"llmaccel: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
