"""What sampling costs a decode step: the batch's draw over the default model's vocabulary (49,152) at
batch 1 and 64, for greedy rows and the usual chat settings, three ways in one run:
- race: torch, the whole vocabulary sorted for top-k / top-p and an Exp(1) number per token
  (argmax(p / q)), llmaccel's sampler before the C++ draw and vLLM-CPU's way;
- torch: llmaccel's torch path (other devices): the same truncation, one uniform number per row;
- kernel: llmaccel's C++ draw on the CPU (ops/csrc/sampling.cpp), what `Sampler.sample` runs here.

    .venv/bin/python tools/sampler_bench.py [--vocab 49152] [--batches 1,64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from llmaccel.platform import describe
from llmaccel.sampler import Sampler, SamplingRow, _top_k_top_p, draw_reference, sampling_kernels
from llmaccel.sampling_params import SamplingParams

SETTINGS = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 1": SamplingParams(temperature=1.0),
    "temperature 0.7, top_p 0.9": SamplingParams(temperature=0.7, top_p=0.9),
    "temperature 0.8, top_k 40": SamplingParams(temperature=0.8, top_k=40),
    "temperature 1, min_p 0.05": SamplingParams(temperature=1.0, min_p=0.05),
}


def race(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The exponential race over torch's full sort (the sampler before the C++ draw)."""
    logits = logits / params.temperature
    if params.top_k or params.top_p < 1:
        rows = logits.shape[0]
        logits = _top_k_top_p(logits, torch.full((rows,), params.top_k), torch.full((rows,), params.top_p))
    probs = torch.softmax(logits, dim=-1)
    if params.min_p:
        probs = torch.where(probs < params.min_p * probs.max(-1, keepdim=True).values, 0.0, probs)
    return (probs / torch.empty_like(probs).exponential_()).argmax(-1)


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def time_setting(sampler: Sampler, logits: torch.Tensor, params: SamplingParams, repeats: int) -> dict[str, float]:
    """Milliseconds a step's draw for every row of `logits`, three ways (greedy: the argmax for all)."""
    rows = [SamplingRow(params, [1, 2, 3], [4], None)] * logits.shape[0]
    uniform = torch.rand(logits.shape[0], dtype=torch.float64)
    cell = {"kernel_ms": median_ms(lambda: sampler.sample(logits, rows), repeats)}
    if params.greedy:
        cell["race_ms"] = cell["torch_ms"] = median_ms(lambda: logits.argmax(-1), repeats)
    else:
        cell["race_ms"] = median_ms(lambda: race(logits, params), repeats)
        cell["torch_ms"] = median_ms(lambda: draw_reference(sampler._probs(logits, rows), uniform), repeats)
    return cell


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=49152, help="vocabulary size (the default model's)")
    parser.add_argument("--batches", default="1,64", help="comma list of batch sizes (rows sampled a step)")
    parser.add_argument("--repeats", type=int, default=30, help="timed calls per cell (median reported)")
    parser.add_argument("--out", type=Path, help="also write the figures here as JSON")
    args = parser.parse_args()
    if sampling_kernels() is None:
        raise SystemExit("llmaccel's C++ sampling kernel is unavailable here (see the log)")
    machine = describe()
    print(machine)
    sampler = Sampler(args.vocab, torch.device("cpu"))
    results = []
    print("| rows | setting | race (ms) | torch (ms) | kernel (ms) | kernel vs race |\n|---|---|---|---|---|---|")
    for batch in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(batch, args.vocab, generator=torch.Generator().manual_seed(batch)) * 3
        for name, params in SETTINGS.items():
            cell = {"rows": batch, "setting": name, **time_setting(sampler, logits, params, args.repeats)}
            results.append(cell)
            print(f"| {batch} | {name} | {cell['race_ms']:.2f} | {cell['torch_ms']:.2f} | {cell['kernel_ms']:.2f} | "
                  f"{cell['race_ms'] / cell['kernel_ms']:.1f}x |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine, "vocab": args.vocab, "results": results}, indent=1))


if __name__ == "__main__":
    main()
