"""What the read bandwidth of this machine is made of: one thread against two, a sweep that fits
partly in L3 against one that does not, torch's sum against llmaccel's INT4 kernel on the same bytes.

    .venv/bin/python tools/bandwidth_probe.py --rounds 6

The ceiling that `bench compare` holds a lone request against is `platform.read_bandwidth_gbps`: two
threads summing 512 MB on huge pages. On the 2-core AMD EPYC Zen 4 machines this project runs on, that
reading jumps between ~35 and ~70 GB/s within minutes; this shows which part moves (docs/results/issue14/HISTORY.md,
"What the bursts are").
"""

from __future__ import annotations

import argparse
import time

import torch

from llmaccel.ops.gemv import gemv_kernels, pack_int4_blocks
from llmaccel.platform import describe, huge_page_buffer, read_bandwidth_gbps

INPUTS = 576  # the default model's width: 18 INT4 blocks a row group


def int4_weight(megabytes: int) -> tuple[torch.Tensor, int]:
    """An INT4 weight of about `megabytes` in gemv_i4's blocks, on huge pages, and its row count."""
    scales = torch.rand(16, INPUTS // 32)
    group = pack_int4_blocks(torch.randint(0, 16, (16, INPUTS)), scales, scales)
    groups = megabytes * 2**20 // group.numel()
    buffer = huge_page_buffer(groups * group.numel())[0]
    buffer.view(groups, -1).copy_(group.view(1, -1).expand(groups, -1))
    return buffer.view(groups, *group.shape[1:]), groups * 16


def best_gbps(fn, nbytes: int, repeats: int = 5) -> float:
    best = float("inf")
    for _ in range(repeats):
        began = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - began)
    return nbytes / best / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=6, help="rounds of every reading, a few seconds apart")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds between rounds")
    args = parser.parse_args()
    kernels = gemv_kernels()
    if kernels is None:
        raise SystemExit("llmaccel's CPU kernels are unavailable here (see the log)")
    print(describe())
    weights = {mb: int4_weight(mb) for mb in (70, 512)}
    x = torch.randn(1, INPUTS)
    threads = torch.get_num_threads()
    print("GB/s: sum over 512 MB with 1 and all threads; sum and INT4 kernel over 70 and 512 MB, all threads")
    for _ in range(args.rounds):
        torch.set_num_threads(1)  # the ceiling's own reading (platform.read_bandwidth_gbps), on one thread
        cells = [f"sum512 1 thread {read_bandwidth_gbps(512):.1f}"]
        torch.set_num_threads(threads)
        cells += [f"sum{mb} {read_bandwidth_gbps(mb):.1f}" for mb in (70, 512)]
        for mb, (blocks, rows) in weights.items():
            rate = best_gbps(lambda b=blocks, n=rows: kernels.gemv_i4(x, b, n), blocks.numel())
            cells.append(f"int4-{mb} {rate:.1f}")
        print(" | ".join(cells), flush=True)
        time.sleep(args.pause)


if __name__ == "__main__":
    main()
