"""The tensor table of a GGUF file, read past its metadata values.

gguf.GGUFReader parses every metadata value into numpy views: for the default model's tokenizer
(49,152 tokens and as many merges) that is a million small arrays, 3-6 s of every start with
`--quantization gguf`. The tensors need only the tensor infos, so this walks past each value (a type,
a length, a skip) and maps the data. Layout (GGUF v2/v3, little-endian): magic, version, tensor
count, key-value count; the key-values; per tensor its name, dimensions (innermost first), type and
offset; the data from the next multiple of `general.alignment` (32 unless set).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np

_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUFValueType -> bytes
_STRING, _ARRAY, _UINT32 = 8, 9, 4


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    tensor_type: int  # a gguf.GGMLQuantizationType value
    data: np.ndarray  # its bytes (uint8), a view of the mapped file


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.pos = memoryview(buffer), 0

    def take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        self.pos += length
        return bytes(self.buffer[self.pos - length:self.pos]).decode("utf-8")

    def skip_value(self, value_type: int) -> None:
        if value_type == _STRING:
            length = self.take("<Q")  # read first: `self.pos += self.take(...)` would add to the old position
            self.pos += length
        elif value_type == _ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _SCALAR_BYTES:
                self.pos += count * _SCALAR_BYTES[item_type]
            else:
                for _ in range(count):
                    self.skip_value(item_type)
        elif value_type in _SCALAR_BYTES:
            self.pos += _SCALAR_BYTES[value_type]
        else:
            raise ValueError(f"unknown GGUF value type {value_type} at byte {self.pos}")


def read_tensors(path: Path) -> list[GGUFTensor]:
    """Every tensor of the GGUF file at `path`. Raises ValueError for what is not a little-endian GGUF
    v2/v3 file or does not fit its own sizes."""
    from gguf import GGML_QUANT_SIZES  # (elements a block, bytes a block) per tensor type

    buffer = np.memmap(path, dtype=np.uint8, mode="r")
    cursor = _Cursor(buffer)
    try:
        if bytes(cursor.buffer[:4]) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        cursor.pos = 4
        version = cursor.take("<I")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} (a big-endian file reads as a huge one); 2 and 3 "
                             "are read")
        num_tensors, num_values = cursor.take("<Q"), cursor.take("<Q")
        alignment = 32
        for _ in range(num_values):
            key, value_type = cursor.string(), cursor.take("<I")
            if key == "general.alignment" and value_type == _UINT32:
                alignment = cursor.take("<I")
            else:
                cursor.skip_value(value_type)
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            shape = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
            infos.append((name, shape, cursor.take("<I"), cursor.take("<Q")))
    except struct.error as exc:
        raise ValueError(f"{path}: the GGUF header ends early ({exc})") from None
    start = -(-cursor.pos // alignment) * alignment
    tensors = []
    for name, shape, tensor_type, offset in infos:
        if tensor_type not in GGML_QUANT_SIZES:
            raise ValueError(f"{path}: tensor {name} has the unknown type {tensor_type}")
        block, block_bytes = GGML_QUANT_SIZES[tensor_type]
        nbytes = int(np.prod(shape)) // block * block_bytes
        if start + offset + nbytes > len(buffer):
            raise ValueError(f"{path}: tensor {name} runs past the end of the file")
        tensors.append(GGUFTensor(name, shape, tensor_type, buffer[start + offset:start + offset + nbytes]))
    return tensors
