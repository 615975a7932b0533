"""BlockPool: the physical KV blocks, their reference counts and the free queue.

Allocation takes from the head of the free queue. A freed block goes back to the head, so the
most recently freed blocks are reused first. The KV pool is mapped lazily (a page costs memory
once written), so reusing warm blocks keeps what a server really holds at its peak concurrent
need; handing out the block freed longest ago instead would, over a long run, walk and make
resident the whole pool. Blocks that hold a cached prefix (the prefix-caching issue) are to wait
at the tail instead, in LRU order.
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # OrderedDict as an O(1) doubly linked list: head = next to be handed out.
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def allocate(self, count: int) -> list[int] | None:
        """Take `count` blocks from the head of the free queue, or None (taking nothing) if short."""
        if count > len(self._free):
            return None
        blocks = []
        for _ in range(count):
            block_id, _ = self._free.popitem(last=False)
            self.ref_counts[block_id] = 1
            blocks.append(block_id)
        return blocks

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks that reach zero go to the head of the free
        queue, in the order given (callers pass a request's blocks tail first)."""
        for block_id in block_ids:
            if self.ref_counts[block_id] <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
        for block_id in reversed(block_ids):
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                self._free[block_id] = None
                self._free.move_to_end(block_id, last=False)

    def free_block_ids(self) -> list[int]:
        """The free queue in reuse order (head first); for tests and debugging."""
        return list(self._free)
