"""The pool of KV blocks: reference counts, a free queue and the prefix cache.

A block is free when its reference count is 0. Free blocks wait in an LRU
queue (an OrderedDict: O(1) append, pop-oldest and removal by id) so that a
block freed long ago is reused first. A full block may carry a hash of its
tokens and of every token before them; it stays findable by that hash while it
waits in the free queue, and a prefix-cache hit takes it back out of the middle
of the queue (hence O(1) removal). Only when the queue hands it out for new
tokens does it lose its hash: eviction is LRU and never touches a held block.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Optional


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[int] = None   # set once the block is full (prefix caching)

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt})"


class BlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self.cached: dict[int, KVBlock] = {}        # block hash -> the block holding it

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by some sequence (reference count > 0)."""
        return self.num_used_blocks / self.num_blocks

    def take(self, n: int) -> list[KVBlock]:
        """n blocks from the head of the free queue, each with reference count 1."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks with {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:        # evict it from the prefix cache
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def lookup(self, block_hash: int):
        return self.cached.get(block_hash)

    def set_hash(self, block: KVBlock, block_hash: int) -> None:
        """Publish a full block under its hash (first holder of a hash wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def share(self, blocks: Iterable[KVBlock]) -> None:
        """One more holder for each block (fork, prefix hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: Iterable[KVBlock]) -> None:
        """One holder less; blocks nobody holds go to the tail of the free queue."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block!r}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash, so no later prompt hits an earlier one's
        blocks (benchmarks, after a weights change). Only with no block held:
        returns False and changes nothing otherwise."""
        if len(self._free) != self.num_blocks:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True

    def is_free(self, block_id: int) -> bool:
        return block_id in self._free
