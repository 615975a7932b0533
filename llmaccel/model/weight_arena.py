"""The decode stack's weights in one run of memory on transparent huge pages, in the order a step reads them.

A lone decode step streams every weight once, and on the CPU that stream is the step. Allocated one
tensor at a time, the weights sit on 4 KiB pages (most machines give huge pages only where asked,
`/sys/kernel/mm/transparent_hugepage/enabled` = madvise, and the layer's projections are each under
the 2 MiB that torch's allocator would ask for), and a read stream pays a page walk every 4 KiB and
loses the hardware prefetcher at every page edge. Measured on a 2-core AMD EPYC: a 512 MB sum read
25-28 GB/s on 4 KiB pages and 33-35 on huge pages. So the decode stack's weights (every layer's four
projections, then the LM head) are copied into one anonymous mapping advised MADV_HUGEPAGE, back to
back in the order a step reads them, and every module takes a view of its part: no second copy, and
the layer-by-layer path reads the same memory. Served, paired against the same build without it: a
lone INT8 request +14%, a 4-bit one +6%, 64 bf16 requests at once +3% (medians of alternating runs).

Where the weights are made at load (a GGUF file's matrices repacked for the kernels, or a bf16 model's dense
projections read from its file: model/causal_lm.WeightLoader), a LoadArena hands out the mapping front to back
as they are made, so they are written once, in place: fused projections are adjacent parts (no concatenation),
and WeightArena finds nothing to copy (8B Q4_K_M: ~6 s less at start). Read into fresh tensors, cloned, reordered
and concatenated, then copied here, a 1B bf16 model's load peaked 40% above its weights.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import weakref

import torch
from torch import nn

from llmaccel.platform import huge_page_buffer

_ALIGN = 4096  # each tensor starts on its own page: the kernels' vector loads want at least 64 bytes
_TRIM_EVERY = 16 * 2**20  # copied bytes between handing freed memory back, so old and new never both fill RSS
_PAGE = 4096
_MADV_DONTNEED = 4


def return_freed_memory() -> None:
    """glibc keeps freed heap memory resident (the old weights: ~220 MB of RSS for the default model in
    bf16; a 1B model's load temporaries: ~0.5-1 GB); malloc_trim hands it back to the OS. A no-op where the
    C library has no malloc_trim."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _weight_attribute(module: nn.Module) -> str | None:
    """The name of the tensor a decode step streams from this module, or None if it holds none."""
    for name in ("panels", "blocks", "vnni", "compact", "weight"):
        value = getattr(module, name, None)
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.is_contiguous():
            return name
    return None


_LOAD_ARENAS: weakref.WeakValueDictionary[int, LoadArena] = weakref.WeakValueDictionary()


class LoadArena:
    """One huge-page mapping handed out front to back, 64-byte aligned, to tensors as they are built."""

    ALIGN = 64

    def __init__(self, nbytes: int) -> None:
        self.whole, self.huge_pages = huge_page_buffer(max(nbytes, 1))
        self.used = 0
        _LOAD_ARENAS[self.whole.untyped_storage().data_ptr()] = self

    def take(self, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A uint8 tensor of `shape` from the next free bytes, or None where the mapping is spent."""
        start = -(-self.used // self.ALIGN) * self.ALIGN
        end = start + math.prod(shape)
        if end > self.whole.numel():
            return None
        self.used = end
        return self.whole[start:end].view(shape)

    def rest(self) -> torch.Tensor:
        """The free bytes from the next aligned offset on: for a writer that learns its size as it writes (the
        compact layout's packer), which `claim` then marks as taken."""
        start = min(-(-self.used // self.ALIGN) * self.ALIGN, self.whole.numel())
        return self.whole[start:]

    def claim(self, made: torch.Tensor) -> bool:
        """Marks `made` as taken where it was written at the front of `rest()`; False where it lies elsewhere."""
        rest = self.rest()
        if rest.numel() == 0 or made.data_ptr() != rest.data_ptr() or made.nbytes > rest.numel():
            return False
        self.used = made.data_ptr() - self.whole.data_ptr() + made.nbytes
        return True

    @staticmethod
    def holding(tensors: list[torch.Tensor]) -> LoadArena | None:
        """The load arena every one of these tensors lives in, or None."""
        found = {t.untyped_storage().data_ptr() for t in tensors}
        return _LOAD_ARENAS.get(found.pop()) if len(found) == 1 else None

    @staticmethod
    def give_back(tensor: torch.Tensor) -> None:
        """Where `tensor` lives in a load arena and nothing will read it again (a weight moved into another
        layout), hands the whole pages under it back to the OS: the mapping lives on for its other tensors, so
        without this the old copy would stay resident beside the new one."""
        if LoadArena.holding([tensor]) is None or not tensor.is_contiguous():
            return
        start = -(-tensor.data_ptr() // _PAGE) * _PAGE
        end = (tensor.data_ptr() + tensor.nbytes) // _PAGE * _PAGE
        if end > start:
            with contextlib.suppress(OSError, AttributeError):
                libc = ctypes.CDLL("libc.so.6", use_errno=True)
                libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_DONTNEED)


class WeightArena:
    """Copies the weights into one huge-page mapping, but for those already in a load arena, which stay where they
    are; modules hold views of the mappings, which keep them alive."""

    def __init__(self, modules: list[nn.Module], root: nn.Module) -> None:
        """modules: those whose weights a step streams, in the order it reads them; root: the model,
        every reference in which (a tied embedding table too) is moved to the views."""
        tensors: list[torch.Tensor | None] = []
        for module in modules:
            name = _weight_attribute(module)
            tensor = getattr(module, name) if name else None
            if tensor is not None and not any(tensor is t for t in tensors):  # a tied table is one tensor
                tensors.append(tensor)
        # Those made where they are streamed from (a load arena) stay there; the rest are copied. Copied out too,
        # the placed ones' mapping stayed resident until the last of them was: with its layers in the plain layout
        # and its LM head moved to the compact one, a 1B bf16 model peaked at 4.46 GB (2.61 now) and an 8B one was
        # killed at 24 GB on a 24 GB machine.
        homes = [LoadArena.holding([t]) for t in tensors]
        arenas = {id(a): a for a in homes if a is not None}
        placed = sum(t.nbytes for t, home in zip(tensors, homes, strict=True) if home is not None)
        tensors = [t for t, home in zip(tensors, homes, strict=True) if home is None]
        self.mappings = len(arenas) + (1 if tensors else 0)
        sizes = [-(-t.nbytes // _ALIGN) * _ALIGN for t in tensors]
        self.nbytes = placed + sum(sizes)
        self.huge_pages = all(a.huge_pages for a in arenas.values())
        if not tensors:
            return
        whole, huge_pages = huge_page_buffer(sum(sizes))  # the views keep the mapping alive
        self.huge_pages = self.huge_pages and huge_pages
        offset, unreturned = 0, 0
        for i, size in enumerate(sizes):
            tensor, tensors[i] = tensors[i], None
            view = whole[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor)
            self._rebind(root, {id(tensor): view})  # `tensor` is alive, so its id names it alone
            del tensor  # its last reference: the old copy is freed as the new one fills
            offset, unreturned = offset + size, unreturned + size
            if unreturned >= _TRIM_EVERY:
                return_freed_memory()
                unreturned = 0
        return_freed_memory()

    @staticmethod
    def _rebind(root: nn.Module, replaced: dict[int, torch.Tensor]) -> None:
        """Point every module attribute, parameter and buffer that held an old tensor at its view."""
        for module in root.modules():
            for store in (module._parameters, module._buffers):
                for name, value in store.items():
                    if value is not None and id(value) in replaced:
                        new = replaced[id(value)]
                        store[name] = nn.Parameter(new, requires_grad=False) if isinstance(value, nn.Parameter) else new
            for name, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and id(value) in replaced:
                    setattr(module, name, replaced[id(value)])
