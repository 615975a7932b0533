"""`llmaccel bench make-model`: a checkpoint of random weights at a published shape (model/shapes.py), as an HF
directory or a GGUF file, for speed and memory benchmarks at 1-8B. Never for quality.

Each tensor is drawn from its own seeded generator (the seed and the tensor's name), so every format of a shape
holds the same model, and written as it is drawn, a slice of rows at a time: no more than one tensor is ever in
memory in float32. GGUF files carry the default model's tokenizer metadata as llama.cpp wrote it (the same
tokens, merges and chat template). F16 and BF16 files are written here; Q8_0, Q4_0, Q4_K_M, Q5_K_M and Q6_K are
llama.cpp's own presets, made by its `llama-quantize` from the BF16 file (tools/peers.sh builds it; or
--llama-quantize PATH), so the file is the one a llama.cpp user has. Without llama-quantize, Q8_0, Q4_0 and
Q6_K are written here with every matrix in that type (llama.cpp keeps the head of a Q4_0 file in Q6_K), and the
K_M mixtures are an error.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import struct
import subprocess
import zlib
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from llmaccel.model.gguf import quants
from llmaccel.model.shapes import SHAPES, ModelShape, shape_named

logger = logging.getLogger(__name__)
FORMATS = ("hf", "gguf:F16", "gguf:BF16", "gguf:Q8_0", "gguf:Q4_0", "gguf:Q4_K_M", "gguf:Q5_K_M", "gguf:Q6_K")
_WRITTEN_HERE = {"F16": quants.F16, "BF16": quants.BF16}
_OWN_FALLBACK = {"Q8_0": quants.Q8_0, "Q4_0": quants.Q4_0, "Q6_K": quants.Q6_K}
_ROWS_A_SLICE = 1024
STD = 0.02  # the weights' standard deviation (HF's initializer range): finite activations through any depth


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shape", required=True, choices=sorted(SHAPES),
                        help="the published model whose shapes to copy (model/shapes.py)")
    parser.add_argument("--format", default="hf", choices=FORMATS,
                        help="hf: a directory of bfloat16 safetensors; gguf:TYPE: a GGUF file of llama.cpp's TYPE")
    parser.add_argument("--output", type=Path, required=True,
                        help="directory to write into (an HF directory, or the GGUF file <shape>-<TYPE>.gguf in it)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (every format agrees)")
    parser.add_argument("--llama-quantize", type=Path, default=None,
                        help="llama.cpp's llama-quantize binary for the quantized presets (default: the one "
                             "tools/peers.sh builds under $PEERS_DIR, if any)")


def run(args: argparse.Namespace) -> int:
    out = make_model(shape_named(args.shape), args.format, args.output, args.seed, args.llama_quantize)
    print(out)
    return 0


def make_model(shape: ModelShape, fmt: str, output: Path, seed: int = 0, llama_quantize: Path | None = None,
               tokenizer_from: Path | None = None) -> Path:
    """Write the checkpoint; returns its path (the HF directory or the GGUF file). An existing one is kept.
    An HF directory takes its tokenizer and chat template from `tokenizer_from` (default: the default model's)."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; choose one of {', '.join(FORMATS)}")
    output.mkdir(parents=True, exist_ok=True)
    if fmt == "hf":
        return _write_hf(shape, output, seed, tokenizer_from)
    kind = fmt.split(":", 1)[1]
    path = output / f"{shape.name}-{kind}.gguf"
    if path.exists():
        return path
    if kind in _WRITTEN_HERE:
        return _write_gguf(shape, path, _WRITTEN_HERE[kind], seed)
    binary = llama_quantize or _found_llama_quantize()
    if binary is None:
        if kind not in _OWN_FALLBACK:
            raise ValueError(f"gguf:{kind} is llama.cpp's mixture of types, made by its llama-quantize, which is not "
                             "built here: run tools/peers.sh (it builds llama.cpp) or pass --llama-quantize PATH")
        logger.warning("llama-quantize not found: writing every matrix of %s as %s", path.name, kind)
        return _write_gguf(shape, path, _OWN_FALLBACK[kind], seed)
    source = make_model(shape, "gguf:BF16", output, seed)
    tmp = path.with_suffix(".tmp")
    logger.info("quantizing %s to %s with %s", source.name, kind, binary)
    done = subprocess.run([str(binary), str(source), str(tmp), kind, str(os.cpu_count() or 1)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama-quantize failed on {source}: {done.stderr[-2000:]}")
    tmp.rename(path)
    return path


def _found_llama_quantize() -> Path | None:
    peers = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "llmaccel" / "peers"))
    found = sorted(peers.glob("llama_cpp_python-*/vendor/llama.cpp/build/bin/llama-quantize"))
    return found[-1] if found else (Path(p) if (p := shutil.which("llama-quantize")) else None)


# ---- the tensors ---------------------------------------------------------------------------------------------

def tensor_shapes(shape: ModelShape) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor, in the order checkpoints list them."""
    h, q, kv = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
    yield "model.embed_tokens.weight", (shape.vocab_size, h)
    for i in range(shape.num_layers):
        p = f"model.layers.{i}."
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield p + f"self_attn.{proj}.weight", (rows, h)
            if shape.qkv_bias:
                yield p + f"self_attn.{proj}.bias", (rows,)
        yield p + "self_attn.o_proj.weight", (h, q)
        yield p + "mlp.gate_proj.weight", (shape.intermediate_size, h)
        yield p + "mlp.up_proj.weight", (shape.intermediate_size, h)
        yield p + "mlp.down_proj.weight", (h, shape.intermediate_size)
        yield p + "input_layernorm.weight", (h,)
        yield p + "post_attention_layernorm.weight", (h,)
    yield "model.norm.weight", (h,)
    if not shape.tie_word_embeddings:
        yield "lm_head.weight", (shape.vocab_size, h)


def tensor_slices(name: str, dims: tuple[int, ...], seed: int, rows: int = _ROWS_A_SLICE) -> Iterator[torch.Tensor]:
    """The named tensor's float32 values, `rows` rows at a time: norms 1, everything else N(0, STD^2) from a
    generator seeded by `seed` and the name."""
    if len(dims) == 1 and name.endswith("norm.weight"):
        yield torch.ones(dims)
        return
    generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    total = dims[0]
    for start in range(0, total, rows):
        yield torch.randn((min(rows, total - start), *dims[1:]), generator=generator) * STD


def _full(name: str, dims: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.cat(list(tensor_slices(name, dims, seed)))


# ---- HF directory --------------------------------------------------------------------------------------------

def _write_hf(shape: ModelShape, output: Path, seed: int, tokenizer_from: Path | None = None) -> Path:
    if (output / "llmaccel-complete").exists():
        return output
    tensors = list(tensor_shapes(shape))
    header: dict[str, object] = {"__metadata__": {"format": "pt", "llmaccel": f"random weights, shape {shape.name}"}}
    offset = 0
    for name, dims in tensors:
        nbytes = math.prod(dims) * 2
        header[name] = {"dtype": "BF16", "shape": list(dims), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(output / "model.safetensors", "wb") as f, _bar(offset, f"{shape.name} hf") as bar:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for name, dims in tensors:
            for part in tensor_slices(name, dims, seed):
                data = part.to(torch.bfloat16).contiguous().view(torch.uint8).numpy().tobytes()
                f.write(data)
                bar.update(len(data))
    (output / "config.json").write_text(json.dumps(shape.hf_config(), indent=2))
    files = tokenizer_from or _default_model_files()
    for item in files.iterdir():
        if item.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(item, output / item.name)
    spec = json.loads((files / "config.json").read_text())
    (output / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": spec.get("bos_token_id"), "eos_token_id": spec.get("eos_token_id")}))
    (output / "llmaccel-complete").write_text(f"random weights, shape {shape.name}, seed {seed}\n")
    return output


def _default_model_files() -> Path:
    from llmaccel.config import DEFAULT_MODEL
    from llmaccel.model.loader import model_files_dir

    return model_files_dir(DEFAULT_MODEL)


def _bar(total: int, what: str):
    return tqdm(total=total, unit="B", unit_scale=True, desc=f"writing {what}")


# ---- GGUF file -----------------------------------------------------------------------------------------------

def _gguf_type(name: str, dims: tuple[int, ...], matrices: int) -> int:
    return matrices if len(dims) == 2 else quants.F32


def _encode(values: torch.Tensor, tensor_type: int) -> np.ndarray:
    if tensor_type == quants.F32:
        return values.float().numpy()
    if tensor_type == quants.F16:
        return values.half().numpy()
    if tensor_type == quants.BF16:
        return values.to(torch.bfloat16).view(torch.int16).numpy()
    if tensor_type in (quants.Q4_K, quants.Q5_K, quants.Q6_K):
        return quants.quantize_k(values.numpy(), tensor_type)
    import gguf

    return gguf.quants.quantize(values.numpy(), gguf.GGMLQuantizationType(tensor_type))


def llama3_rope_factors(shape: ModelShape) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3's rope scaling (its converter's formula)."""
    scaling, dim = shape.rope_scaling, shape.head_dim
    freqs = 1.0 / (shape.rope_theta ** (np.arange(0, dim, 2, dtype=np.float32) / dim))
    old = scaling["original_max_position_embeddings"]
    low, high, factor = scaling["low_freq_factor"], scaling["high_freq_factor"], scaling["factor"]
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def _write_gguf(shape: ModelShape, path: Path, matrices: int, seed: int) -> Path:
    import gguf

    from llmaccel.model.gguf.names import gguf_tensor_name, permutation

    arch = "qwen2" if shape.architecture == "Qwen2ForCausalLM" else "llama"
    writer = gguf.GGUFWriter(str(path.with_suffix(".tmp")), arch)
    writer.add_name(f"random {shape.name}")
    writer.add_block_count(shape.num_layers)
    writer.add_context_length(shape.max_position_embeddings)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(shape.vocab_size)
    writer.add_file_type({quants.F16: 1, quants.BF16: 32, quants.Q8_0: 7, quants.Q4_0: 2, quants.Q6_K: 18}[matrices])
    _copy_tokenizer_metadata(writer)
    plan = []  # (gguf name, dims, type, HF name or None for rope_freqs)
    if arch == "llama" and shape.rope_scaling and shape.rope_scaling.get("rope_type") == "llama3":
        plan.append(("rope_freqs.weight", (shape.head_dim // 2,), quants.F32, None))
    for name, dims in tensor_shapes(shape):
        plan.append((gguf_tensor_name(name), dims, _gguf_type(name, dims, matrices), name))
    total = 0
    for gguf_name, dims, tensor_type, _ in plan:
        block, nbytes = quants.BLOCKS[tensor_type]
        size = math.prod(dims) // block * nbytes
        # (a dtype other than uint8: `dims` are then read as the tensor's elements, not its bytes)
        writer.add_tensor_info(gguf_name, dims, np.dtype(np.float32), size,
                               raw_dtype=gguf.GGMLQuantizationType(tensor_type))
        total += size
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    fout = writer.fout[0]
    with _bar(total, path.name) as bar:
        for gguf_name, dims, tensor_type, name in plan:
            writer.write_padding(fout, fout.tell())
            if name is None:
                parts = [torch.from_numpy(llama3_rope_factors(shape))]
            else:
                order = (permutation(gguf_name, dims[0], shape.num_heads, shape.num_kv_heads)
                         if arch == "llama" else None)
                parts = [_full(name, dims, seed)[order]] if order is not None else tensor_slices(name, dims, seed)
            written = 0
            for part in parts:
                data = _encode(part, tensor_type)
                data.tofile(fout)
                written += data.nbytes
                bar.update(data.nbytes)
            writer.write_padding(fout, written)
    writer.close()
    path.with_suffix(".tmp").rename(path)
    return path


def _copy_tokenizer_metadata(writer) -> None:
    """The default model's tokenizer.* keys, as llama.cpp's converter wrote them."""
    import gguf

    from llmaccel.config import DEFAULT_MODEL
    from llmaccel.model.loader import resolve_model_path

    reader = gguf.GGUFReader(str(resolve_model_path(DEFAULT_MODEL)))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        types = [gguf.GGUFValueType(t) for t in field.types]
        value = field.contents()
        if types[0] == gguf.GGUFValueType.ARRAY:
            writer.add_key_value(key, value, types[0], sub_type=types[-1])
        else:
            writer.add_key_value(key, value, types[0])
