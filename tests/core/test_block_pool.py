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


def test_allocate_slots_all_or_nothing():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots([1], 5) == [[0, 1]]          # ceil(5/4) = 2 blocks
    assert kv.allocate_slots([1], 8) == [[]]              # still 2
    assert kv.allocate_slots([1, 2], 12) is None          # needs 1 + 3 > 2 free
    assert kv.num_free_blocks == 2 and kv.num_blocks_of(2) == 0
    assert kv.allocate_slots([2], 8) == [[2, 3]]
    kv.free(1)
    kv.free(2)
    assert kv.num_free_blocks == 4
