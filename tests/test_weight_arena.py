"""The decode weights in one huge-page mapping (model/weight_arena.py): every module reads a view of it,
in the order a step streams them, tied tables stay one tensor, values unchanged, no second copy."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from torch import nn

from llmaccel import LLM
from llmaccel.model.weight_arena import WeightArena, _weight_attribute
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.platform import HUGE_PAGE


class _Holder(nn.Module):
    def __init__(self, weight: nn.Parameter | None = None, blocks: torch.Tensor | None = None) -> None:
        super().__init__()
        if weight is not None:
            self.weight = weight
        if blocks is not None:
            self.blocks = blocks  # a plain attribute, as Int8Linear / Int4Linear hold theirs


def _huge_pages_of(address: int) -> int | None:
    """AnonHugePages (kB) of the mapping of this process that holds `address`."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    for i, line in enumerate(lines):
        match = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if match and int(match.group(1), 16) <= address < int(match.group(2), 16):
            for field in lines[i + 1:]:
                if field.startswith("AnonHugePages:"):
                    return int(field.split()[1])
    return None


def test_arena_moves_parameters_attributes_and_tied_copies_to_views_in_order():
    torch.manual_seed(0)
    tied = nn.Parameter(torch.randn(1024, 1024), requires_grad=False)  # 4 MiB
    blocks = torch.randint(0, 255, (3 * 2**20,), dtype=torch.uint8)
    first, second, tied_again = _Holder(weight=tied), _Holder(blocks=blocks), _Holder(weight=tied)
    root = nn.ModuleList([first, second, tied_again])
    want_weight, want_blocks = tied.detach().clone(), blocks.clone()

    arena = WeightArena([second, first], root)  # the step reads second, then first

    assert torch.equal(first.weight, want_weight) and torch.equal(second.blocks, want_blocks)
    assert isinstance(first.weight, nn.Parameter) and not first.weight.requires_grad
    assert tied_again.weight.data_ptr() == first.weight.data_ptr()  # the tie kept, one copy
    assert second.blocks.data_ptr() % HUGE_PAGE == 0  # the first weight opens a huge page
    assert first.weight.data_ptr() == second.blocks.data_ptr() + 3 * 2**20  # back to back, in step order
    assert arena.nbytes == 4 * 2**20 + 3 * 2**20
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if arena.huge_pages and thp.exists() and "[never]" not in thp.read_text():
        assert _huge_pages_of(second.blocks.data_ptr()) >= 2048  # kB: the kernel gave huge pages


@pytest.mark.skipif(not hasattr(load_cpu_kernels(), "DecodeStack"), reason="C++ kernels unavailable")
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_model_weights_lie_in_one_mapping_in_step_order(llama_dir, quantization):
    llm = LLM(model=str(llama_dir), quantization=quantization, num_kv_blocks=16)
    model = llm.engine.runner.model
    assert model.decode_stack is not None
    streamed = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    tensors = [getattr(m, _weight_attribute(m)) for m in [*streamed, model.lm_head]]
    starts = [t.data_ptr() for t in tensors]
    assert starts == sorted(starts) and starts[0] % HUGE_PAGE == 0
    for t, following in zip(tensors, starts[1:], strict=False):  # each right after the one before (page-padded)
        assert following - t.data_ptr() == -(-t.nbytes // 4096) * 4096
