"""The decode weights in one huge-page mapping (model/weight_arena.py): every module reads a view of it,
in the order a step streams them, tied tables stay one tensor, values unchanged, no second copy; a bf16 model's
dense weights read straight into it at load, and a weight moved into another layout hands its pages back."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from torch import nn

from llmaccel import LLM
from llmaccel.model.causal_lm import WeightLoader
from llmaccel.model.weight_arena import LoadArena, WeightArena, _weight_attribute
from llmaccel.ops.cpu_kernels import load_cpu_kernels
from llmaccel.ops.cpu_linear import compact_rows
from llmaccel.ops.kernel_choice import Bf16Choice, compact_available
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


def _step_weights(model) -> list[torch.Tensor]:
    streamed = [m for layer in model.layers for m in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    return [getattr(m, _weight_attribute(m)) for m in [*streamed, model.lm_head]]


@pytest.mark.skipif(not hasattr(load_cpu_kernels(), "DecodeStack"), reason="C++ kernels unavailable")
@pytest.mark.parametrize("source", ["safetensors", "BF16", "Q8_0", "Q4_0"])
def test_a_bfloat16_models_weights_are_read_once_into_the_mapping_a_step_streams(
        tiny_model_dirs, tiny_tokenizer, tmp_path, monkeypatch, source):
    """Each dense matrix goes from the checkpoint straight into its rows of one load arena, in step order (the
    layers, then the head), 64-byte aligned with no page padding: the decode stack's WeightArena (which pads to
    pages) copied nothing. The values are the checkpoint's own (a quantized GGUF file's dequantized, read a few
    rows at a time), q and k in HF's row order for a GGUF file."""
    import gguf
    from safetensors.torch import load_file

    from llmaccel.model.gguf import weights as gguf_weights
    from llmaccel.model.loader import load_checkpoint
    from tests.tiny_gguf import write_gguf

    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_weights, "READ_ROWS", 5)  # several slices a matrix, the last one short
    hf_dir = tiny_model_dirs["llama-gqa"]
    model_path = hf_dir
    if source != "safetensors":
        config = json.loads((hf_dir / "config.json").read_text())
        model_path = write_gguf(hf_dir, tmp_path / "tiny.gguf", gguf.GGMLQuantizationType[source], config,
                                tiny_tokenizer)
    model = LLM(model=str(model_path), dtype="bfloat16", num_kv_blocks=16).engine.runner.model
    assert model.decode_stack is not None
    tensors = _step_weights(model)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for t, following in zip(tensors, [t.data_ptr() for t in tensors[1:]], strict=False):
        assert following == -(-(t.data_ptr() + t.nbytes) // LoadArena.ALIGN) * LoadArena.ALIGN
    assert any(t.nbytes % 4096 for t in tensors)
    if source == "safetensors":
        stored = load_file(next(hf_dir.glob("*.safetensors")))
    else:  # the file's tensors as a whole-tensor read gives them (the GGUF tests hold it to the gguf package)
        stored = load_checkpoint(str(model_path)).weights
    p = "model.layers.1."
    want = torch.cat([stored[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).bfloat16()
    assert torch.equal(model.layers[1].qkv.weight, want)
    assert torch.equal(model.lm_head.weight, stored["lm_head.weight"].bfloat16())
    if source in ("safetensors", "BF16"):  # in bf16 the file holds HF's own weights
        hf = load_file(next(hf_dir.glob("*.safetensors")))
        assert torch.equal(want, torch.cat([hf[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).bfloat16())


@pytest.mark.skipif(not (compact_available() and hasattr(load_cpu_kernels(), "DecodeStack")),
                    reason="no compact-layout kernels on this CPU")
def test_weights_moved_to_the_compact_layout_at_load_are_packed_into_the_mapping_a_step_streams(
        tiny_model_dirs, tmp_path, monkeypatch):
    """Each weight is packed at the next 64-byte boundary of one mapping, in step order (the layers, then the head),
    with no page padding: the decode stack's WeightArena (which pads to pages) copied nothing; every weight decodes
    to the checkpoint's bits."""
    from safetensors.torch import load_file

    from llmaccel.ops.kernel_choice import LAYOUT_ENV

    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv(LAYOUT_ENV, "compact")
    hf_dir = tiny_model_dirs["llama-tied"]
    model = LLM(model=str(hf_dir), dtype="bfloat16", num_kv_blocks=16).engine.runner.model
    tensors = _step_weights(model)
    assert all(m.compact is t for m, t in zip([*(m for layer in model.layers for m in layer.projections),
                                               model.lm_head], tensors, strict=True))
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for t, following in zip(tensors, [t.data_ptr() for t in tensors[1:]], strict=False):
        assert following == -(-(t.data_ptr() + t.nbytes) // LoadArena.ALIGN) * LoadArena.ALIGN
    stored = load_file(next(hf_dir.glob("*.safetensors")))
    p = "model.layers.1."
    want = torch.cat([stored[p + f"self_attn.{x}_proj.weight"] for x in "qkv"]).bfloat16()
    assert torch.equal(compact_rows(model.layers[1].qkv.compact, torch.arange(len(want))), want)


def test_a_writer_that_learns_its_size_claims_what_it_wrote_at_the_front_of_the_rest():
    arena = LoadArena(4096)
    arena.take((100,))
    rest = arena.rest()
    assert rest.data_ptr() == arena.whole.data_ptr() + 128 and rest.numel() == 4096 - 128  # the next 64-byte edge
    assert arena.claim(rest[:1000]) and arena.used == 1128
    assert not arena.claim(torch.zeros(10, dtype=torch.uint8))  # made elsewhere: nothing taken
    assert not arena.claim(arena.rest()[64:128]) and arena.used == 1128  # not at the front
    assert arena.claim(arena.rest()) and arena.rest().numel() == 0 and not arena.claim(arena.rest())


def test_a_weight_given_back_leaves_its_whole_pages_and_nothing_else():
    """The pages under a weight that moved to another layout return to the OS (they read as zero again); the
    page it shares with a neighbour, and the neighbours, keep their bytes."""
    arena = LoadArena(4 * 4096)
    before, moved, after = arena.take((4096 + 100,)), arena.take((2 * 4096,)), arena.take((100,))
    for t, value in ((before, 1), (moved, 2), (after, 3)):
        t.fill_(value)
    LoadArena.give_back(moved)
    start = moved.data_ptr()
    first_page = -(-start // 4096) * 4096 - start  # bytes of `moved` on the page it shares with `before`
    assert (moved[:first_page] == 2).all() and first_page > 0
    assert (moved[first_page:first_page + 4096] == 0).all()  # its one whole page
    assert (moved[first_page + 4096:] == 2).all()  # on the page it shares with `after`
    assert (before == 1).all() and (after == 3).all()
    LoadArena.give_back(torch.ones(8192, dtype=torch.uint8))  # not in an arena: nothing happens


@pytest.mark.skipif(not compact_available(), reason="no compact-layout kernels on this CPU")
def test_a_placed_weight_moved_to_the_compact_layout_at_load_gives_its_pages_back():
    """As the kernel tuner does at load, while the load arena lives: the old copy's whole pages are handed back."""
    torch.manual_seed(0)
    checkpoint = {"gate": torch.randn(64, 256), "up": torch.randn(64, 256)}
    take = WeightLoader(checkpoint, torch.bfloat16, torch.device("cpu"))
    linear = take.dense(["gate", "up"], None, "gate_up")
    plain = linear.weight
    assert torch.equal(plain, torch.cat([checkpoint["gate"], checkpoint["up"]]).bfloat16())
    assert LoadArena.holding([plain]) is take._arena
    want = plain.clone()
    linear.set_bf16_choice(Bf16Choice(((1, "compact_stream"),), "compact"))
    assert linear.weight is None and torch.equal(compact_rows(linear.compact, torch.arange(128)), want)
    inner = plain.view(-1).view(torch.uint8)[4096:-4096]  # whole pages of it, wherever its edges fall
    assert inner.numel() > 0 and (inner == 0).all()


def test_weights_already_placed_stay_and_only_the_others_are_copied():
    """A model whose LM head alone moved out of the load arena (another layout): the layers' weights keep their
    place, so the load arena is not held resident beside a second copy of them; the head gets a mapping of its own."""
    torch.manual_seed(0)
    arena = LoadArena(3 * 2**20)
    first, second = arena.take((2**20,)), arena.take((2**20,))
    first.copy_(torch.randint(0, 255, (2**20,), dtype=torch.uint8))
    second.copy_(torch.randint(0, 255, (2**20,), dtype=torch.uint8))
    head = torch.randint(0, 255, (3 * 2**20,), dtype=torch.uint8)
    layers = [_Holder(blocks=first), _Holder(blocks=second)]
    outside = _Holder(blocks=head)
    root = nn.ModuleList([*layers, outside])
    where = [first.data_ptr(), second.data_ptr(), head.data_ptr()]
    want = [first.clone(), second.clone(), head.clone()]

    weights = WeightArena([*layers, outside], root)

    assert [layers[0].blocks.data_ptr(), layers[1].blocks.data_ptr()] == where[:2]  # not copied
    assert outside.blocks.data_ptr() != where[2] and outside.blocks.data_ptr() % HUGE_PAGE == 0  # its own mapping
    assert LoadArena.holding([outside.blocks]) is None
    assert all(torch.equal(h.blocks, w) for h, w in zip([*layers, outside], want, strict=True))
    assert weights.mappings == 2 and weights.nbytes == arena.used + 3 * 2**20
