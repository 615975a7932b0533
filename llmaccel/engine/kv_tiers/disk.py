"""DiskKVStore: KV blocks in files under a directory, there again after a restart.

Each block is a file named by its prefix hash, in a folder named by the KV's namespace (the weights, dtype,
quantization and KV layout the blocks were computed with: `kv_namespace`), so models or formats sharing a
directory never read each other's blocks. A file is a header (magic, format version, namespace, the block's
hash, payload length, SHA-256 digest of the payload) and the payload. It is written under a temporary name and
renamed, so a process killed mid-write leaves no file under a block's name; a file that does not check out in
every field (truncated, corrupt, another namespace's or another block's) is deleted when read, never used. The
store holds at most `capacity` bytes, dropping the least recently used files; at start it finds the files
already there (oldest first in that order) and deletes temporary ones left by a crash. Processes may share a
directory (replicas of one model): each finds the others' files when it looks a block up, and since every file
appears whole under its name, one process's eviction costs another at most a miss.

Writes run on a thread of their own, reads on others (a run's blocks several at a time), so a burst of spills never
delays a load. A write that fails (a full disk, a read-only directory) drops that block and is logged; the server
does not notice otherwise.
"""

from __future__ import annotations

import hashlib
import logging
import os
import struct
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MAGIC = b"LLMACCKV"
VERSION = 1
HEADER = struct.Struct("<8sH32s32sQ16s")  # magic, version, namespace, block hash, payload bytes, digest
SUFFIX = ".kv"
MAX_PENDING_BYTES = 256 << 20  # spills queued beyond this are dropped: a slow disk never holds the RAM
READ_THREADS = 4  # a run's blocks are read this many at a time (a device serves several reads at once)


def payload_digest(payload: bytes | memoryview) -> bytes:
    """SHA-256, cut to 16 bytes: with the SHA extensions of current x86 CPUs ~1.8 GB/s on one core (BLAKE2b 0.7),
    a fifth of a millisecond for a 368 KB block."""
    return hashlib.sha256(payload).digest()[:16]


@dataclass
class DiskTierStats:
    stored_blocks: int = 0
    stored_bytes: int = 0
    store_seconds: float = 0.0
    store_errors: int = 0
    dropped_blocks: int = 0  # spills not written: the write queue was full
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    rejected_files: int = 0  # truncated, corrupt or foreign files found and deleted
    evicted_files: int = 0  # dropped to stay within the capacity
    files: int = 0
    disk_bytes: int = 0

    def as_dict(self) -> dict:
        return asdict(self)


class DiskKVStore:
    def __init__(self, root: str | os.PathLike, namespace: bytes, capacity: int) -> None:
        if len(namespace) != 32:
            raise ValueError("the namespace is a 32-byte digest")
        if capacity < 1:
            raise ValueError(f"the disk tier's capacity must be positive, got {capacity}")
        self.namespace, self.capacity = namespace, capacity
        self.folder = Path(root).expanduser() / namespace.hex()[:32]
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stats = DiskTierStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> file bytes, least recently used first
        self._pending: dict[bytes, int] = {}  # queued writes: hash -> payload bytes
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-write")
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-load")  # one run after another
        self._block_reads = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="kv-disk-read")
        self._scan()

    # ---- what is there ----------------------------------------------------------------------------
    def _scan(self) -> None:
        found = []
        for path in self.folder.glob("*/*"):
            if path.name.endswith(".tmp"):  # a write a crash cut short
                path.unlink(missing_ok=True)
                continue
            if not path.name.endswith(SUFFIX):
                continue
            try:
                block_hash = bytes.fromhex(path.name.removesuffix(SUFFIX))
                info = path.stat()
            except (ValueError, OSError):
                continue
            if len(block_hash) == 32:
                found.append((info.st_mtime_ns, block_hash, info.st_size))
        for _, block_hash, size in sorted(found):
            self._add(block_hash, size)
        self._evict_over_capacity()

    def __contains__(self, block_hash: bytes) -> bool:
        with self._lock:
            return self._known(block_hash)

    def _known(self, block_hash: bytes) -> bool:
        """Stored or queued to be (call under the lock)."""
        return block_hash in self._index or block_hash in self._pending

    def count_run(self, hashes: list[bytes]) -> int:
        """How many of `hashes`, from the first, are stored (or queued to be), by this process or by another on the
        same directory (replicas sharing it: a file not in the index is looked for on disk)."""
        with self._lock:
            count = 0
            for block_hash in hashes:
                if not self._known(block_hash) and not self._discover(block_hash):
                    break
                count += 1
            return count

    def _discover(self, block_hash: bytes) -> bool:
        """Index a file another process wrote (call under the lock)."""
        try:
            size = self._path(block_hash).stat().st_size
        except OSError:
            return False
        self._add(block_hash, size)
        return True

    def _add(self, block_hash: bytes, size: int) -> None:
        """Index a file of `size` bytes as the most recently used (call under the lock, or before threads)."""
        self._index[block_hash] = size
        self.stats.disk_bytes += size
        self.stats.files = len(self._index)

    def _drop(self, block_hash: bytes) -> None:
        """Delete a block's file and forget it (call under the lock)."""
        self._path(block_hash).unlink(missing_ok=True)
        self.stats.disk_bytes -= self._index.pop(block_hash, 0)
        self.stats.files = len(self._index)

    def _path(self, block_hash: bytes) -> Path:
        name = block_hash.hex()
        return self.folder / name[:2] / f"{name}{SUFFIX}"

    # ---- writing ----------------------------------------------------------------------------------
    def store(self, block_hash: bytes, payload: bytes) -> bool:
        """Queue a block's payload to be written; False (nothing queued) when it is stored already or the
        queue is full."""
        with self._lock:
            if self._known(block_hash):
                return False
            if sum(self._pending.values()) + len(payload) > MAX_PENDING_BYTES:
                self.stats.dropped_blocks += 1
                return False
            self._pending[block_hash] = len(payload)
        self._writer.submit(self._write, block_hash, payload)
        return True

    def _write(self, block_hash: bytes, payload: bytes) -> None:
        began = time.perf_counter()
        path = self._path(block_hash)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            header = HEADER.pack(MAGIC, VERSION, self.namespace, block_hash, len(payload), payload_digest(payload))
            with open(temporary, "wb") as file:
                file.write(header)
                file.write(payload)
            os.replace(temporary, path)
        except OSError as exc:
            temporary.unlink(missing_ok=True)
            with self._lock:
                self._pending.pop(block_hash, None)
                self.stats.store_errors += 1
                errors = self.stats.store_errors
            if errors == 1 or errors % 100 == 0:
                logger.warning("KV disk tier: could not write a block to %s (%s; %d failed writes so far): the "
                               "block is dropped, serving goes on", self.folder, exc, errors)
            return
        with self._lock:
            self._pending.pop(block_hash, None)
            self._add(block_hash, HEADER.size + len(payload))
            self.stats.stored_blocks += 1
            self.stats.stored_bytes += len(payload)
            self.stats.store_seconds += time.perf_counter() - began
            self._evict_over_capacity()

    def _evict_over_capacity(self) -> None:
        """Drop least recently used files until the store fits (call under the lock, or before threads)."""
        while self.stats.disk_bytes > self.capacity and self._index:
            self._drop(next(iter(self._index)))
            self.stats.evicted_files += 1

    def flush(self) -> None:
        """Wait for every queued write."""
        self._writer.submit(lambda: None).result()

    # ---- reading ----------------------------------------------------------------------------------
    def load(self, hashes: list[bytes], payload_bytes: int) -> Future[list[memoryview]]:
        """Read the blocks `hashes` on the reader thread; the future gives the payloads of the run that checked
        out from the first (a missing or bad file ends it; a bad one is deleted), each a writable view."""
        return self._reader.submit(self._read_run, list(hashes), payload_bytes)

    def _read_run(self, hashes: list[bytes], payload_bytes: int) -> list[memoryview]:
        with self._lock:
            queued = any(block_hash in self._pending for block_hash in hashes)
        if queued:  # a block still queued for writing is read once it is written
            self.flush()
        began = time.perf_counter()
        read = list(self._block_reads.map(lambda block_hash: self._read(block_hash, payload_bytes), hashes))
        first_bad = next((i for i, payload in enumerate(read) if payload is None), len(read))
        payloads = read[:first_bad]
        with self._lock:
            for block_hash in hashes[:len(payloads)]:
                if block_hash in self._index:
                    self._index.move_to_end(block_hash)
            self.stats.loaded_blocks += len(payloads)
            self.stats.loaded_bytes += sum(len(p) for p in payloads)
            self.stats.load_seconds += (time.perf_counter() - began) * len(payloads) / max(1, len(read))
        return payloads

    def _read(self, block_hash: bytes, payload_bytes: int) -> memoryview | None:
        with self._lock:
            if block_hash not in self._index:
                return None
        path = self._path(block_hash)
        buffer = bytearray(HEADER.size + payload_bytes + 1)  # one byte more: a file too long shows
        try:
            with open(path, "rb") as file:
                data = memoryview(buffer)[:file.readinto(buffer)]
        except OSError:
            data = memoryview(b"")
        problem = self._check(data, block_hash, payload_bytes)
        if problem is None:
            return data[HEADER.size:]
        logger.warning("KV disk tier: %s is %s; deleted, never used", path, problem)
        with self._lock:
            self._drop(block_hash)
            self.stats.rejected_files += 1
        return None

    def _check(self, data: memoryview, block_hash: bytes, payload_bytes: int) -> str | None:
        """What is wrong with a file's bytes, or None."""
        if len(data) < HEADER.size:
            return "truncated (no whole header)"
        magic, version, namespace, stored_hash, length, digest = HEADER.unpack_from(data)
        if magic != MAGIC or version != VERSION:
            return "not a KV block file of this version"
        if namespace != self.namespace:
            return "another model's or KV format's block"
        if stored_hash != block_hash:
            return "another block's file"
        if length != payload_bytes or len(data) != HEADER.size + payload_bytes:
            return "truncated or of the wrong size"
        if payload_digest(data[HEADER.size:]) != digest:
            return "corrupt (checksum mismatch)"
        return None

    def close(self) -> None:
        """Finish queued writes and stop the threads."""
        self._writer.shutdown(wait=True)
        self._reader.shutdown(wait=True)
        self._block_reads.shutdown(wait=True)
