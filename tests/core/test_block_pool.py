import pytest

from folio.core.block_pool import BlockPool
from folio.core.kv_cache_manager import KVCacheManager


def test_take_share_release_counts():
    pool = BlockPool(4)
    a, b = pool.take(2)
    assert (a.ref_cnt, b.ref_cnt, pool.num_free_blocks) == (1, 1, 2)
    pool.share([a])
    pool.release([a, b])
    assert a.ref_cnt == 1 and b.ref_cnt == 0 and pool.is_free(b.block_id)
    pool.release([a])
    assert pool.num_free_blocks == 4
    with pytest.raises(RuntimeError, match="double free"):
        pool.release([a])


def test_free_queue_is_lru():
    pool = BlockPool(3)
    blocks = pool.take(3)
    pool.release([blocks[2]])
    pool.release([blocks[0]])
    assert [b.block_id for b in pool.take(2)] == [2, 0]
    pool.release([pool.blocks[0], pool.blocks[1], pool.blocks[2]])


def test_take_more_than_free_raises():
    pool = BlockPool(2)
    with pytest.raises(ValueError):
        pool.take(3)
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def ids(grants):
    return None if grants is None else [g.new_block_ids for g in grants]


def test_allocate_slots_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert ids(kv.allocate_slots([1], 0, 5)) == [[0, 1]]       # ceil(5/4) = 2 blocks
    assert ids(kv.allocate_slots([1], 5, 8)) == [[]]           # still 2
    assert kv.allocate_slots([1, 2], 8, 12) is None            # needs 1 + 3 > 2 free
    assert kv.num_free_blocks == 2 and kv.num_blocks_of(2) == 0
    assert ids(kv.allocate_slots([2], 0, 8)) == [[2, 3]]
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 4


def test_fork_then_copy_on_write():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    kv.allocate_slots([1], 0, 6)                   # 6 prompt tokens: blocks 0 and 1 (partial)
    kv.fork(1, 2)
    kv.fork(1, 3)
    assert [b.ref_cnt for b in kv.tables[1]] == [3, 3]
    grants = kv.allocate_slots([1, 2, 3], 6, 7)    # each writes token 6 into block 1
    assert [g.copy for g in grants[:2]] == [(1, 2), (1, 3)]
    assert grants[2].copy is None                  # the last holder writes in place
    assert kv.block_ids(3) == [0, 1] and kv.block_ids(1) == [0, 2]
    assert [b.ref_cnt for b in kv.tables[3]] == [3, 1]
    for s in (1, 2, 3):
        kv.free(s)
    assert kv.num_free_blocks == 8


def test_prefix_cache_hit_and_eviction():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    kv.allocate_slots([1], 0, 5)
    kv.cache_full_blocks(1, tokens, 5)             # blocks of [5, 6] and [7, 8] published
    kv.free(1)
    assert kv.attach_cached_prefix(2, tokens + [1], 5) == 4
    assert kv.block_ids(2) == [0, 1] and kv.num_free_blocks == 2
    assert kv.attach_cached_prefix(3, [5, 6, 0, 0], 3) == 2       # only the first block
    kv.free(2)
    kv.free(3)
    kv.allocate_slots([4], 0, 8)                   # needs every block: the cache is evicted
    assert kv.pool.cached == {} and kv.attach_cached_prefix(5, tokens, 4) == 0
    kv.free(4)


def test_waste_counts_empty_slots_of_last_blocks_once():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    kv.allocate_slots([1], 0, 5)          # 2 blocks, 3 empty slots
    kv.allocate_slots([2], 0, 8)          # 2 full blocks
    kv.fork(1, 3)                         # shares seq 1's partial block: counted once
    assert kv.waste([(1, 5), (2, 8), (3, 5)]) == (3, 16)
    for s in (1, 2, 3):
        kv.free(s)


def test_reset_prefix_cache_forgets_every_hash_only_when_nothing_is_held():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    tokens = [5, 6, 7, 8, 9]
    kv.allocate_slots([1], 0, 5)
    kv.cache_full_blocks(1, tokens, 5)
    assert not kv.pool.reset_prefix_cache()          # sequence 1 still holds its blocks
    assert len(kv.pool.cached) == 2
    kv.free(1)
    assert kv.pool.reset_prefix_cache()
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.attach_cached_prefix(2, tokens + [1], 5) == 0
    kv.free(2)


def test_a_window_gives_back_only_blocks_no_token_from_there_reads():
    """Window 8, blocks of 4: the token at position 10 sees keys 3..10, so
    block 0 (keys 0-3) stays until position 11; a proposals' allocation for
    positions 11.. (after the step's decode token at 10) gives back nothing:
    that token still reads key 3 in this step. Forks hold only what is left;
    everything comes back once."""
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False, window=8)
    kv.allocate_slots([1], 0, 10)                        # positions 0-9: blocks 0-2
    kv.drop_behind_window(1, 10)
    assert kv.num_blocks_of(1) == 3 and kv.num_free_blocks == 5
    kv.allocate_slots([1], 10, 11)                       # the decode at 10
    kv.allocate_slots([1], 11, 15)                       # its proposals, 11-14
    assert kv.num_blocks_of(1) == 4                      # block 0 still held
    kv.drop_behind_window(1, 12)                         # next step's first token at 12
    assert kv.num_blocks_of(1) == 3 and kv.num_free_blocks == 5
    kv.fork(1, 2)
    assert [b.ref_cnt for b in kv.tables[1][1:]] == [2, 2, 2]
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 8
    assert kv.most_blocks(1000, 4) == 4 and kv.most_blocks(6, 4) == 2
