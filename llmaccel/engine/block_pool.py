"""BlockPool: the physical KV blocks, their reference counts, the free queue and the prefix cache.

Allocation takes from the head of the free queue. A freed block that holds no cached prefix goes
back to the head, so the most recently freed blocks are reused first: the KV pool is mapped lazily
(a page costs memory once written), and reusing warm blocks keeps what a server really holds at its
peak concurrent need.

A full block whose tokens are known carries a hash of its whole prefix (automatic prefix caching,
as vLLM v1 does it). Freed, it keeps the hash and waits at the tail of the free queue, in LRU order,
so the free queue reads: warm uncached blocks, never-used blocks, then cached blocks, least
recently used first. A new request that finds its prefix's hashes takes those blocks back (`touch`)
instead of recomputing them; a cached block is evicted, and its hash forgotten, only when the pool
hands it out again. Blocks in use (ref count > 0) are shared, never evicted.

Each cached block is also indexed under its parent's hash with its own token ids, so a prompt that
matches a cached block only in its first tokens finds it (`longest_partial_match`): the caller copies
those tokens' KV into a block of its own instead of recomputing them (token-granular reuse at the end
of a prefix, as llama.cpp's slots and SGLang's radix cache give). A request's last block, not full
when it ends, is kept the same way (`cache_partial`): it waits in the free queue like a cached block,
found only by a partial match, so the next turn of a chat reuses every token of the last one.

With `record_events()`, every hash the cache gains or loses is appended to `events` as
(stored: bool, hash): a replica publishes them so a router knows which prefixes it holds (as
vLLM's KV events do for llm-d and Dynamo). Off by default: a single engine needs no log.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

PARTIAL = b"partial"  # the hash of a block kept for partial matches only (a prefix hash is 32 bytes)


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # prefix hash -> block holding it
        # parent prefix hash -> {cached child block: its token ids}, for matches inside a block
        self.children: dict[bytes, dict[int, tuple[int, ...]]] = {}
        self._parents: dict[int, bytes] = {}  # cached block -> the parent hash it is indexed under
        self.num_evictions = 0
        self.num_touched = 0  # blocks ever handed out: the KV pool's memory that has been written (RSS)
        self._touched = bytearray(num_blocks)
        # OrderedDict as an O(1) doubly linked list: head = next to be handed out.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.events: deque[tuple[bool, bytes]] | None = None
        # (block id, hash) of a cached block about to be handed out again, while it still holds its KV: the disk
        # tier spills it (engine/kv_tiers/offload.py)
        self.on_evict: Callable[[int, bytes], None] | None = None

    def record_events(self) -> deque[tuple[bool, bytes]]:
        """Start logging (stored, hash) for every hash cached or evicted; returns the log, which the
        caller drains with popleft (thread-safe against the engine thread's appends)."""
        if self.events is None:
            self.events = deque((True, h) for h in self.cached)
        return self.events

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks from the head of the free queue, or None (taking nothing) if short.
        A cached block handed out loses its hash."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self._evict(block_id)
            if not self._touched[block_id]:
                self._touched[block_id] = 1
                self.num_touched += 1
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block (callers pass a request's blocks tail first). Blocks
        that reach zero go to the free queue: uncached ones to the head, cached ones to the tail,
        so a request's deepest cached blocks are evicted before its shared beginning."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
        released = []
        for block_id in block_ids:
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                released.append(block_id)
        for block_id in released:
            if self.block_hashes[block_id] is not None:
                self._free[block_id] = None  # the tail: most recently used
        for block_id in reversed(released):
            if self.block_hashes[block_id] is None:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    def lookup(self, block_hash: bytes) -> int | None:
        return self.cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference to cached blocks a new request reuses (out of the free queue if unused)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] == 0:
                del self._free[block_id]
            self.ref_counts[block_id] += 1

    def cache_block(self, block_id: int, block_hash: bytes, parent: bytes | None = None,
                    token_ids: Sequence[int] = ()) -> None:
        """Record that `block_id` (full, computed) holds the prefix `block_hash`: its `token_ids` after
        the prefix `parent`, when given, for partial matches. A prefix some other block holds already
        stays with that block."""
        if block_hash not in self.cached and self.block_hashes[block_id] is None:
            self.cached[block_hash] = block_id
            self.block_hashes[block_id] = block_hash
            if parent is not None:
                self._index(block_id, parent, token_ids)
            if self.events is not None:
                self.events.append((True, block_hash))

    def cache_partial(self, block_id: int, parent: bytes, token_ids: Sequence[int]) -> None:
        """Keep `block_id`, whose first len(token_ids) slots are computed, for partial matches after
        `parent` once its request frees it (call before freeing)."""
        if self.block_hashes[block_id] is None and token_ids:
            self.block_hashes[block_id] = PARTIAL
            self._index(block_id, parent, token_ids)

    def _index(self, block_id: int, parent: bytes, token_ids: Sequence[int]) -> None:
        """File the block under its parent's hash with its tokens, for `longest_partial_match`."""
        self.children.setdefault(parent, {})[block_id] = tuple(token_ids)
        self._parents[block_id] = parent

    def _evict(self, block_id: int) -> None:
        block_hash = self.block_hashes[block_id]
        if block_hash is None:
            return
        self.block_hashes[block_id] = None
        parent = self._parents.pop(block_id, None)
        if parent is not None:
            siblings = self.children[parent]
            del siblings[block_id]
            if not siblings:
                del self.children[parent]
        if block_hash != PARTIAL:
            if self.on_evict is not None:
                self.on_evict(block_id, block_hash)
            del self.cached[block_hash]
            self.num_evictions += 1
            if self.events is not None:
                self.events.append((False, block_hash))

    def longest_partial_match(self, parent: bytes, token_ids: Sequence[int]) -> tuple[int, int] | None:
        """The cached block after prefix `parent` whose tokens begin with the longest run of `token_ids`,
        and that run's length (>= 1); None where no child of `parent` starts with token_ids[0]."""
        best: tuple[int, int] | None = None
        for block_id, tokens in self.children.get(parent, {}).items():
            length = 0
            for ours, theirs in zip(token_ids, tokens, strict=False):
                if ours != theirs:
                    break
                length += 1
            if length and (best is None or length > best[1]):
                best = (block_id, length)
        return best

    def free_block_ids(self) -> list[int]:
        """The free queue in reuse order (head first); for tests and debugging."""
        return list(self._free)
