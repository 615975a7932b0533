"""KVCacheManager: gives each request the blocks its tokens need, on demand."""

from __future__ import annotations

from llmaccel.engine.block_pool import BlockPool
from llmaccel.engine.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens of `request`.

        Returns the newly allocated block ids (possibly empty), or None when the pool is short,
        in which case nothing was allocated and the caller decides whom to preempt.
        """
        needed = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - len(request.block_ids)
        if needed <= 0:
            return []
        new_blocks = self.pool.allocate(needed)
        if new_blocks is None:
            return None
        request.block_ids.extend(new_blocks)
        return new_blocks

    def free(self, request: Request) -> None:
        """Release every block of `request` (tail first) at once."""
        self.pool.free(list(reversed(request.block_ids)))
        request.block_ids = []
