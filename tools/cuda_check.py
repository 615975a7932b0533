"""One prepared run on a lent GPU machine: llmaccel's CUDA path against HF transformers on the same GPU.

Correctness: tiny random checkpoints (as the tests build them) generate greedily on CUDA and are
compared token for token with HF's own generate on CUDA, in float32 and bfloat16, with a sliding
window, prefix caching and the INT8/INT4 kernels. Speed: a random-weight model of the default
model's architecture (its config and tokenizer, carried in `--arch-dir`), llmaccel's offline engine
against HF generate, both on the GPU in bfloat16, in one run. Writes `$OUT/cuda_check.json`.

    python3 tools/cuda_check.py --arch-dir .devcheck/smollm2 [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from llmaccel.llm import LLM  # noqa: E402
from llmaccel.sampling_params import SamplingParams  # noqa: E402

RESULTS: dict = {}


def section(name: str):
    def wrap(fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                RESULTS[name] = fn(*args, **kwargs)
            except Exception as exc:  # report and carry on: one broken part must not hide the others
                RESULTS[name] = {"error": repr(exc), "trace": traceback.format_exc()[-2000:]}
            RESULTS[name] = {**RESULTS[name], "seconds": round(time.perf_counter() - start, 1)} \
                if isinstance(RESULTS[name], dict) else RESULTS[name]
            print(name, json.dumps(RESULTS[name])[:1500], flush=True)
            if os.environ.get("OUT"):  # after every section: a run stopped at its time limit keeps what it had
                (Path(os.environ["OUT"]) / "cuda_check.json").write_text(json.dumps(RESULTS, indent=2))
        return run
    return wrap


def hf_greedy(model_dir, prompts, new_tokens, device, dtype):
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = json.loads((Path(model_dir) / "config.json").read_text())
    # HF's SDPA attention has no soft cap: Gemma 2's reference is its eager attention (HF says so itself)
    eager = {"attn_implementation": "eager"} if config.get("attn_logit_softcapping") else {}
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **eager).to(device).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, as ignore_eos does
    config = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    outs = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            out = model.generate(x, attention_mask=torch.ones_like(x), generation_config=config)
            outs.append(out[0, len(ids):].tolist())
    return outs


def first_difference(a, b):
    same_length = None if len(a) == len(b) else min(len(a), len(b))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), same_length)


def compare(llm, model_dir, prompts, new_tokens, device, dtype):
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    theirs = hf_greedy(model_dir, prompts, new_tokens, device, dtype)
    diffs = [first_difference(a, b) for a, b in zip(ours, theirs, strict=True)]
    return {"identical": sum(d is None for d in diffs), "prompts": len(prompts), "first_difference": diffs}


@section("environment")
def environment(device):
    info = {"torch": torch.__version__, "device": device}
    if device == "cuda":
        info |= {"gpu": torch.cuda.get_device_name(), "capability": list(torch.cuda.get_device_capability())}
    return info


@section("tiny_models_vs_hf")
def tiny_models(root, device):
    from tests.tiny_models import TINY_CONFIGS, build_tokenizer, make_tiny_model

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    tokenizer = build_tokenizer()
    prompts = [tokenizer.encode(t) for t in ("The quick brown fox", "你好，世界", "What is the capital of France?",
                                             "def hello():")]
    out = {}
    for name in TINY_CONFIGS:
        model_dir = make_tiny_model(name, root, tokenizer)
        for dtype_name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
            llm = LLM(str(model_dir), device=device, dtype=dtype_name)
            out[f"{name}/{dtype_name}"] = compare(llm, model_dir, prompts, 48, device, dtype)
            del llm
    return out


@section("sliding_window_vs_hf")
def sliding_window(root, device):
    from transformers import MistralConfig, MistralForCausalLM

    from tests.tiny_models import build_tokenizer

    tokenizer = build_tokenizer()
    config = MistralConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                           initializer_range=0.2, sliding_window=40, tie_word_embeddings=False)
    torch.manual_seed(7)
    model_dir = root / "mistral"
    MistralForCausalLM(config).eval().save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    prompts = [[(i * 37) % 390 + 5 for i in range(n)] for n in (12, 300)]
    llm = LLM(str(model_dir), device=device, dtype="float32")
    return compare(llm, model_dir, prompts, 200, device, torch.float32)


@section("quantized_kernels")
def quantized(root, device):
    from llmaccel.ops.quant_linear import int4_kernel_available, int8_kernel_available

    out = {"int8_kernel": int8_kernel_available(device), "int4_kernel": int4_kernel_available(device)}
    model_dir = root / "llama-gqa"
    prompt = [5, 17, 42, 99, 7, 23, 61, 8, 150, 33]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    float_tokens = LLM(str(model_dir), device=device, dtype="bfloat16").generate(prompt, params)[0].outputs[0]
    for name, options in (("int8", {"quantization": "int8"}), ("int4-g32", {"quantization": "int4",
                                                                            "quant_group_size": 32})):
        llm = LLM(str(model_dir), device=device, dtype="bfloat16", **options)
        tokens = llm.generate(prompt, params)[0].outputs[0].token_ids
        divergence = llm.engine.divergence(prompt, tokens, params)
        out[name] = {"same_as_bf16": first_difference(tokens, float_tokens.token_ids) is None,
                     "mean_kl_vs_float": divergence.mean_kl}
    return out


@section("prefix_caching")
def prefix_caching(root, device):
    model_dir = root / "llama-gqa"
    shared = [(i * 13) % 390 + 5 for i in range(512)]
    prompts = [shared + [11, 12, 13], shared + [21, 22, 23, 24]]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    cached = LLM(str(model_dir), device=device, dtype="float32")
    first = cached.generate(prompts[0], params)[0]
    second = cached.generate(prompts[1], params)[0]
    plain = LLM(str(model_dir), device=device, dtype="float32", enable_prefix_caching=False)
    return {"second_cached_tokens": second.num_cached_tokens,
            "identical_to_uncached": [o.outputs[0].token_ids for o in (first, second)]
            == [o.outputs[0].token_ids for o in plain.generate(prompts, params, use_tqdm=False)]}


@section("gguf_types")
def gguf_types(root, device):
    """A tiny Llama saved as each GGUF type: read dense on the GPU it is HF's model of the dequantized weights
    (greedy tokens against HF on the GPU); read with --quantization gguf (torch's INT8/INT4 kernels for Q8_0 and
    Q4_x, K-quants dequantized) it scores text as the dense read does."""
    import gguf

    from llmaccel.model.loader import hf_dir_for
    from tests.tiny_gguf import make_llama256, write_gguf
    from tests.tiny_models import build_tokenizer

    q = gguf.GGMLQuantizationType
    tokenizer = build_tokenizer()
    source = make_llama256(root / "llama256", tokenizer)
    q4_k_m = {"": q.Q4_K, "blk.0.attn_v.weight": q.Q6_K, "blk.1.ffn_down.weight": q.Q6_K, "output.weight": q.Q6_K}
    prompts = [tokenizer.encode(t) for t in ("The quick brown fox", "你好，世界", "def hello():")]
    text = tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好，世界", add_special_tokens=False)
    out = {}
    os.environ["LLMACCEL_CACHE_DIR"] = str(root / "cache")
    for name, qtype in (("F16", q.F16), ("BF16", q.BF16), ("Q8_0", q.Q8_0), ("Q4_0", q.Q4_0), ("Q4_1", q.Q4_1),
                        ("Q4_K", q.Q4_K), ("Q5_K", q.Q5_K), ("Q6_K", q.Q6_K), ("Q4_K_M", q4_k_m)):
        path = write_gguf(source, root / f"tiny-{name}.gguf", qtype, json.loads((source / "config.json").read_text()),
                          tokenizer)
        dense = LLM(str(path), device=device, dtype="float32")
        native = LLM(str(path), device=device, dtype="float32", quantization="gguf")
        dense_scores = torch.tensor(dense.engine.score(text))
        native_scores = torch.tensor(native.engine.score(text))
        result = compare(dense, hf_dir_for(str(path)), prompts, 24, device, torch.float32)
        result["native_max_score_difference"] = float((native_scores - dense_scores).abs().max())
        out[name] = result
        del dense, native
    return out


def shape_checkpoint(shape_name, arch_dir, root):
    """A random-weight HF checkpoint at a published shape (llmaccel bench make-model), bf16."""
    from llmaccel.bench.make_model import make_model
    from llmaccel.model.shapes import shape_named

    return make_model(shape_named(shape_name), "hf", root / shape_name, tokenizer_from=Path(arch_dir))


def measure_speed(arch_dir, root, device, num_prompts, new_tokens, model_dir=None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from llmaccel.data.prompts import builtin_prompts

    if model_dir is None:
        config = AutoConfig.from_pretrained(arch_dir)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model_dir = root / "smollm2-arch"
        model.save_pretrained(model_dir)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(arch_dir)
    tokenizer.save_pretrained(model_dir)
    texts = [p.prompt for p in builtin_prompts()][:num_prompts]
    ids = [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}], tokenize=False,
                                                          add_generation_prompt=True), add_special_tokens=False)
           for t in texts]
    out = {"model": Path(model_dir).name, "prompts": len(ids), "new_tokens": new_tokens,
           "prompt_tokens": sum(map(len, ids))}
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    llm = LLM(str(model_dir), device=device, dtype="bfloat16")
    llm.generate(ids[:4], params, use_tqdm=False)  # warm-up
    sync()
    start = time.perf_counter()
    llm.generate(ids, params, use_tqdm=False)
    sync()
    out["llmaccel_batch_tok_s"] = len(ids) * new_tokens / (time.perf_counter() - start)
    start = time.perf_counter()
    llm.generate(ids[0], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    sync()
    out["llmaccel_single_tok_s"] = 300 / (time.perf_counter() - start)
    del llm
    hf = model.to(device).eval()
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    with torch.no_grad():
        width = max(map(len, ids))
        batch = torch.tensor([[pad] * (width - len(x)) + x for x in ids], device=device)
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in ids], device=device)
        hf.generation_config.eos_token_id = None  # every sequence runs to max_new_tokens, as ignore_eos does
        kwargs = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": pad, "eos_token_id": None}
        hf.generate(batch[:4], attention_mask=mask[:4], **kwargs)  # warm-up
        sync()
        start = time.perf_counter()
        hf.generate(batch, attention_mask=mask, **kwargs)
        sync()
        out["hf_static_batch_tok_s"] = len(ids) * new_tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        for x in ids[:4]:
            t = torch.tensor([x], device=device)
            hf.generate(t, attention_mask=torch.ones_like(t), **kwargs)
        sync()
        out["hf_one_at_a_time_tok_s"] = 4 * new_tokens / (time.perf_counter() - start)
        start = time.perf_counter()
        t = torch.tensor([ids[0]], device=device)
        hf.generate(t, attention_mask=torch.ones_like(t), **{**kwargs, "max_new_tokens": 300})
        sync()
        out["hf_single_tok_s"] = 300 / (time.perf_counter() - start)
    out["batch_ratio_vs_hf_static"] = out["llmaccel_batch_tok_s"] / out["hf_static_batch_tok_s"]
    out["single_ratio_vs_hf"] = out["llmaccel_single_tok_s"] / out["hf_single_tok_s"]
    return out


def shape_speed(args, root) -> None:
    model_dir = shape_checkpoint(args.shape, args.arch_dir, root)
    timed = section(f"speed_vs_hf_{args.shape}")(measure_speed)
    timed(args.arch_dir, root, args.device, args.num_prompts, 64, model_dir)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda, or cpu to try the script here")
    parser.add_argument("--arch-dir", required=True, help="config.json and tokenizer of the default model")
    parser.add_argument("--num-prompts", type=int, default=64, help="prompts of the speed comparison")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens per prompt in the speed comparison")
    parser.add_argument("--shape", default="llama-1b",
                        help="a published shape (llama-1b, llama-3b, ...) timed against HF after the default model's")
    parser.add_argument("--skip", default="", help="sections to skip, comma-separated: tiny, window, quantized, "
                                                    "prefix, gguf, speed, shape")
    args = parser.parse_args()
    skip = set(args.skip.split(","))
    root = Path(tempfile.mkdtemp())
    environment(args.device)
    for name, call in (("tiny", lambda: tiny_models(root, args.device)),
                       ("window", lambda: sliding_window(root, args.device)),
                       ("quantized", lambda: quantized(root, args.device)),
                       ("prefix", lambda: prefix_caching(root, args.device)),
                       ("gguf", lambda: gguf_types(root, args.device)),
                       ("speed", lambda: section("speed_vs_hf")(measure_speed)(
                           args.arch_dir, root, args.device, args.num_prompts, args.new_tokens)),
                       ("shape", lambda: shape_speed(args, root))):
        if name not in skip:
            call()
    out_dir = Path(os.environ.get("OUT", root))
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "cuda_check.json").write_text(json.dumps(RESULTS, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
