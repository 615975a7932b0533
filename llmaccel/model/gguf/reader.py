"""A GGUF file's metadata and tensor table, the tensors memory-mapped, never copied.

gguf.GGUFReader parses every metadata value into numpy views: for a tokenizer of 49,152 tokens and as many
merges that is a million small arrays, 3-6 s of every start. The engine needs the scalar values (the
architecture's numbers) and the tensor infos, so this reads scalars and strings and walks past arrays (a type,
a count, a skip), keeping only their length. Layout (GGUF v2/v3, little-endian): magic, version, tensor
count, key-value count; the key-values; per tensor its name, dimensions (innermost first), type and offset;
the data from the next multiple of `general.alignment` (32 unless set).
"""

from __future__ import annotations

import contextlib
import mmap
import struct
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from llmaccel.errors import CorruptCheckpointError

# GGUFValueType -> struct format of a scalar
MADV_COLD = 20  # Linux 5.4+ (Python's mmap module does not name it)
PAGE_SIZE = mmap.PAGESIZE
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class ArrayValue:
    """A metadata array, not read: its element type and length (the tokenizer's tokens, merges, ...)."""

    item_type: int
    count: int


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # innermost dimension first, as GGUF lists them
    tensor_type: int  # a gguf.GGMLQuantizationType value
    data: np.ndarray  # its bytes (uint8), a view of the mapped file

    @property
    def rows(self) -> int:
        """Rows of the matrix as torch sees it ([rows, shape[0]]): every dimension but the innermost."""
        return int(np.prod(self.shape[1:], dtype=np.int64)) if len(self.shape) > 1 else 1

    @property
    def type_name(self) -> str:
        from gguf import GGMLQuantizationType

        return GGMLQuantizationType(self.tensor_type).name


class _Cursor:
    def __init__(self, buffer: np.ndarray) -> None:
        self.buffer, self.pos = memoryview(buffer), 0

    def take(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        self.pos += length
        return bytes(self.buffer[self.pos - length:self.pos]).decode("utf-8")

    def value(self, value_type: int):
        """A scalar or string value; an array is skipped and comes back as its ArrayValue."""
        if value_type == _STRING:
            return self.string()
        if value_type in _SCALARS:
            return self.take(_SCALARS[value_type])
        if value_type == _ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type in _SCALARS:
                self.pos += count * struct.calcsize(_SCALARS[item_type])
            elif item_type == _STRING:
                for _ in range(count):
                    length = self.take("<Q")  # read first: `self.pos += self.take(...)` adds to the old position
                    self.pos += length
            else:
                for _ in range(count):
                    self.value(item_type)
            return ArrayValue(item_type, count)
        raise ValueError(f"unknown GGUF value type {value_type} at byte {self.pos}")


class GGUFFile:
    """The file at `path`, memory-mapped. Raises CorruptCheckpointError (a ValueError) for what is not a
    little-endian GGUF v2/v3 file or does not fit its own sizes."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._asked = (0, 0)  # the bytes the last prefetch asked the disk for
        try:
            # copy-on-write: pages are shared with the page cache, and torch may view them without a copy
            self.buffer = np.memmap(self.path, dtype=np.uint8, mode="c")
        except (OSError, ValueError) as exc:
            raise CorruptCheckpointError(f"{path}: cannot map the file ({exc})") from exc
        cursor = _Cursor(self.buffer)
        try:
            if bytes(cursor.buffer[:4]) != b"GGUF":
                raise CorruptCheckpointError(f"{path} is not a GGUF file")
            cursor.pos = 4
            version = cursor.take("<I")
            if version not in (2, 3):
                raise CorruptCheckpointError(f"{path}: GGUF version {version} (a big-endian file reads as a huge "
                                             "one); versions 2 and 3 are read")
            num_tensors, num_values = cursor.take("<Q"), cursor.take("<Q")
            self.metadata: dict[str, object] = {}
            for _ in range(num_values):
                key = cursor.string()
                self.metadata[key] = cursor.value(cursor.take("<I"))
            infos = []
            for _ in range(num_tensors):
                name = cursor.string()
                shape = tuple(cursor.take("<Q") for _ in range(cursor.take("<I")))
                infos.append((name, shape, cursor.take("<I"), cursor.take("<Q")))
        except (struct.error, UnicodeDecodeError, ValueError) as exc:
            if isinstance(exc, CorruptCheckpointError):
                raise
            raise CorruptCheckpointError(f"{path}: the GGUF header is unreadable or ends early ({exc})") from None
        self.header_bytes = cursor.pos
        alignment = self.metadata.get("general.alignment", 32)
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: dict[str, GGUFTensor] = {}
        for name, shape, tensor_type, offset in infos:
            nbytes = tensor_nbytes(shape, tensor_type, f"{path}: tensor {name}")
            if start + offset + nbytes > len(self.buffer):
                raise CorruptCheckpointError(f"{path}: tensor {name} runs past the end of the file (truncated?)")
            data = self.buffer[start + offset:start + offset + nbytes]
            self.tensors[name] = GGUFTensor(name, shape, tensor_type, data)

    def release(self, tensor: GGUFTensor | None = None, rows: tuple[int, int] | None = None) -> None:
        """Hands the mapped pages of `tensor` (its `rows` [first, end) only, where given; or of the whole file) back
        to the page cache: a tensor read once at load (repacked, or copied) then costs no resident memory in this
        process, and one read a slice of rows at a time never holds more than a slice; a later read maps it again.
        They are marked the first the kernel may reclaim (MADV_COLD): a file larger than the memory the model leaves
        (an 8B BF16 one on 24 GB) otherwise evicts, as it is read, the cached pages a start has yet to read, and
        every warm start read most of it from disk (ready in 35-40 s; 26-27 s with the pages read marked cold)."""
        pages = self._pages(tensor, rows, inside=True)
        self._advise(MADV_COLD, *pages)
        self._advise(mmap.MADV_DONTNEED, *pages)

    def prefetch(self, tensor: GGUFTensor, rows: tuple[int, int], beyond: int = 0) -> None:
        """Asks the kernel to read `tensor`'s `rows` [first, end), and `beyond` bytes of the file past them (the
        tensors a load reads next), from disk now, while the caller copies what comes before: a copy that faults
        each page in waits on the disk page by page (an 8B BF16 file read cold at 0.62 GB/s; asking for the next
        16 MB before copying each 8 MB, 1.62 GB/s on the same disk). What the call before asked for is not asked
        again (each call's range overlaps the one before it by all but a slice: the kernel looked up 9x the file's
        pages, 1.4 s of an 8B start)."""
        start, end = self._pages(tensor, rows, inside=False, beyond=beyond)
        asked_start, asked_end = self._asked
        if asked_start <= start < asked_end:
            start = asked_end
        if end > start:
            self._advise(mmap.MADV_WILLNEED, start, end)
            self._asked = (min(start, asked_start) if start == asked_end else start, end)

    def _pages(self, tensor: GGUFTensor | None, rows: tuple[int, int] | None, inside: bool,
               beyond: int = 0) -> tuple[int, int]:
        """The mapping's page range [start, end) over `tensor`'s bytes (its `rows` only, where given; the whole file
        for None) and `beyond` bytes past them: the whole pages inside the range (`inside`), or every page it
        touches."""
        base = self.buffer.ctypes.data - self.buffer.offset  # where the mapping starts
        size = len(self.buffer) + self.buffer.offset
        start, end = (0, size) if tensor is None else (
            tensor.data.ctypes.data - base, tensor.data.ctypes.data - base + tensor.data.nbytes)
        if tensor is not None and rows is not None:
            row_bytes = tensor.data.nbytes // tensor.rows
            start, end = start + rows[0] * row_bytes, start + rows[1] * row_bytes
        end += beyond
        page = PAGE_SIZE
        if inside:
            return -(-start // page) * page, end // page * page
        return start // page * page, min(-(-end // page) * page, -(-size // page) * page)

    def _advise(self, advice: int, start: int, end: int) -> None:
        """madvise over the mapping's bytes [start, end), page-aligned (a no-op where the mapping has no madvise)."""
        region = getattr(self.buffer, "_mmap", None)
        if region is None or not hasattr(region, "madvise") or end <= start:
            return
        with contextlib.suppress(OSError):  # an advice this kernel does not know (MADV_COLD before Linux 5.4)
            region.madvise(advice, start, min(end, len(region)) - start)

    def get(self, key: str, default: object = None) -> object:
        value = self.metadata.get(key, default)
        return default if isinstance(value, ArrayValue) else value

    def array_length(self, key: str) -> int | None:
        value = self.metadata.get(key)
        return value.count if isinstance(value, ArrayValue) else None

    @cached_property
    def architecture(self) -> str:
        return str(self.get("general.architecture", ""))

    def header_digest(self) -> str:
        """A hash of the metadata and tensor table with the file's size: what names a file's tokenizer
        and config without reading gigabytes of weights."""
        import hashlib

        h = hashlib.sha256(bytes(self.buffer[:self.header_bytes]))
        h.update(str(len(self.buffer)).encode())
        return h.hexdigest()


def tensor_nbytes(shape: tuple[int, ...], tensor_type: int, what: str) -> int:
    """Bytes of a tensor of this GGML type and shape; an unknown type or a row that is not whole blocks is
    an error naming it."""
    from gguf import GGML_QUANT_SIZES  # (elements a block, bytes a block) per tensor type

    if tensor_type not in GGML_QUANT_SIZES:
        raise CorruptCheckpointError(f"{what} has the unknown GGML type {tensor_type}")
    block, block_bytes = GGML_QUANT_SIZES[tensor_type]
    if shape and shape[0] % block:
        raise CorruptCheckpointError(f"{what}: rows of {shape[0]} elements are not whole blocks of {block}")
    return int(np.prod(shape, dtype=np.int64)) // block * block_bytes
