"""KVOffload: the disk tier behind the RAM prefix cache (`--kv-offload-dir`).

Spill instead of forget: a cached block the pool hands out again (its eviction) is copied out of every KV pool
(the target's, and a draft model's) before anything can write it, and the disk store writes it on a thread of its
own. A request whose prefix goes on, on disk, past the blocks RAM holds has those blocks read on the store's
reader thread while it waits in the queue (the requests behind it are admitted meanwhile, as vLLM does for KV
that is still arriving); the next schedule copies them into free blocks and registers them in the prefix cache,
where the request finds them as any cached prefix (kv_cache_manager.py). So a block on disk is used only
through the same chained hash that names it in RAM, and the engine's numerics never see the tier: a restored
block holds the bytes the pool held.

With `write_through` (`--kv-offload-policy write-through`, for replicas sharing a directory) a block is written as
soon as it is computed and cached, so another process finds it while this one still holds it in RAM; a draft
model's KV, caught up lazily, may then be written before it is computed, which costs drafts acceptance, never a
token.

A load starts only where the measured time to read a block is below the measured time to compute one (prefill
tokens per second, from the engine's steps): true of a local disk on a CPU by two orders of magnitude, not
necessarily of a network disk behind a GPU. Until both are measured, blocks are loaded.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from llmaccel.engine.kv_tiers.disk import DiskKVStore

PREFILL_SMOOTHING = 0.2  # weight of the newest step in the prefill-speed average
MAX_LOADING_BYTES = 256 << 20  # blocks read or waiting to go into the pool, at most (one load always may run)


@dataclass
class Load:
    """A read in flight: the blocks `hashes`, from block number `first` of its request."""

    first: int
    hashes: list[bytes]
    future: Future


def weights_fingerprint(path: str | os.PathLike) -> str:
    """Names a checkpoint's files by name, size and modification time: the same path holding other weights after
    a restart gets another namespace."""
    path = Path(path)
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    parts = []
    for file in files:
        info = file.stat()
        parts.append(f"{file.name}:{info.st_size}:{info.st_mtime_ns}")
    return ";".join(parts)


def kv_namespace(variant: str, fingerprints: list[str], slabs: list[torch.Tensor], block_size: int) -> bytes:
    """The digest that names the KV a pool's blocks hold: the engine's variant (model, dtype, quantization, KV
    element type, positions), the weights' files and each pool's layout (all but its number of blocks)."""
    digest = hashlib.sha256(variant.encode())
    for fingerprint in fingerprints:
        digest.update(b"\0" + fingerprint.encode())
    for slab in slabs:
        layers, kinds, _, heads, width = slab.shape
        digest.update(f"\0{slab.dtype}:{layers}x{kinds}x{heads}x{width}:{block_size}".encode())
    return digest.digest()


def open_disk_tier(directory: str, capacity: int, variant: str, model_paths: list[str], slabs: list[torch.Tensor],
                   block_size: int, write_through: bool = False) -> KVOffload:
    """The disk tier for pools `slabs` (the target's, then a draft model's) under `directory`."""
    namespace = kv_namespace(variant, [weights_fingerprint(path) for path in model_paths], slabs, block_size)
    try:
        store = DiskKVStore(directory, namespace, capacity)
    except OSError as exc:
        raise ValueError(f"--kv-offload-dir {directory}: cannot use it for KV blocks ({exc})") from None
    return KVOffload(store, slabs, block_size, write_through)


class KVOffload:
    def __init__(self, store: DiskKVStore, slabs: list[torch.Tensor], block_size: int,
                 write_through: bool = False) -> None:
        self.store = store
        self.write_through = write_through  # write each block once computed, not once evicted (shared directories)
        self.slabs = slabs  # [layers, 2, slots, kv heads, row width] each
        self.block_size = block_size
        self.payload_bytes = sum(slab[:, :, :block_size].numel() * slab.element_size() for slab in slabs)
        self.loads: dict[str, Load] = {}  # request id -> its read in flight or done
        self.prefill_seconds_per_token: float | None = None
        self.restored_blocks = 0  # loaded blocks put back in the pool

    # ---- blocks in and out of the pools -----------------------------------------------------------
    def spill(self, block_id: int, block_hash: bytes) -> None:
        """Write an evicted block (once: a block read back from disk is there already)."""
        if block_hash not in self.store:
            self.store.store(block_hash, self.read_block(block_id))

    def read_block(self, block_id: int) -> bytes:
        start = block_id * self.block_size
        parts = [slab[:, :, start:start + self.block_size].contiguous().cpu().view(torch.uint8).reshape(-1)
                 for slab in self.slabs]
        return torch.cat(parts).numpy().tobytes()

    def write_block(self, block_id: int, payload: memoryview) -> None:
        data = torch.frombuffer(payload, dtype=torch.uint8)
        start, offset = block_id * self.block_size, 0
        for slab in self.slabs:
            target = slab[:, :, start:start + self.block_size]
            size = target.numel() * target.element_size()
            target.copy_(data[offset:offset + size].view(target.dtype).view(target.shape))
            offset += size

    # ---- loads ------------------------------------------------------------------------------------
    def start_load(self, request_id: str, first: int, hashes: list[bytes]) -> None:
        self.loads[request_id] = Load(first, hashes, self.store.load(hashes, self.payload_bytes))

    def may_load(self, num_blocks: int) -> bool:
        """Whether a load of `num_blocks` fits beside those read or being read and not yet in the pool."""
        held = sum(len(load.hashes) for load in self.loads.values())
        return held == 0 or (held + num_blocks) * self.payload_bytes <= MAX_LOADING_BYTES

    def finished_load(self, request_id: str) -> tuple[Load, list[memoryview]] | None:
        """The request's load and its payloads once read (forgotten then); None while none is done."""
        load = self.loads.get(request_id)
        if load is None or not load.future.done():
            return None
        del self.loads[request_id]
        return load, load.future.result()

    def loading(self, request_id: str) -> bool:
        load = self.loads.get(request_id)
        return load is not None and not load.future.done()

    def forget(self, request_id: str) -> None:
        self.loads.pop(request_id, None)

    def wait_for_loads(self, timeout: float) -> None:
        """Block until a load in flight finishes (an engine with nothing else to run)."""
        futures = [load.future for load in self.loads.values() if not load.future.done()]
        if futures:
            wait(futures, timeout, return_when=FIRST_COMPLETED)

    def worth_loading(self) -> bool:
        """Whether reading a block is faster than computing it, as measured so far (loads go ahead until 8 blocks
        have been read)."""
        value = self.block_value()
        return value is None or self.store.stats.loaded_blocks < 8 or value > 0

    def block_value(self) -> float | None:
        """What a block on this tier saves a request against one in RAM, as measured: 1 - the time to read it / the
        time to compute it (the cache-aware router weighs a shared tier's blocks by it); None before both are
        measured."""
        stats = self.store.stats
        if self.prefill_seconds_per_token is None or not stats.loaded_blocks:
            return None
        read = stats.load_seconds / stats.loaded_blocks
        return max(0.0, 1.0 - read / (self.prefill_seconds_per_token * self.block_size))

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that computed mostly prompt tokens: its time per token updates the prefill speed."""
        per_token = seconds / num_tokens
        previous = self.prefill_seconds_per_token
        self.prefill_seconds_per_token = per_token if previous is None else (
            previous + PREFILL_SMOOTHING * (per_token - previous))

    def stats(self) -> dict:
        return {**self.store.stats.as_dict(), "restored_blocks": self.restored_blocks,
                "capacity_bytes": self.store.capacity, "directory": str(self.store.folder)}

    def close(self) -> None:
        self.store.close()
