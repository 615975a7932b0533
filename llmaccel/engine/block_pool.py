"""BlockPool: the physical KV blocks, their reference counts and the free queue.

Freed blocks go to the tail of an LRU free queue and allocation takes from the head, so the
block freed longest ago is reused first (the order prefix caching will rely on to keep hot blocks).
"""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        # OrderedDict as an O(1) doubly linked list: head = least recently freed.
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
        """Drop one reference from each block; blocks that reach zero join the free queue's tail.

        Callers pass a request's blocks in reverse order so its tail blocks (least likely to be
        shared as a prefix) are reused first.
        """
        for block_id in block_ids:
            count = self.ref_counts[block_id]
            if count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than allocated")
            self.ref_counts[block_id] = count - 1
            if count == 1:
                self._free[block_id] = None

    def free_block_ids(self) -> list[int]:
        """The free queue in reuse order (head first); for tests and debugging."""
        return list(self._free)
