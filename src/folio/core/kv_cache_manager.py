"""Per-sequence block tables on top of the block pool: allocation, sharing,
copy-on-write and prefix caching.

    sequence tokens:  t0 .. t15 | t16 .. t31 | t32 t33 _ _ ...
    block table:      [  7      ,    2       ,   9      ]      (logical -> physical)
    slot of token i:  table[i // block_size] * block_size + i % block_size

A sequence holds exactly ceil(tokens it has or is about to compute / block_size)
blocks. `allocate_slots` either takes everything a step needs or nothing.

Sharing: forked sequences (n > 1) hold the same blocks, each counted once per
holder. A sequence about to write into a block someone else also holds first
gets its own copy: a new block, and (source, copy) in the step's copy list.
Full blocks are never written again, so they are shared without copies.

Prefix caching: a full block is published under a chained hash of (the
previous block's hash, its tokens); a new sequence takes the longest run of
published blocks matching its prompt and computes only the rest.

A window (a model whose every layer attends to its last `window` keys only,
Mistral's): a block wholly behind the window of the next token a sequence
computes is no layer's keys any more, so it goes back to the pool before
the step's blocks are taken (`drop_behind_window`, which the scheduler
calls; published blocks stay findable there). Its
entry stays in the table, not held (`_dropped` leading entries), so that
positions keep their blocks; no attention kernel reads behind its window.
A long sequence then holds about (window + step) / block_size blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from folio.core.block_pool import BlockPool, KVBlock


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class WasteStats:
    """Slots allocated in held blocks against tokens actually stored, per step."""

    steps: int = 0
    wasted_sum: int = 0
    allocated_sum: int = 0
    peak: float = 0.0          # the worst step's waste fraction
    last: float = 0.0

    def record(self, wasted: int, allocated: int) -> None:
        self.last = wasted / allocated if allocated else 0.0
        if allocated:
            self.steps += 1
            self.wasted_sum += wasted
            self.allocated_sum += allocated
            self.peak = max(self.peak, self.last)

    @property
    def average(self) -> float:
        """Time-averaged over steps, weighted by the slots allocated."""
        return self.wasted_sum / self.allocated_sum if self.allocated_sum else 0.0


@dataclass
class SlotGrant:
    """What one sequence got for a step."""

    new_block_ids: list[int] = field(default_factory=list)
    copy: Optional[tuple[int, int]] = None      # (source, destination) when copied on write


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 window: Optional[int] = None):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.window = window
        self._dropped: dict[int, int] = {}           # seq_id -> leading entries not held
        self.pool = BlockPool(num_blocks)
        self.tables: dict[int, list[KVBlock]] = {}   # seq_id -> its blocks, in order
        self._hashes: dict[int, list[int]] = {}      # seq_id -> hashes of its full blocks
        # seq_id -> what its first block's hash chains from (a LoRA adapter's
        # id: the same prompt under two adapters never shares KV)
        self._salts: dict[int, object] = {}
        self._published: dict[int, int] = {}         # seq_id -> leading blocks published

    # ---- allocation ------------------------------------------------------------
    def _needs(self, seq_ids: list[int], num_computed: int,
               num_tokens: int) -> list[tuple[int, bool]]:
        """Per sequence: (new blocks to take, whether the block it writes first
        must be copied). Of several sequences sharing that block, all but the
        last holder copy; the last one writes in place."""
        planned: dict[int, int] = {}      # block id -> copies already planned this call
        needs = []
        index = num_computed // self.block_size
        for seq_id in seq_ids:
            table = self.tables.get(seq_id, ())
            grow = max(0, cdiv(num_tokens, self.block_size) - len(table))
            cow = False
            if (num_tokens > num_computed and num_computed % self.block_size != 0
                    and index < len(table)):
                block = table[index]
                cow = block.ref_cnt - planned.get(block.block_id, 0) > 1
                if cow:
                    planned[block.block_id] = planned.get(block.block_id, 0) + 1
            needs.append((grow, cow))
        return needs

    def allocate_slots(self, seq_ids: list[int], num_computed: int,
                       num_tokens: int) -> Optional[list[SlotGrant]]:
        """Make each sequence able to hold `num_tokens` tokens, of which
        `num_computed` are in the cache. None (and nothing changed) when the
        pool cannot cover all of them: the caller then preempts."""
        if len(seq_ids) == 1:       # a decode's token in the block it already holds alone
            table = self.tables.get(seq_ids[0])
            bs = self.block_size
            if (table and cdiv(num_tokens, bs) <= len(table)
                    and (num_tokens <= num_computed or num_computed % bs == 0
                         or table[num_computed // bs].ref_cnt == 1)):
                return [SlotGrant()]
        needs = self._needs(seq_ids, num_computed, num_tokens)
        if sum(g + c for g, c in needs) > self.pool.num_free_blocks:
            return None
        grants = []
        for seq_id, (grow, cow) in zip(seq_ids, needs):
            table = self.tables.setdefault(seq_id, [])
            grant = SlotGrant()
            if cow:
                index = num_computed // self.block_size
                old, (new,) = table[index], self.pool.take(1)
                table[index] = new
                self.pool.release([old])
                grant.copy = (old.block_id, new.block_id)
            blocks = self.pool.take(grow)
            table.extend(blocks)
            grant.new_block_ids = [b.block_id for b in blocks]
            grants.append(grant)
        return grants

    def drop_behind_window(self, seq_id: int, num_computed: int) -> None:
        """Give back the blocks wholly before the first key the token at
        position `num_computed` sees (num_computed - window + 1): the
        scheduler's, before it takes the blocks of a step whose first token
        is there (not a proposal's allocation: the step's verified token,
        before the proposals, still reads behind them)."""
        table = self.tables.get(seq_id)
        if self.window is None or not table:
            return
        behind = max(0, num_computed - self.window + 1) // self.block_size
        done = self._dropped.get(seq_id, 0)
        if behind > done:
            self.pool.release(reversed(table[done:behind]))
            self._dropped[seq_id] = behind

    def most_blocks(self, tokens: int, step_tokens: int) -> int:
        """The most blocks one sequence of `tokens` tokens holds at once when it
        computes at most `step_tokens` a step: all of them, or with a window
        those a step's tokens and the window before them touch."""
        whole = cdiv(tokens, self.block_size)
        if self.window is None:
            return whole
        return min(whole, cdiv(self.window - 1 + step_tokens, self.block_size) + 1)

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child holds the parent's blocks too (copy-on-write later)."""
        blocks = self.tables[parent_id]
        dropped = self._dropped.get(parent_id, 0)
        self.pool.share(blocks[dropped:])
        self.tables[child_id] = list(blocks)
        if dropped:
            self._dropped[child_id] = dropped
        if parent_id in self._hashes:
            self._hashes[child_id] = list(self._hashes[parent_id])
            self._published[child_id] = self._published.get(parent_id, 0)
        if parent_id in self._salts:
            self._salts[child_id] = self._salts[parent_id]

    def set_salt(self, seq_id: int, salt: object) -> None:
        """Key the sequence's blocks by `salt` too (before its blocks are hashed)."""
        self._salts[seq_id] = salt

    def free(self, seq_id: int) -> None:
        """Return a sequence's blocks; the last block first so that the free
        queue's LRU order keeps a prompt's leading blocks longest."""
        blocks = self.tables.pop(seq_id, None)
        dropped = self._dropped.pop(seq_id, 0)
        self._hashes.pop(seq_id, None)
        self._salts.pop(seq_id, None)
        self._published.pop(seq_id, None)
        if blocks:
            self.pool.release(reversed(blocks[dropped:]))

    def trim(self, seq_id: int, num_tokens: int) -> bool:
        """Return the blocks past the first `num_tokens` tokens (slots taken for
        proposed tokens that were rejected); True when any went back. They
        hold no published tokens: only computed tokens are ever published."""
        table = self.tables.get(seq_id)
        keep = cdiv(num_tokens, self.block_size)
        if not table or len(table) <= keep:
            return False
        extra = table[keep:]
        del table[keep:]
        self.pool.release(reversed(extra))
        return True

    # ---- prefix caching --------------------------------------------------------
    def _block_hashes(self, seq_id: int, token_ids: list[int], num_full: int) -> list[int]:
        hashes = self._hashes.setdefault(seq_id, [])
        bs = self.block_size
        while len(hashes) < num_full:
            i = len(hashes)
            parent = hashes[-1] if hashes else self._salts.get(seq_id)
            hashes.append(hash((parent, tuple(token_ids[i * bs:(i + 1) * bs]))))
        return hashes[:num_full]

    def attach_cached_prefix(self, seq_id: int, token_ids: list[int], limit: int) -> int:
        """Give a fresh sequence the published blocks matching its first tokens
        (whole blocks, at most `limit` tokens); returns the tokens covered."""
        if not self.enable_caching or limit < self.block_size:
            return 0
        hits = []
        for h in self._block_hashes(seq_id, token_ids, limit // self.block_size):
            block = self.pool.lookup(h)
            if block is None:
                break
            hits.append(block)
        if hits:
            self.pool.share(hits)
            self.tables[seq_id] = hits
            self._published[seq_id] = len(hits)
        return len(hits) * self.block_size

    def cache_full_blocks(self, seq_id: int, token_ids: list[int], num_computed: int) -> None:
        """Publish the sequence's blocks whose tokens are all in the cache now."""
        if not self.enable_caching:
            return
        table = self.tables.get(seq_id, ())
        num_full = min(num_computed // self.block_size, len(table))
        # (a block given back behind the window is published by then, or never)
        start = max(self._published.get(seq_id, 0), self._dropped.get(seq_id, 0))
        if num_full <= start:
            return
        hashes = self._block_hashes(seq_id, token_ids, num_full)
        for i in range(start, num_full):
            self.pool.set_hash(table[i], hashes[i])
        self._published[seq_id] = num_full

    # ---- queries ---------------------------------------------------------------
    def waste(self, holders) -> tuple[int, int]:
        """(empty slots, allocated slots) over held blocks. `holders` gives
        (seq_id, tokens computed) per sequence; only a sequence's last block can
        be partly filled, and a block shared by several counts once."""
        bs = self.block_size
        partial: dict[int, int] = {}
        for seq_id, num_computed in holders:
            table = self.tables.get(seq_id)
            if table:
                partial[table[-1].block_id] = num_computed - (len(table) - 1) * bs
        wasted = sum(bs - fill for fill in partial.values() if 0 <= fill < bs)
        return wasted, self.pool.num_used_blocks * bs

    def block_ids(self, seq_id: int) -> list[int]:
        return [b.block_id for b in self.tables.get(seq_id, ())]

    def num_blocks_of(self, seq_id: int) -> int:
        """Blocks the sequence holds (not those given back behind a window)."""
        return len(self.tables.get(seq_id, ())) - self._dropped.get(seq_id, 0)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()
