"""The engine's command-line flags (`llmaccel serve`, `chat`, `generate`, and a Serve config's `args`)
and the LLMEngine options they give: below the CLI and the cluster, which both read them."""

from __future__ import annotations

import argparse
import json


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="model alias (smollm2-135m), a .gguf file, or an HF directory with safetensors")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default="auto",
                        help="auto: bfloat16 where the hardware computes it natively (CUDA, or a CPU with "
                        "AMX or AVX512-BF16), float32 elsewhere (the choice is logged at start); or float32, bfloat16")
    parser.add_argument("--quantization", choices=("int8", "int4", "gguf"),
                        help="weight-only quantization of the decoder's linear layers (embedding and LM head stay "
                             "in --dtype); gguf: a GGUF model's own tensors (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K: "
                             "llama.cpp's presets such as Q4_K_M) as they are, embedding and LM head included, in "
                             "the file's memory and no more; without it a GGUF file's quantized tensors are "
                             "dequantized to --dtype at load (the copy's size is logged, and it is refused where "
                             "it cannot fit in the memory available)")
    parser.add_argument("--quant-group-size", type=int,
                        help="INT4 group size: 32 (default, as GGUF's Q4_0/Q4_1), 64 or 128")
    parser.add_argument("--quantize-embedding", action="store_true",
                        help="hold the embedding and LM head in INT8 too, one copy when tied (with --quantization "
                             "gguf a file's quantized tables are used as they are); saves most of a small model's "
                             "remaining float weights")
    parser.add_argument("--batch-invariant", action="store_true",
                        help="the same greedy answer at any load: every bf16 projection (and the LM head) runs a "
                             "kernel that sums each row in one fixed order whatever rows share the step (the vnni "
                             "layout's ordered kernels; needs AVX512-BF16 for bfloat16); see docs/benchmarks.md")
    parser.add_argument("--bf16-layout", default="auto", choices=("auto", "plain", "vnni", "compact"),
                        help="how bfloat16 weights are held on the CPU: auto takes the layout whose kernels are "
                             "fastest over the row counts timed at load (cached per machine and shape), or compact "
                             "where it is within 10%% of that; compact "
                             "holds each weight in 12 bits, losslessly (0.75 of the memory: a lone request reads "
                             "fewer bytes a token, batches pay for the decoding; needs AVX512-BF16); vnni packs "
                             "them for AMX; plain as the checkpoint has them")
    parser.add_argument("--kv-cache-memory", default="1GiB", help="KV cache budget, e.g. 512MiB or 2GiB")
    parser.add_argument("--num-kv-blocks", type=int, help="number of KV blocks (overrides --kv-cache-memory)")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument("--no-prefix-caching", action="store_true",
                        help="do not reuse the KV of prompt prefixes seen before (on by default: full blocks are "
                             "hashed with their whole prefix, kept after use and evicted least recently used first)")
    parser.add_argument("--kv-offload-dir", metavar="DIR",
                        help="a disk tier below the KV cache: prefix blocks evicted from RAM are written here (off the "
                             "step, checksummed) and read back for a prompt that continues them instead of being "
                             "recomputed, also after a restart on the same directory; each model and KV format keeps "
                             "its own folder in it")
    parser.add_argument("--kv-offload-size", default="16GiB", metavar="SIZE",
                        help="with --kv-offload-dir: the most it holds, e.g. 64GiB (least recently used blocks out "
                             "first)")
    parser.add_argument("--kv-offload-policy", choices=("evict", "write-through"), default="evict",
                        help="with --kv-offload-dir: when a block is written. evict: when RAM evicts it (and at "
                             "shutdown); write-through: as soon as it is computed, so replicas (--replicas) sharing "
                             "the directory find each other's blocks")
    parser.add_argument("--kv-window", type=int, metavar="W",
                        help="StreamingLLM: each sequence keeps the KV of its last W tokens (and its --kv-sinks "
                             "first ones); blocks the window has passed are freed, so KV memory per sequence stays "
                             "flat however long the conversation (see --kv-positions)")
    parser.add_argument("--kv-sinks", type=int, default=4, metavar="S",
                        help="with --kv-window: the first S tokens (attention sinks) always stay")
    parser.add_argument("--kv-positions", choices=("cache", "absolute"), default="cache",
                        help="with --kv-window: where the kept keys sit. cache (StreamingLLM): at their places in the "
                             "cache, so no query sees a sink farther away than the sinks and the window, and a "
                             "conversation may run past the model's trained length (--max-model-len); absolute: at "
                             "their places in the text, so past the trained length the sinks drift farther away "
                             "than the model has seen (bench kv-positions measures both)")
    parser.add_argument("--kv-cache-dtype", default="auto", metavar="{auto,bf16,float32,int8,fp8}",
                        help="the KV cache's element type: auto (the model's --dtype); int8: each token's key and "
                             "value rows quantized per head with a float16 scale as they are written, so the same "
                             "--kv-cache-memory holds ~1.9x the tokens (read by the attention kernels as they are); "
                             "fp8 (e4m3): CUDA GPUs with fp8 only; bf16/float32 must be the model's dtype")
    parser.add_argument("--max-num-seqs", type=int, default=128, help="most sequences in one step")
    parser.add_argument("--scheduling-policy", choices=("fcfs", "priority"), default="fcfs",
                        help="fcfs: requests in arrival order; priority: a request's `priority` (lower first, as "
                             "vLLM), a running request preempted for a waiting one of higher priority, and each "
                             "step's token budget shared fairly between clients (API keys, else addresses)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=2048, help="most tokens in one step")
    parser.add_argument("--max-model-len", type=int,
                        help="context window (default: the model's, capped by the KV budget); past the positions the "
                             "model was trained for only with a RoPE scaling that stretches them (--rope-scaling)")
    parser.add_argument("--rope-scaling", type=json.loads, metavar="JSON",
                        help="replace the model's RoPE scaling, as HF configs write it: e.g. "
                             "'{\"rope_type\": \"yarn\", \"factor\": 4}' serves 4x the trained positions (linear, "
                             "dynamic, yarn, llama3, longrope; original_max_position_embeddings defaults to the "
                             "model's max_position_embeddings)")
    spec = parser.add_argument_group("speculative decoding (the output stays the model's own: greedy is "
                                     "token-identical in float32 and for a lone request in bf16, sampling follows "
                                     "its distribution)")
    spec.add_argument("--speculative-model", metavar="DIR",
                      help="a smaller draft model with the same tokenizer (e.g. a student from `llmaccel distill`), "
                           "or a draft head trained for this model by `llmaccel distill-head` (one layer reading the "
                           "model's own hidden states, EAGLE-style); it proposes tokens the model verifies in one pass")
    spec.add_argument("--speculative-method", choices=("draft", "ngram"),
                      help="draft: the --speculative-model (implied by it); ngram: prompt lookup, drafts copied from "
                           "earlier in the context, no second model (strong for edits, summaries, code)")
    spec.add_argument("--num-speculative-tokens", type=int, default=2, metavar="K",
                      help="drafts verified per request and step (1-16)")
    spec.add_argument("--prompt-lookup-max", type=int, default=4, metavar="N",
                      help="ngram: the longest context suffix searched for earlier in the context")
    spec.add_argument("--prompt-lookup-min", type=int, default=2, metavar="N", help="ngram: the shortest")
    spec.add_argument("--speculative-max-batch", type=int, metavar="B",
                      help="speculate only while at most B requests run (default: decided per batch size by the "
                           "tokens/s measured with and without drafts while serving)")
    spec.add_argument("--speculative-lookup", action="store_true",
                      help="with --speculative-model: draft by prompt lookup where the context's suffix occurred "
                           "before (the answer repeats the prompt or itself), by the draft model elsewhere")
    spec.add_argument("--speculative-draft-vocab", type=int, metavar="N",
                      help="cut the draft model's LM head to its N most frequent tokens (counted in the draft's "
                           "token_counts.json, which `llmaccel distill` writes, else in the built-in corpora): a "
                           "draft pass then reads N rows of the head instead of the whole vocabulary's (a draft head: "
                           "default the size it was trained for)")
    lora = parser.add_argument_group("LoRA adapters (PEFT directories; requests name one as `model`, and requests for "
                                     "different adapters and the base model share each batch)")
    lora.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=DIR", type=_lora_module,
                      help="adapters loaded at start: each is served as model NAME and listed in /v1/models with the "
                           "base model as its parent")
    lora.add_argument("--enable-lora", action="store_true",
                      help="hold room for adapters (implied by --lora-modules) and allow loading and unloading them at "
                           "run time: POST /v1/load_lora_adapter {lora_name, lora_path}, /v1/unload_lora_adapter "
                           "{lora_name} (behind the API key when one is set)")
    lora.add_argument("--max-loras", type=int, default=4, metavar="N",
                      help="adapters loaded at once (each holds a share of every projection's stacked LoRA matrices)")
    lora.add_argument("--max-lora-rank", type=int, default=16, metavar="R",
                      help="the largest adapter rank accepted; a larger one is refused at load, naming its rank")


def _lora_module(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (a PEFT adapter directory), got {text!r}")
    return name, path


def engine_options(args: argparse.Namespace) -> dict:
    options = dict(device=args.device, dtype=args.dtype, quantization=args.quantization,
                   quant_group_size=args.quant_group_size,
                   quantize_embedding=args.quantize_embedding, kv_cache_memory=args.kv_cache_memory,
                   batch_invariant=args.batch_invariant, bf16_layout=args.bf16_layout,
                   block_size=args.block_size, enable_prefix_caching=not args.no_prefix_caching,
                   kv_window=args.kv_window, kv_sinks=args.kv_sinks, kv_positions=args.kv_positions,
                   kv_cache_dtype=args.kv_cache_dtype, kv_offload_dir=args.kv_offload_dir,
                   kv_offload_size=args.kv_offload_size, kv_offload_policy=args.kv_offload_policy,
                   max_num_seqs=args.max_num_seqs, policy=args.scheduling_policy,
                   max_num_batched_tokens=args.max_num_batched_tokens)
    if args.num_kv_blocks:
        options["num_kv_blocks"] = args.num_kv_blocks
    if args.max_model_len:
        options["max_model_len"] = args.max_model_len
    if args.rope_scaling is not None:
        options["rope_scaling"] = args.rope_scaling
    options.update(speculative_model=args.speculative_model, speculative_method=args.speculative_method,
                   num_speculative_tokens=args.num_speculative_tokens, prompt_lookup_max=args.prompt_lookup_max,
                   prompt_lookup_min=args.prompt_lookup_min, speculative_max_batch=args.speculative_max_batch,
                   speculative_draft_vocab=args.speculative_draft_vocab, speculative_lookup=args.speculative_lookup)
    if args.lora_modules or args.enable_lora:
        options.update(lora_modules=tuple(args.lora_modules), enable_lora=args.enable_lora, max_loras=args.max_loras,
                       max_lora_rank=args.max_lora_rank)
    return options
