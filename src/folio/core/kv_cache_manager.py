"""Per-sequence block tables on top of the block pool.

    sequence tokens:  t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...
    block table:      [  7      ,    2       ,   9      ]      (logical -> physical)
    slot of token i:  table[i // block_size] * block_size + i % block_size

A sequence holds exactly ceil(tokens it has or is about to compute / block_size)
blocks. `allocate_slots` either takes all the blocks a step needs or nothing.
"""

from __future__ import annotations

from folio.core.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[KVBlock]] = {}   # seq_id -> its blocks, in order

    def blocks_needed(self, seq_id: int, num_tokens: int) -> int:
        have = len(self.tables.get(seq_id, ()))
        return max(0, cdiv(num_tokens, self.block_size) - have)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.pool.num_free_blocks

    def allocate_slots(self, seq_ids: list[int], num_tokens: int) -> list[list[int]] | None:
        """Grow each sequence's table to cover `num_tokens` tokens.

        Returns the new block ids per sequence, or None (and changes nothing)
        when the pool cannot cover all of them: the caller then preempts.
        """
        needs = [self.blocks_needed(s, num_tokens) for s in seq_ids]
        if not self.can_allocate(sum(needs)):
            return None
        new_ids = []
        for seq_id, need in zip(seq_ids, needs):
            blocks = self.pool.take(need)
            self.tables.setdefault(seq_id, []).extend(blocks)
            new_ids.append([b.block_id for b in blocks])
        return new_ids

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_blocks_of(self, seq_id: int) -> int:
        return len(self.tables.get(seq_id, ()))

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks; the last block first so that the free
        queue's LRU order keeps a prompt's leading blocks longest."""
        blocks = self.tables.pop(seq_id, None)
        if blocks:
            self.pool.release(reversed(blocks))

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()
