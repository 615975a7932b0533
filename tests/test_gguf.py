"""GGUF loading: dequantized tensors, un-permuted q/k, tokenizer from metadata, cached conversion."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

from llmaccel.llm import LLM
from llmaccel.model.loader import hf_dir_for
from llmaccel.sampling_params import SamplingParams
from tests.tiny_gguf import write_gguf
from tests.tiny_models import hf_greedy

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tied_dir(tiny_model_dirs):
    return tiny_model_dirs["llama-tied"]


def _write(tied_dir, tmp_path, qtype, tokenizer):
    config = json.loads((tied_dir / "config.json").read_text())
    return write_gguf(tied_dir, tmp_path / f"tiny-{qtype.name}.gguf", qtype, config, tokenizer)


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """A fresh conversion cache per test, so conversion really runs (kernels stay in the user's cache)."""
    from llmaccel.ops.cpu_kernels import load_cpu_kernels

    load_cpu_kernels()
    monkeypatch.setenv("LLMACCEL_CACHE_DIR", str(tmp_path / "cache"))


def test_f32_gguf_generates_the_same_tokens_as_hf_on_the_source_checkpoint(tied_dir, tmp_path, tiny_tokenizer):
    path = _write(tied_dir, tmp_path, Q.F32, tiny_tokenizer)
    llm = LLM(str(path))
    prompt = tiny_tokenizer.encode("The quick brown fox")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert out[0].outputs[0].token_ids == hf_greedy(tied_dir, prompt, 20)
    assert llm.tokenizer.encode("你好，世界 hello") == tiny_tokenizer.encode("你好，世界 hello")
    assert llm.tokenizer.chat_template == tiny_tokenizer.chat_template


@pytest.mark.parametrize("qtype", [Q.F16, Q.Q8_0, Q.Q4_0, Q.Q4_1])
def test_quantized_tensors_dequantize_to_what_gguf_stored(tied_dir, tmp_path, tiny_tokenizer, qtype):
    path = _write(tied_dir, tmp_path, qtype, tiny_tokenizer)
    converted = load_file(str(hf_dir_for(str(path)) / "model.safetensors"))
    source = load_file(str(tied_dir / "model.safetensors"))
    for name in ("model.layers.0.mlp.down_proj.weight", "model.layers.1.self_attn.q_proj.weight",
                 "model.layers.0.self_attn.k_proj.weight"):
        # quantization error only: the same round trip gguf itself performs, rows back in HF order
        expected = gguf.quants.dequantize(gguf.quants.quantize(source[name], qtype), qtype)
        assert np.array_equal(converted[name], expected), name
    assert np.array_equal(converted["model.norm.weight"], source["model.norm.weight"])  # 1-D stays F32


def test_conversion_is_cached_by_file_hash(tied_dir, tmp_path, tiny_tokenizer):
    path = _write(tied_dir, tmp_path, Q.Q8_0, tiny_tokenizer)
    first = hf_dir_for(str(path))
    marker = first / "model.safetensors"
    stamp = marker.stat().st_mtime_ns
    assert hf_dir_for(str(path)) == first and marker.stat().st_mtime_ns == stamp


def test_permutation_round_trip():
    from llmaccel.model.gguf.names import unpermute_rows
    from tests.tiny_gguf import permute

    w = np.arange(8 * 3 * 4, dtype=np.float32).reshape(8 * 3, 4)
    config = {"model_type": "llama", "num_attention_heads": 3, "num_key_value_heads": 3}
    assert np.array_equal(unpermute_rows(permute(w, 3), "blk.0.attn_q.weight", config), w)
    assert np.array_equal(unpermute_rows(w, "blk.0.attn_v.weight", config), w)


def test_unpermuted_q_matches_hf_rotary_layout(tied_dir, tmp_path, tiny_tokenizer):
    path = _write(tied_dir, tmp_path, Q.F32, tiny_tokenizer)
    converted = load_file(str(hf_dir_for(str(path)) / "model.safetensors"))
    source = load_file(str(tied_dir / "model.safetensors"))
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(torch.from_numpy(converted[name]), torch.from_numpy(source[name]))


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q4_0, Q.Q8_0])
def test_native_load_equals_the_gguf_packages_dequantized_values(tied_dir, tmp_path, tiny_tokenizer, qtype):
    """Without llmaccel's kernels (torch's formats) every weight is the dequantized one exactly; repacked for
    the kernels, the kernel multiplies by the same weights (its identity products, to float32 rounding)."""
    from llmaccel.model.gguf.names import llama_config
    from llmaccel.model.gguf.reader import GGUFFile
    from llmaccel.model.gguf.weights import GGUFWeights
    from llmaccel.ops.quant_linear import quantized_linear
    from llmaccel.quantization.formats import Int4Weight, Int8Weight, PackedWeight

    path = _write(tied_dir, tmp_path, qtype, tiny_tokenizer)
    converted = load_file(str(hf_dir_for(str(path)) / "model.safetensors"))  # via gguf.quants.dequantize
    file = GGUFFile(path)
    weights = GGUFWeights(file, llama_config(file))
    torch_formats, packed = weights.packed(cpu_kernels=False), weights.packed()
    assert len(torch_formats) == 2 * 7 + 1  # q, k, v, o, gate, up, down in each of 2 layers, and the embedding
    for name in torch_formats:
        weight = torch_formats[name]
        assert isinstance(weight, Int8Weight if qtype == Q.Q8_0 else Int4Weight)
        assert weight.group_size == 32
        assert np.array_equal(weight.dequantize().numpy(), converted[name]), name
        ready = packed[name]
        assert isinstance(ready, PackedWeight) and ready.layout == ("int8" if qtype == Q.Q8_0 else "int4")
        kernel = quantized_linear(ready, None, torch.device("cpu")).dequantized().numpy()
        np.testing.assert_allclose(kernel, converted[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_gguf_q8_0_runs_natively_with_its_own_embedding_table(tied_dir, tmp_path, tiny_tokenizer, monkeypatch):
    """A Q8_0 file runs on grouped INT8 layers; its Q8_0 embedding is looked up in the file's own rows and, tied,
    is the LM head in the same format. Through torch's float fallback (the kernel's bf16 activations aside,
    covered in test_quantization) it scores text as the dense, dequantized model does."""
    from llmaccel.model.gguf.weights import GGUFRows
    from llmaccel.ops import gemv, quant_linear
    from llmaccel.ops.quant_linear import Int8Linear

    monkeypatch.setattr(quant_linear, "int8_kernel_available", lambda device_type="cpu": False)
    monkeypatch.setattr(quant_linear, "gemv_kernels", lambda: None)
    monkeypatch.setattr(gemv, "gemv_kernels", lambda: None)

    path = _write(tied_dir, tmp_path, Q.Q8_0, tiny_tokenizer)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "你好"]
    llm = LLM(str(path), quantization="gguf")
    model = llm.engine.runner.model
    assert isinstance(model.embedding, GGUFRows) and isinstance(model.lm_head, Int8Linear)
    assert model.lm_head.group_size == 32
    assert sum(isinstance(m, Int8Linear) for m in model.modules()) == 2 * 4 + 1
    batched = llm.generate(prompts, params)
    assert llm.generate(prompts[1], params)[0].outputs[0].token_ids == batched[1].outputs[0].token_ids
    ids = llm.tokenizer.encode("The quick brown fox jumps over the lazy dog. 你好，世界", add_special_tokens=False)
    native, dense = torch.tensor(llm.engine.score(ids)), torch.tensor(LLM(str(path)).engine.score(ids))
    assert (native - dense).abs().max() < 1e-4


def test_gguf_quantization_runs_the_files_own_int4_tensors(tied_dir, tmp_path, tiny_tokenizer):
    from llmaccel.ops.quant_linear import Int4Linear

    path = _write(tied_dir, tmp_path, Q.Q4_1, tiny_tokenizer)
    llm = LLM(str(path), quantization="gguf")
    assert sum(isinstance(m, Int4Linear) for m in llm.engine.runner.model.modules()) == 2 * 4 + 1  # and the head
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = ["The quick brown fox", "你好"]
    batched = llm.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in batched] == [12, 12]
    assert llm.generate(prompts[1], params)[0].outputs[0].token_ids == batched[1].outputs[0].token_ids
    with pytest.raises(ValueError, match="--quantization gguf needs a .gguf model"):
        LLM(str(tied_dir), quantization="gguf")


def test_a_quantized_file_read_as_floats_says_what_the_copy_costs_and_how_to_avoid_it(tied_dir, tmp_path,
                                                                                      tiny_tokenizer, caplog):
    path = _write(tied_dir, tmp_path, Q.Q8_0, tiny_tokenizer)
    with caplog.at_level("INFO", logger="llmaccel.engine.loading"):
        LLM(str(path), dtype="float32")
    notes = [r.getMessage() for r in caplog.records if r.name == "llmaccel.engine.loading"]
    assert len(notes) == 1 and "holds Q8_0 tensors" in notes[0] and "dequantized to float32" in notes[0]
    assert "--quantization gguf serves them as they are" in notes[0]
    caplog.clear()
    with caplog.at_level("INFO", logger="llmaccel.engine.loading"):
        LLM(str(_write(tied_dir, tmp_path, Q.F32, tiny_tokenizer)))  # nothing quantized: nothing to say
    assert not [r for r in caplog.records if r.name == "llmaccel.engine.loading"]


def test_a_float_copy_that_cannot_fit_is_refused_with_the_fix_named(tied_dir, tmp_path, tiny_tokenizer,
                                                                     monkeypatch):
    from llmaccel.engine import loading

    path = _write(tied_dir, tmp_path, Q.Q4_1, tiny_tokenizer)
    monkeypatch.setattr(loading, "available_memory_bytes", lambda: 1000)  # a machine with 1 kB free
    with pytest.raises(ValueError, match=r"holds Q4_1 tensors .* more than the 0.0 GB of memory available: "
                                         r"serve the file's own tensors with --quantization gguf"):
        LLM(str(path))
    assert LLM(str(path), quantization="gguf").generate("Hi", SamplingParams(max_tokens=2))  # in place it loads


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.F32])
def test_the_fast_tensor_table_reads_what_the_gguf_package_reads(tied_dir, tmp_path, tiny_tokenizer, qtype):
    """read_tensors walks past the metadata (tokenizer strings, merges, arrays) to the same tensors, with
    the same names, shapes, types and bytes; a file cut short or of another kind is a ValueError."""
    from llmaccel.model.gguf.reader import GGUFFile

    def read_tensors(path):
        return list(GGUFFile(path).tensors.values())

    path = _write(tied_dir, tmp_path, qtype, tiny_tokenizer)
    ours, theirs = read_tensors(path), gguf.GGUFReader(str(path)).tensors
    assert [(t.name, t.shape, t.tensor_type) for t in ours] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in theirs]
    for mine, reference in zip(ours, theirs, strict=True):
        assert np.array_equal(mine.data, np.asarray(reference.data).view(np.uint8).reshape(-1)), mine.name
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-64])
    with pytest.raises(ValueError, match="runs past the end of the file"):
        read_tensors(cut)
    cut.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="ends early"):
        read_tensors(cut)
    cut.write_bytes(b"PK\x03\x04" + bytes(60))
    with pytest.raises(ValueError, match="is not a GGUF file"):
        read_tensors(cut)


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_gpt2_gguf_file_runs_as_its_hf_checkpoint(tiny_model_dirs, tmp_path, tiny_tokenizer, qtype):
    """llama.cpp's gpt2 layout (tests/tiny_gguf.write_gpt2_gguf), read by transformers' GGUF loader: F32 is the
    source checkpoint token for token; Q8_0 is HF's model on the dequantized directory token for token."""
    from tests.tiny_gguf import write_gpt2_gguf

    source = tiny_model_dirs["gpt2"]
    config = json.loads((source / "config.json").read_text())
    path = write_gpt2_gguf(source, tmp_path / f"tiny-gpt2-{qtype.name}.gguf", qtype, config, tiny_tokenizer)
    llm = LLM(str(path))
    assert llm.engine.spec.architecture == "GPT2LMHeadModel"
    prompt = tiny_tokenizer.encode("The quick brown fox")
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].outputs[0]
    converted = llm.engine.hf_dir
    assert out.token_ids == hf_greedy(converted, prompt, 20)
    if qtype == Q.F32:
        assert out.token_ids == hf_greedy(source, prompt, 20)
    assert llm.tokenizer.encode("你好，世界 hello") == tiny_tokenizer.encode("你好，世界 hello")
    with pytest.raises(ValueError, match="runs the quantized tensors of llama-architecture GGUF files"):
        LLM(str(path), quantization="gguf")


def test_read_into_asks_the_disk_for_each_slice_once_a_slice_ahead(tied_dir, tmp_path, tiny_tokenizer, monkeypatch):
    """The first slice before it is copied, each other while the one before it is (its file rows: q's come from
    rows llama.cpp's order scatters), each with PREFETCH_BYTES of the file past it (after the last slice, the next
    tensors'); the values are the tensor's either way."""
    from llmaccel.model.gguf import weights as gguf_weights
    from llmaccel.model.loader import load_checkpoint

    path = _write(tied_dir, tmp_path, Q.BF16, tiny_tokenizer)
    weights = load_checkpoint(str(path)).weights
    monkeypatch.setattr(gguf_weights, "READ_ROWS", 5)
    asked = []
    monkeypatch.setattr(weights.file, "prefetch", lambda tensor, rows, beyond: asked.append((rows, beyond)))
    copied = []
    real_release = weights.file.release
    monkeypatch.setattr(weights.file, "release", lambda tensor, rows=None: copied.append((len(asked), rows))
                        or real_release(tensor, rows))
    for name in ("model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.q_proj.weight"):
        asked.clear()
        copied.clear()
        rows, k = weights.shape(name)
        order = weights.order(name)
        file_rows = np.arange(rows) if order is None else order
        slices = [(int(file_rows[s:s + 5].min()), int(file_rows[s:s + 5].max()) + 1) for s in range(0, rows, 5)]
        out = torch.empty(rows, k, dtype=torch.bfloat16)
        weights.read_into(name, out)
        assert asked == [(r, gguf_weights.PREFETCH_BYTES) for r in [*slices, (rows, rows)]]
        assert len(slices) > 2 and (order is None) == name.endswith("v_proj.weight")
        # when slice i was copied (and handed back), slices 0 .. i + 1 (or the bytes past the last) had been asked for
        assert copied == [(i + 2, slices[i]) for i in range(len(slices))]
        assert torch.equal(out, weights[name].bfloat16())


def test_prefetch_asks_the_disk_only_for_what_the_call_before_did_not(tied_dir, tmp_path, tiny_tokenizer,
                                                                      monkeypatch):
    """Each slice's request overlaps the one before it by all but a slice: only the new pages are asked for; a
    request that does not start inside the last one is asked whole. A release marks the pages it unmaps cold first."""
    import mmap

    from llmaccel.model.gguf.reader import MADV_COLD, PAGE_SIZE, GGUFFile

    file = GGUFFile(_write(tied_dir, tmp_path, Q.BF16, tiny_tokenizer))
    advised = []
    monkeypatch.setattr(file, "_advise", lambda advice, start, end: advised.append((advice, start, end)))
    tensor = max((t for t in file.tensors.values() if t.data.nbytes >= 4 * PAGE_SIZE), key=lambda t: t.data.ctypes.data)
    beyond = 2 * PAGE_SIZE
    whole = file._pages(tensor, (0, tensor.rows // 2), inside=False, beyond=beyond)
    later = file._pages(tensor, (tensor.rows // 4, tensor.rows), inside=False, beyond=beyond)
    assert whole[0] < later[0] < whole[1] < later[1]
    file.prefetch(tensor, (0, tensor.rows // 2), beyond)
    file.prefetch(tensor, (tensor.rows // 4, tensor.rows), beyond)
    file.prefetch(tensor, (tensor.rows // 4, tensor.rows // 2), beyond)  # all asked for already
    earlier = min(file.tensors.values(), key=lambda t: t.data.ctypes.data)
    first = file._pages(earlier, (0, 1), inside=False)
    assert first[0] < whole[0]
    file.prefetch(earlier, (0, 1), 0)  # starts before the last request: asked whole
    assert advised == [(mmap.MADV_WILLNEED, *whole), (mmap.MADV_WILLNEED, whole[1], later[1]),
                       (mmap.MADV_WILLNEED, *first)]
    advised.clear()
    file.release(tensor, (1, tensor.rows - 1))
    inside = file._pages(tensor, (1, tensor.rows - 1), inside=True)
    assert advised == [(MADV_COLD, *inside), (mmap.MADV_DONTNEED, *inside)]
    assert inside[0] % PAGE_SIZE == 0 and inside[1] % PAGE_SIZE == 0


def test_a_tensor_held_as_the_model_holds_it_is_viewed_in_the_mapped_file(tied_dir, tmp_path, tiny_tokenizer):
    """v, o, gate, up, down and the table: views of the file's bytes; q and k (rows reordered) and a quantized
    tensor: None, for read_into to copy."""
    from llmaccel.model.loader import load_checkpoint

    weights = load_checkpoint(str(_write(tied_dir, tmp_path, Q.BF16, tiny_tokenizer))).weights
    for part in ("self_attn.v_proj", "self_attn.o_proj", "mlp.down_proj", "mlp.gate_proj"):
        name = f"model.layers.0.{part}.weight"
        view = weights.mapped(name)
        assert view.data_ptr() == weights.tensor(name).data.ctypes.data and torch.equal(view, weights[name])
    assert weights.mapped("model.embed_tokens.weight") is not None
    assert weights.mapped("model.layers.0.self_attn.q_proj.weight") is None
    assert weights.mapped("model.layers.0.self_attn.k_proj.weight") is None
    quantized = load_checkpoint(str(_write(tied_dir, tmp_path, Q.Q8_0, tiny_tokenizer))).weights
    assert quantized.mapped("model.layers.0.self_attn.o_proj.weight") is None
