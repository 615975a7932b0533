"""`llmaccel bench lora` on a tiny model: its adapters load as PEFT directories and every arm generates every token."""

from __future__ import annotations

import argparse

import torch

from llmaccel.bench.lora import TARGETS, add_arguments, measure, write_adapter
from llmaccel.lora.adapter import read_adapter
from llmaccel.model.loader import load_checkpoint


def test_the_bench_adapters_are_peft_directories_on_every_target(llama_dir, tmp_path):
    spec = load_checkpoint(str(llama_dir)).spec
    adapter = read_adapter("probe", write_adapter(tmp_path / "probe", spec, 4, 0), spec, 4, torch.float32)
    assert adapter.rank == 4 and len(adapter.pieces) == spec.num_layers * len(TARGETS)


def test_the_bench_measures_every_arm(llama_dir, tmp_path):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", str(llama_dir), "--adapters", "3", "--rank", "4", "--num-prompts", "6",
                              "--output-len", "4", "--rounds", "1", "--dtype", "float32"])
    result = measure(args, tmp_path)
    assert set(result["medians"]) == {"base", "3_adapters", "1_adapter"}
    assert all(rate > 0 for rate in result["medians"].values())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter-0", "adapter-1", "adapter-2"]
