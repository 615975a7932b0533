"""AWQ: the folded scales leave the float model unchanged, the search beats round-to-nearest where
activations have outlier channels, `llmaccel quantize --awq` writes a checkpoint that reloads, and
bad calibration input is a clear error."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from llmaccel.llm import LLM
from llmaccel.quantization.awq import apply_awq, record_activations, search_scale
from llmaccel.quantization.formats import quantize
from llmaccel.sampling_params import SamplingParams

TEXT = "The quick brown fox jumps over the lazy dog. 你好，世界。 def hello(): print('hello world')"


# MHA (o folds into v), GQA with q/k/v biases, q/k norms
@pytest.mark.parametrize("name", ["llama-tied", "qwen2-bias", "qwen3"])
def test_folded_scales_leave_the_float_model_unchanged(tiny_model_dirs, tmp_path, name):
    source = tiny_model_dirs[name]
    llm = LLM(str(source))
    ids = llm.tokenizer.encode(TEXT, add_special_tokens=False)
    recorders = record_activations(llm, [ids[:20], ids[10:]], progress=False)
    weights = load_file(str(source / "model.safetensors"))
    spec = llm.engine.spec
    alphas = apply_awq(weights, recorders, spec.num_layers, spec.num_heads, spec.num_kv_heads, "int4", 32)
    assert len(alphas) == spec.num_layers * (4 if spec.num_heads == spec.num_kv_heads else 3)
    scaled = tmp_path / "scaled"
    shutil.copytree(source, scaled)
    save_file(weights, str(scaled / "model.safetensors"), metadata={"format": "pt"})
    original = load_file(str(source / "model.safetensors"))
    assert any(not torch.equal(weights[k], original[k]) for k in original)  # something was scaled
    before, after = torch.tensor(llm.engine.score(ids)), torch.tensor(LLM(str(scaled)).engine.score(ids))
    assert (before - after).abs().max() < 1e-4


@pytest.mark.parametrize("method,group", [("int4", 64), ("int8", None)])
def test_search_beats_round_to_nearest_on_outlier_channels(method, group):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(512, 128, generator=g)
    x[:, :4] *= 30  # a few salient channels, as LLM activations have
    weight = torch.randn(96, 128, generator=g)
    reference = x @ weight.t()

    def error(dequantized: torch.Tensor) -> float:
        return (x @ dequantized.t() - reference).pow(2).mean().item()

    scale, alpha = search_scale(x, x.abs().mean(0), weight, method, group)
    rtn = error(quantize(weight, method, group).dequantize())
    awq = error(quantize(weight * scale, method, group).dequantize() / scale)
    assert alpha > 0 and awq < 0.5 * rtn


def _calibration_file(path, lines: list[str]):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_quantize_with_awq_writes_a_checkpoint_that_reloads(llama_dir, tmp_path):
    from llmaccel.cli import main
    from llmaccel.ops.quant_linear import Int4Linear

    calib = _calibration_file(tmp_path / "calib.jsonl", [
        json.dumps({"text": TEXT}), json.dumps({"prompt": "Continuous batching packs requests."}), "",
        json.dumps({"messages": [{"role": "user", "content": "你好，世界"}]}), json.dumps({"text": "unused"})])
    out = tmp_path / "awq"
    assert main(["quantize", "--model", str(llama_dir), "--method", "int4", "--group-size", "32", "--awq",
                 "--calib", str(calib), "--calib-samples", "3", "--out", str(out)]) == 0
    config = json.loads((out / "llmaccel_quantization.json").read_text())
    assert config["awq"]["samples"] == 3 and len(config["awq"]["alphas"]) == 2 * 3
    assert config["reference_perplexity"] > 1
    llm = LLM(str(out))
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.runner.model.modules()) == 2 * 4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    assert [len(o.outputs[0].token_ids) for o in llm.generate(["The quick brown fox", "你好"], params)] == [8, 8]


@pytest.mark.parametrize("lines,extra,message", [
    ([], [], "is empty"),
    (["{\"text\": \"ok\"}", "not json"], [], "is not JSONL: line 2 is not JSON"),
    (["[1, 2]"], [], "line 1: expected an object with a non-empty \"text\""),
    (["{\"text\": \"ok\"}"], ["--calib-samples", "0"], "--calib-samples must be at least 1"),
])
def test_bad_calibration_input_is_a_clear_error(llama_dir, tmp_path, capsys, lines, extra, message):
    from llmaccel.cli import main

    calib = _calibration_file(tmp_path / "calib.jsonl", lines)
    args = ["quantize", "--model", str(llama_dir), "--method", "int4", "--group-size", "32", "--awq",
            "--calib", str(calib), "--out", str(tmp_path / "out")]
    assert main(args + extra) == 2
    assert message in capsys.readouterr().err


def test_calibration_options_need_awq(llama_dir, tmp_path, capsys):
    from llmaccel.cli import main

    base = ["quantize", "--model", str(llama_dir), "--out", str(tmp_path / "out")]
    assert main(base + ["--method", "int4", "--calib", str(tmp_path / "c.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "--calib and --calib-samples choose AWQ's calibration data; add --awq" in err
