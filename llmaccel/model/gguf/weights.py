"""A GGUF file's tensors as the model's weights, by HF name, read from the mapped file one at a time.

Three views of the same tensors, each built on demand so that loading holds one tensor's temporaries at a time:
- `weights[name]`: a dense tensor. F32 / F16 / BF16 tensors are copies of the mapped file's; a quantized
  tensor is dequantized to float32 here (the `--quantization none` path, and 1-D tensors). `read_into` writes
  one into a given tensor instead (a bf16 model's projections, read straight into their place).
- `packed()`: the quantized matrices repacked into llmaccel's kernel layouts (ops' PackedWeight: Q8_0 -> INT8
  blocks, Q4_0 / Q4_1 -> INT4 blocks, Q4_K / Q5_K / Q6_K -> K-quant blocks), every weight exactly the file's:
  the `--quantization gguf` path. Where the CPU kernels are missing (CUDA, no compiler) Q8_0, Q4_0, Q4_1 and Q4_K
  come as Int8Weight / Int4Weight for torch's kernels, and Q5_K / Q6_K are dequantized.
- `tables`: embedding lookups straight from the file's rows (`GGUFRows`), dequantized a row at a time.
q and k rows come back in HF's order (llama.cpp's converter interleaves them). A tensor type outside those
nine is an UnsupportedModelError naming it, never a silent float copy.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import numpy as np
import torch
from torch import nn

from llmaccel.errors import UnsupportedModelError
from llmaccel.model.gguf import quants
from llmaccel.model.gguf.names import hf_tensor_name, row_order
from llmaccel.model.gguf.reader import GGUFFile, GGUFTensor
from llmaccel.model.weight_arena import LoadArena
from llmaccel.quantization.formats import Int4Weight, Int8Weight, PackedWeight, pack_int4

_TORCH_DENSE = {quants.F32: torch.float32, quants.F16: torch.float16, quants.BF16: torch.bfloat16}
READ_ROWS = 1024  # rows `read_into` reads (and dequantizes) at once
# Bytes of the file asked of the disk past the slice being copied: the 8B BF16 shape's 14.7 GB read cold in 26.8 s
# with the next slice alone asked for (8 MB), 18.6-19.9 s with 64-256 MB past it, near this disk's ~1 GB/s
PREFETCH_BYTES = 64 << 20
REPACK_ROWS = 4096  # rows repacked at once (a multiple of the kernels' 16-row groups and of any head's rows)


def check_supported(tensor: GGUFTensor, path: object) -> None:
    if tensor.tensor_type not in quants.BLOCKS:
        supported = ", ".join(quants.NAMES.values())
        raise UnsupportedModelError(f"{path}: tensor {tensor.name} is {tensor.type_name}, a GGUF tensor type llmaccel "
                                    f"does not read (it reads {supported}); requantize the file with llama.cpp's "
                                    "llama-quantize to one of them (Q4_K_M is the usual choice)")


def _raw_rows(tensor: GGUFTensor) -> torch.Tensor:
    """The tensor's bytes as uint8 [rows, row bytes], a view of the mapped file."""
    return torch.from_numpy(tensor.data).view(tensor.rows, -1)


def _dense_rows(tensor: GGUFTensor) -> torch.Tensor:
    """An F32 / F16 / BF16 tensor as its torch dtype [rows, inputs], a view of the mapped file."""
    return torch.from_numpy(tensor.data).view(_TORCH_DENSE[tensor.tensor_type]).view(tensor.rows, -1)


def _file_rows(order: np.ndarray | None, first: int, rows: int, count: int | None = None) -> tuple[int, int]:
    """The file's rows [start, end) that rows `first` .. `first` + `count` (READ_ROWS) of a tensor of `rows` come
    from (`order`: the file row of each, where they are reordered); none past the last."""
    count = READ_ROWS if count is None else count
    if first >= rows:
        return rows, rows
    if order is None:
        return first, min(first + count, rows)
    taken = order[first:first + count]
    return int(taken.min()), int(taken.max()) + 1


class GGUFWeights(Mapping[str, torch.Tensor]):
    """Dense tensors by HF name (see the module docstring); `packed` and `tables` give the other two views."""

    def __init__(self, file: GGUFFile, config: dict) -> None:
        self.file, self.config = file, config
        self._by_name: dict[str, GGUFTensor] = {}
        for tensor in file.tensors.values():
            name = hf_tensor_name(tensor.name)
            if name is not None:
                check_supported(tensor, file.path)
                self._by_name[name] = tensor

    def packed(self, cpu_kernels: bool = True) -> PackedTensors:
        """The quantized matrices for llmaccel's CPU kernels (`cpu_kernels`, where they are built) or torch's."""
        return PackedTensors(self, cpu_kernels)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(self._by_name[name].shape))

    def tensor(self, name: str) -> GGUFTensor:
        return self._by_name[name]

    def order(self, name: str) -> np.ndarray | None:
        tensor = self._by_name[name]
        return row_order(tensor.name, tensor.rows, self.config)

    def __getitem__(self, name: str) -> torch.Tensor:
        tensor = self._by_name[name]
        shape = tuple(int(d) for d in reversed(tensor.shape))
        if tensor.tensor_type in _TORCH_DENSE:  # a copy: nothing the model keeps holds the mapping
            values = torch.from_numpy(tensor.data).view(_TORCH_DENSE[tensor.tensor_type]).view(shape).clone()
        else:
            values = quants.dequantize(_raw_rows(tensor), tensor.tensor_type, int(tensor.shape[0])).view(shape)
        order = self.order(name)
        self.file.release(tensor)
        return values if order is None else values[torch.from_numpy(order)]

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """`self[name]` written into `out` (its shape, any float dtype) straight from the mapped file, READ_ROWS
        rows at a time: no clone, and a quantized tensor's float32 rows never all at once (a 1B shape's Q6_K
        table dequantized whole made ~1 GB of temporaries beside the model)."""
        tensor = self._by_name[name]
        rows, k = tensor.rows, int(tensor.shape[0])
        order = self.order(name)
        source = _dense_rows(tensor) if tensor.tensor_type in _TORCH_DENSE else _raw_rows(tensor)
        self.file.prefetch(tensor, _file_rows(order, 0, rows), PREFETCH_BYTES)
        for start in range(0, rows, READ_ROWS):
            stop = min(start + READ_ROWS, rows)
            # the next slice and the file's bytes past it (the tensors read next) come from disk while this is copied
            self.file.prefetch(tensor, _file_rows(order, stop, rows), PREFETCH_BYTES)
            taken = np.arange(start, stop) if order is None else order[start:stop]
            part = source[start:stop] if order is None else source[torch.from_numpy(taken)]
            if tensor.tensor_type not in _TORCH_DENSE:
                part = quants.dequantize(part, tensor.tensor_type, k).view(stop - start, k)
            out[start:stop].copy_(part)
            self.file.release(tensor, (int(taken.min()), int(taken.max()) + 1))

    def mapped(self, name: str) -> torch.Tensor | None:
        """The named tensor as a view of the mapped file, where the file holds it as the model does (a float type,
        rows in HF's order), its pages asked of the disk now: a packer reads it straight from the page cache, with
        no copy in between (`done` then releases it). None where it must be reordered or dequantized (read_into)."""
        tensor = self._by_name[name]
        if tensor.tensor_type not in _TORCH_DENSE or self.order(name) is not None:
            return None
        self.file.prefetch(tensor, (0, tensor.rows), PREFETCH_BYTES)
        return _dense_rows(tensor)

    def done(self, name: str) -> None:
        """The named tensor will not be read again at this load: its mapped pages leave this process."""
        self.file.release(self._by_name[name])

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def __contains__(self, name: object) -> bool:  # Mapping's own would read (and dequantize) the tensor
        return name in self._by_name

    def is_quantized(self, name: str) -> bool:
        return name in self._by_name and self._by_name[name].tensor_type not in quants.DENSE

    def table(self, name: str) -> nn.Module | None:
        """An embedding lookup on the file's own rows for a quantized table, or None for a dense one."""
        if not self.is_quantized(name):
            return None
        return GGUFRows(self._by_name[name])


class PackedTensors(Mapping[str, object]):
    """The quantized matrices by HF name, each repacked for llmaccel's kernels when asked for (see the module
    docstring): PackedWeight where the CPU kernels run, else Int8Weight / Int4Weight, or None for a K-quant
    (which the caller then takes dense)."""

    def __init__(self, weights: GGUFWeights, cpu_kernels: bool = True) -> None:
        self.weights, self.cpu_kernels = weights, cpu_kernels
        self._arena: LoadArena | None = None

    def _names(self) -> list[str]:
        return [n for n in self.weights if self.weights.is_quantized(n) and self.weights.tensor(n).rows > 1]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())

    def __len__(self) -> int:
        return len(self._names())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.weights.is_quantized(name) and self.weights.tensor(name).rows > 1

    def __getitem__(self, name: str) -> PackedWeight | Int8Weight | Int4Weight | None:
        if name not in self:
            raise KeyError(name)
        tensor = self.weights.tensor(name)
        k, n = int(tensor.shape[0]), tensor.rows
        order = self.weights.order(name)
        rows = torch.arange(n) if order is None else torch.from_numpy(order)
        kernels = _kernels() if self.cpu_kernels else None
        if kernels is not None:
            place, raw = self._place(name), _raw_rows(tensor)
            blocks = place if place is not None else torch.empty(self._packed_shape(name), dtype=torch.uint8)
            self.weights.file.prefetch(tensor, _file_rows(order, 0, n, REPACK_ROWS), PREFETCH_BYTES)
            for start in range(0, n, REPACK_ROWS):  # a slice at a time, its file pages handed back as it is done
                self.weights.file.prefetch(tensor, _file_rows(order, start + REPACK_ROWS, n, REPACK_ROWS),
                                           PREFETCH_BYTES)  # what comes next, from disk while this is repacked
                taken = rows[start:start + REPACK_ROWS]
                kernels.gguf_repack(raw, tensor.tensor_type, taken, k,
                                    blocks[start // 16:-(-(start + len(taken)) // 16)])
                self.weights.file.release(tensor, (int(taken.min()), int(taken.max()) + 1))
            layout = {quants.Q8_0: "int8", quants.Q4_0: "int4", quants.Q4_1: "int4"}.get(
                tensor.tensor_type, quants.NAMES[tensor.tensor_type].lower())
            return PackedWeight(layout, blocks, n, k)
        return _torch_format(tensor, rows, k)

    def _packed_shape(self, name: str) -> tuple[int, int, int]:
        tensor = self.weights.tensor(name)
        return packed_shape(tensor.tensor_type, tensor.rows, int(tensor.shape[0]))

    def _place(self, name: str) -> torch.Tensor | None:
        """Where the named matrix's repacked blocks go: the next bytes of one mapping sized for all of them, in the
        order the model asks (so a fused projection's parts lie back to back), or None (a new tensor) once spent."""
        if self._arena is None:
            align = LoadArena.ALIGN
            self._arena = LoadArena(sum(-(-math.prod(self._packed_shape(n)) // align) * align for n in self))
        return self._arena.take(self._packed_shape(name))


# bytes per 16-row group of the kernels' blocks for one unit of inputs (32, or a 256-input super-block):
# ops/csrc gemv.cpp's INT8 block (weights + 128, 16 float32 scales), gemv_int4.cpp's INT4 block, kquant.cpp's records
_PACKED_UNIT_BYTES = {quants.Q8_0: 544, quants.Q4_0: 320, quants.Q4_1: 320, quants.Q4_K: 2368, quants.Q5_K: 2880,
                      quants.Q6_K: 3360}


def packed_shape(tensor_type: int, rows: int, k: int) -> tuple[int, int, int]:
    """The shape of gguf_repack's blocks for a [rows, k] matrix of this type."""
    unit = quants.BLOCKS[tensor_type][0]
    return -(-rows // 16), k // unit, _PACKED_UNIT_BYTES[tensor_type]


def _kernels():
    from llmaccel.ops.gemv import gemv_kernels

    kernels = gemv_kernels()
    return kernels if kernels is not None and hasattr(kernels, "gguf_repack") else None


def _torch_format(tensor: GGUFTensor, rows: torch.Tensor, k: int) -> Int8Weight | Int4Weight | None:
    """Q8_0 / Q4_0 / Q4_1 / Q4_K as the formats torch's kernels take (no llmaccel kernels here), every code the
    file's; None for Q5_K and Q6_K, which the caller takes dense. Int4Weight's w = (q - 8) scale + zero holds a
    Q4_K sub-block (w = d sc q - dmin m) as a group of 32: scale d sc, zero 8 d sc - dmin m."""
    kind = tensor.tensor_type
    if kind not in (quants.Q8_0, quants.Q4_0, quants.Q4_1, quants.Q4_K):
        return None
    raw = _raw_rows(tensor)[rows]
    blocks = raw.reshape(-1, quants.BLOCKS[kind][1])
    groups = (len(rows), k // 32)
    d = blocks[:, 0:2].contiguous().view(torch.float16).float()
    if kind == quants.Q4_K:
        sc, mins = quants.k_scales(blocks[:, 4:16])
        scale = d * sc.float()
        zero = 8 * scale - blocks[:, 2:4].contiguous().view(torch.float16).float() * mins.float()
        codes = quants.k_codes(blocks, kind).reshape(len(rows), k)
        return Int4Weight(pack_int4(codes), scale.view(groups), zero.view(groups), 32)
    d = d.view(groups)
    if kind == quants.Q8_0:
        return Int8Weight(blocks[:, 2:].contiguous().view(torch.int8).view(len(rows), k), d, 32)
    nibbles = blocks[:, -16:]
    q = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=1).view(len(rows), k)
    if kind == quants.Q4_1:  # w = d q + m = (q - 8) d + (m + 8 d)
        zero = blocks[:, 2:4].contiguous().view(torch.float16).float().view(groups) + 8 * d
    else:
        zero = torch.zeros_like(d)
    return Int4Weight(pack_int4(q), d, zero, 32)


class GGUFRows(nn.Module):
    """An embedding table held as the file's own quantized rows: a lookup dequantizes the rows it reads
    (float32), so the table costs its file bytes, mapped, and nothing more."""

    def __init__(self, tensor: GGUFTensor) -> None:
        super().__init__()
        self.raw = _raw_rows(tensor)
        self.tensor_type, self.in_features = tensor.tensor_type, int(tensor.shape[0])
        self.out_features = tensor.rows

    @property
    def weight_bytes(self) -> int:
        return self.raw.numel()

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.out_features):
            raise IndexError(f"token id outside the embedding's {self.out_features} rows")
        flat = ids.reshape(-1).cpu()  # the file's rows stay in host memory whatever device computes
        values = quants.dequantize(self.raw[flat], self.tensor_type, self.in_features).view(*ids.shape, -1)
        return values.to(ids.device)
