"""KVCacheManager: gives each request the blocks its tokens need, on demand, reusing cached prefixes.

Prefix hashes are chained: block i's hash covers its own token ids and block i-1's hash, so equal
hashes mean equal whole prefixes. The chain starts from a salt naming the model variant (model,
dtype, quantization), so different weights never share KV. A request admitted with a cached prefix
starts with those blocks and `num_computed_tokens` past them; at least its last prompt token is
always computed, since its logits give the first output token. Past its last whole cached block, a
prompt may match the first tokens of a cached block (`partial`): with a `copy_prefix` hook (the runner's
KV copy), the request gets a fresh block holding a copy of those tokens' KV and computes from there, so a
repeated or continued prompt recomputes only its last token, not up to a block of them. The shared block
is never written: a copy is cheaper than sharing a block two requests would then extend differently.
A request's last block, partly computed when it ends, is kept for such matches too, so the next turn
of a chat finds every token of the last one.

With a KV window (StreamingLLM, `window` and `sinks`), a sequence keeps the blocks of its first
`sinks` tokens and of its last `window` tokens; each block wholly between them is freed as soon as
the window passes it, so a conversation of any length holds at most
cdiv(sinks, block_size) + cdiv(window, block_size) + 1 blocks while it decodes (with re-indexed sinks,
cdiv(sinks, block_size) more). The block table stays dense (sink blocks, then window blocks); keys are
cached after RoPE, at their positions in the text, so the kept keys need no recomputation.

Where a kept key sits (`reindex_sinks`, --kv-positions): with absolute positions a query at position p
sees each sink p - j positions away, which grows past anything the model was trained on. StreamingLLM
places every key at its index in the cache instead (Xiao et al. 2023, sec. 3.2). Window keys and the query
shift by the same number of freed positions, delta, so their distances are unchanged and only the sinks
move: once blocks are freed, the table's sink entries are private copies of the sink blocks with every key
turned by delta more positions (RoPE's rotations compose), rewritten from the originals, which stay
untouched for the prefix cache, each time the window frees more. That is exactly the cache-index form,
with one extra rounding of the sink keys and no error that accumulates. A model whose every layer slides (Mistral's
`sliding_window`) runs the same way with no sinks: its attention masks keys to the exact window, and
the blocks before it are never read again. A windowed request admitted on a long cached prefix takes
only the prefix blocks its window still reaches.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from llmaccel.engine.block_pool import BlockPool
from llmaccel.engine.kv_tiers.offload import KVOffload
from llmaccel.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    digest = hashlib.sha256(parent)
    digest.update(b",".join(str(t).encode() for t in token_ids))
    return digest.digest()


@dataclass
class CachedPrefix:
    """What a request finds cached: whole `blocks` it shares, then optionally `partial` =
    (cached block, n): that block's first n tokens' KV, to be copied into a block of its own."""

    blocks: list[int] = field(default_factory=list)
    partial: tuple[int, int] | None = None
    loading: bool = False  # more of the prefix is being read from the disk tier: the request waits for it

    def num_tokens(self, block_size: int) -> int:
        return len(self.blocks) * block_size + (self.partial[1] if self.partial else 0)


@dataclass
class PrefixCacheStats:
    """Prompt tokens looked up at admission, and how many of them were found cached."""

    queries: int = 0
    hits: int = 0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 cache_salt: str = "", window: int | None = None, sinks: int = 0,
                 reindex_sinks: bool = False) -> None:
        self.block_size = block_size
        self.window = window
        self.num_sink_blocks = cdiv(sinks, block_size) if window is not None else 0
        self.reindex_sinks = reindex_sinks and self.num_sink_blocks > 0
        # with reindex_sinks: (sources, targets, delta) copies the KV of blocks `sources` into `targets`, every key
        # turned by `delta` positions (the runner's, set by the engine)
        self.turn_sink_keys: Callable[[list[int], list[int], int], None] | None = None
        self.pool = BlockPool(num_blocks)
        self.enable_prefix_caching = enable_prefix_caching
        self.root_hash = hashlib.sha256(cache_salt.encode()).digest()
        self.stats = PrefixCacheStats()
        # copies the KV of n token slots from one block to another (src, dst, n): set by the engine to allow
        # partial-block hits; None (a tiny KV spec in a test, a guard that keeps per-block sums): whole blocks only
        self.copy_prefix: Callable[[int, int, int], None] | None = None
        self.tier: KVOffload | None = None  # the disk tier below RAM (--kv-offload-dir), set by attach_tier

    def attach_tier(self, tier: KVOffload) -> None:
        """Spill evicted blocks to `tier` and look past RAM's prefix there (engine/kv_tiers/offload.py)."""
        self.tier = tier
        self.pool.on_evict = tier.spill

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def find_cached_prefix(self, request: Request) -> CachedPrefix:
        """The longest cached prefix of a request that has computed nothing yet (never all of its
        tokens): whole blocks, then where allowed the first tokens of one more. Takes nothing:
        `allocate_slots` does."""
        found = CachedPrefix()
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return found
        if request.params.prompt_logprobs is not None or request.params.pooling == "mean":
            # every prompt position must run (as in vLLM)
            return found
        last = request.num_tokens - 1  # tokens that may come from the cache
        hashes = self._block_hashes(request, last // self.block_size)
        self._extend_in_ram(hashes, found.blocks)
        if self.tier is not None and len(found.blocks) < len(hashes):
            found.loading = self._extend_from_tier(request, hashes, found.blocks)
            if found.loading:
                return found
        if self.copy_prefix is not None and self.window is None:
            start = len(found.blocks) * self.block_size
            parent = self._parent(request, hashes, len(found.blocks))
            rest = request.all_token_ids[start:min(last, start + self.block_size)]
            found.partial = self.pool.longest_partial_match(parent, rest) if rest else None
        return found

    def _extend_from_tier(self, request: Request, hashes: list[bytes], blocks: list[int]) -> bool:
        """Extend `blocks`, the request's prefix found in RAM, by what its finished load brought from the disk tier,
        or start a load of the run of its next blocks there; True while a load is in flight (the request waits).
        One load per admission try: what does not fit in the pool then is computed."""
        tier = self.tier
        if tier.loading(request.request_id):
            return True
        done = tier.finished_load(request.request_id)
        if done is None:
            first = len(blocks)
            run = tier.store.count_run(hashes[first:])
            if not run or not tier.worth_loading():
                return False
            if tier.may_load(run):  # else it waits for room: the loads before it are on their way into the pool
                tier.start_load(request.request_id, first, hashes[first:first + run])
            return True
        load, payloads = done
        self._restore(request, hashes, blocks, load.first, payloads)
        self._extend_in_ram(hashes, blocks)
        return False

    def _extend_in_ram(self, hashes: list[bytes], blocks: list[int]) -> None:
        """Append to `blocks` (the first len(blocks) of `hashes`' blocks) the cached blocks that follow them."""
        for block_hash_ in hashes[len(blocks):]:
            block_id = self.pool.lookup(block_hash_)
            if block_id is None:
                break
            blocks.append(block_id)

    def _restore(self, request: Request, hashes: list[bytes], blocks: list[int], first: int,
                 payloads: list[memoryview]) -> None:
        """Copy loaded blocks (numbers first, first + 1, ... of the request) into free blocks, cached under their
        hashes and left free for the request to take as any cached prefix; those that find no free block are
        dropped (computed instead)."""
        wanted = [i for i in range(first, first + len(payloads)) if self.pool.lookup(hashes[i]) is None]
        self.pool.touch(blocks)  # the request's own cached blocks are not handed out for its load
        targets = self.pool.allocate(min(len(wanted), self.pool.num_free_blocks)) or []
        size = self.block_size
        for block_id, index in zip(targets, wanted, strict=False):
            self.tier.write_block(block_id, payloads[index - first])
            self.pool.cache_block(block_id, hashes[index], self._parent(request, hashes, index),
                                  request.all_token_ids[index * size:(index + 1) * size])
        self.tier.restored_blocks += len(targets)
        self.pool.free(list(reversed(targets)) + list(reversed(blocks)))

    def spill_all(self) -> None:
        """Write every cached block RAM holds to the disk tier and wait for the writes (at shutdown: a restart on
        the same directory finds them)."""
        if self.tier is not None:
            for block_hash, block_id in list(self.pool.cached.items()):
                self.tier.spill(block_id, block_hash)
            self.tier.store.flush()

    def uncached_prefix_hashes(self, request: Request, num_cached_blocks: int) -> list[bytes]:
        """The hashes of a fresh request's full prompt blocks past its cached prefix (what its prefill
        will compute and register); none where prefix caching is off."""
        if not self.enable_prefix_caching or request.num_computed_tokens:
            return []
        return self._block_hashes(request, (request.num_tokens - 1) // self.block_size)[num_cached_blocks:]

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       cached: CachedPrefix | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`, starting it on the `cached` prefix
        (from find_cached_prefix) if given; a partial hit's tokens are copied into its first new block.

        Returns the newly allocated block ids (possibly empty), or None when the pool is short,
        in which case nothing was taken and the caller decides whom to preempt.
        """
        cached = cached or CachedPrefix()
        num_computed = request.num_computed_tokens + cached.num_tokens(self.block_size)
        held = request.num_skipped_blocks + len(request.block_ids) + len(cached.blocks)
        needed = cdiv(num_computed + num_new_tokens, self.block_size) - held
        kept, skipped = self._cut_to_window(cached.blocks, num_computed) if cached.blocks else ([], 0)
        unused_cached = sum(1 for b in kept if self.pool.ref_counts[b] == 0)  # these leave the free queue
        # re-indexed sinks past the window: private copies of the sink blocks, turned
        turned = self.num_sink_blocks if self.reindex_sinks and skipped else 0
        if max(needed, 0) + turned > self.pool.num_free_blocks - unused_cached:
            return None
        if cached.blocks:
            self.pool.touch(kept)
            request.block_ids = kept
            request.num_skipped_blocks = skipped
        new_blocks = self.pool.allocate(max(needed, 0) + turned) or []
        if turned:
            self._turn_sinks(request, new_blocks[:turned])
            new_blocks = new_blocks[turned:]
        if cached.partial is not None:
            # the source's KV is intact even if this very allocation handed it out: nothing has run yet
            source, count = cached.partial
            if source != new_blocks[0]:
                self.copy_prefix(source, new_blocks[0], count)
        request.num_computed_tokens = num_computed
        request.block_ids.extend(new_blocks)
        return new_blocks

    def _cut_to_window(self, cached: list[int], num_computed: int) -> tuple[list[int], int]:
        """The cached prefix blocks a request starting at `num_computed` still needs (sinks and window),
        and how many between them it skips."""
        skipped = self._num_outside_window(num_computed, 0)
        start = self.num_sink_blocks
        return cached[:start] + cached[start + skipped:], skipped

    def _num_outside_window(self, num_computed: int, num_skipped: int) -> int:
        """Blocks after the sinks that the next query (at position `num_computed`) no longer sees,
        beyond the `num_skipped` already freed."""
        if self.window is None:
            return 0
        first_needed = max(0, num_computed - self.window) // self.block_size
        return max(0, first_needed - self.num_sink_blocks - num_skipped)

    def record_admission(self, request: Request, num_cached_tokens: int) -> None:
        """Count a fresh request's prompt lookup (re-admissions after preemption are not queries)."""
        if self.enable_prefix_caching and request.num_preemptions == 0:
            self.stats.queries += request.num_prompt_tokens
            self.stats.hits += num_cached_tokens
            request.num_cached_tokens = num_cached_tokens

    def cache_computed_blocks(self, request: Request) -> None:
        """Hash and register the request's blocks that are now full and computed."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed_tokens // self.block_size
        hashes = self._block_hashes(request, num_full)
        for index in range(request.num_cached_blocks, num_full):
            position = self.table_index(request, index)
            if position is not None:
                tokens = request.all_token_ids[index * self.block_size:(index + 1) * self.block_size]
                table = request.sink_block_ids if index < len(request.sink_block_ids) else request.block_ids
                self.pool.cache_block(table[position], hashes[index], self._parent(request, hashes, index), tokens)
                if self.tier is not None and self.tier.write_through:
                    self.tier.spill(table[position], hashes[index])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def table_index(self, request: Request, logical_block: int) -> int | None:
        """Where a sequence's block number `logical_block` sits in its block table (None: freed)."""
        if logical_block < self.num_sink_blocks:
            return logical_block
        if logical_block < self.num_sink_blocks + request.num_skipped_blocks:
            return None
        return logical_block - request.num_skipped_blocks

    def release_outside_window(self, request: Request) -> None:
        """Free the blocks the window has passed (every block wholly between the sinks and the
        oldest token the next query may see)."""
        num_droppable = self._num_outside_window(request.num_computed_tokens, request.num_skipped_blocks)
        start = self.num_sink_blocks
        first_turn = self.reindex_sinks and not request.sink_block_ids
        if num_droppable == 0 or (first_turn and num_droppable < start):
            return  # re-indexed sinks first move when the blocks freed can hold their copies
        dropped = request.block_ids[start:start + num_droppable]
        del request.block_ids[start:start + num_droppable]
        request.num_skipped_blocks += num_droppable
        self.pool.free(list(reversed(dropped)))
        if self.reindex_sinks:
            self._turn_sinks(request, self.pool.allocate(start) if first_turn else request.block_ids[:start])

    def _turn_sinks(self, request: Request, targets: list[int]) -> None:
        """Point the request's sink entries at `targets` holding its sink blocks' KV with the keys turned by the
        positions freed so far (the originals are kept aside on first use)."""
        start = self.num_sink_blocks
        if not request.sink_block_ids:
            request.sink_block_ids = request.block_ids[:start]
            request.block_ids[:start] = targets
        self.turn_sink_keys(request.sink_block_ids, targets, request.num_skipped_blocks * self.block_size)

    @property
    def max_chunk(self) -> int | None:
        """The most tokens a windowed sequence computes in one step, so its blocks stay bounded."""
        return self.window

    def free(self, request: Request, keep_tail: bool = False) -> None:
        """Release every block of `request` (tail first) at once. `keep_tail`: its KV is the whole model's
        for its `num_computed_tokens` (a scheduled request's, not a scoring pass that stops at a layer), so a
        partly computed last block is kept for partial matches, where they are allowed."""
        num_full, num_rest = divmod(request.num_computed_tokens, self.block_size)
        if (keep_tail and self.enable_prefix_caching and self.copy_prefix is not None and self.window is None
                and num_rest and num_full < len(request.block_ids)):
            parent = self._parent(request, self._block_hashes(request, num_full), num_full)
            tokens = request.all_token_ids[num_full * self.block_size:request.num_computed_tokens]
            self.pool.cache_partial(request.block_ids[num_full], parent, tokens)
        self.pool.free(list(reversed(request.block_ids)) + list(reversed(request.sink_block_ids)))
        if self.tier is not None:
            self.tier.forget(request.request_id)
        request.block_ids = []
        request.sink_block_ids = []
        request.num_cached_blocks = 0
        request.num_skipped_blocks = 0

    def _block_hashes(self, request: Request, count: int) -> list[bytes]:
        """The chained hashes of the request's first `count` full blocks, extending its memo."""
        hashes, size = request.block_hashes, self.block_size
        while len(hashes) < count:
            index = len(hashes)
            hashes.append(block_hash(self._parent(request, hashes, index),
                                     request.all_token_ids[index * size:(index + 1) * size]))
        return hashes[:count]

    def _parent(self, request: Request, hashes: list[bytes], index: int) -> bytes:
        """The prefix hash block `index` follows: block index - 1's in `hashes`, or for the first the salt's (and
        the request's own: a LoRA adapter's KV is not the base model's)."""
        if index:
            return hashes[index - 1]
        if not request.cache_salt:
            return self.root_hash
        return hashlib.sha256(self.root_hash + request.cache_salt.encode()).digest()
