from __future__ import annotations

import pytest

from engine.core.kv_blocks import BlockPool, hash_block
from engine.core.sequence import Sequence
from engine.types import SamplingParams

BS = 4


def make_seq(tokens: list[int], seq_id: int = 0) -> Sequence:
    return Sequence(seq_id, f"r{seq_id}", list(tokens), len(tokens), SamplingParams())


def computed(pool: BlockPool, seq: Sequence, num_tokens: int) -> None:
    """As the scheduler does after a step that computed the first num_tokens tokens."""
    seq.num_computed_tokens = num_tokens
    pool.cache_computed_blocks(seq)


def test_allocate_and_free_roundtrip():
    pool = BlockPool(8, BS)
    seq = make_seq(list(range(10)))
    assert pool.allocate(seq, 10)
    assert len(seq.block_table) == 3 and len(set(seq.block_table)) == 3
    assert pool.num_free == 5 and pool.num_used == 3
    assert pool.allocate(seq, 12)  # still fits in 3 blocks
    assert len(seq.block_table) == 3
    assert pool.allocate(seq, 13)
    assert len(seq.block_table) == 4
    pool.free(seq)
    assert seq.block_table == [] and pool.num_free == 8


def test_allocate_is_all_or_nothing():
    pool = BlockPool(2, BS)
    seq = make_seq(list(range(12)))
    assert not pool.allocate(seq, 12)
    assert seq.block_table == [] and pool.num_free == 2


def test_block_hash_chains_over_prefix():
    first = hash_block(None, [1, 2, 3, 4])
    assert hash_block(None, [1, 2, 3, 4]) == first
    assert hash_block(first, [5, 6, 7, 8]) != hash_block(None, [5, 6, 7, 8])
    assert hash_block(hash_block(None, [9, 9, 9, 9]), [5, 6, 7, 8]) != hash_block(first, [5, 6, 7, 8])


def test_prefix_hit_shares_blocks_and_never_covers_last_token():
    pool = BlockPool(16, BS)
    a = make_seq(list(range(12)), 0)
    assert pool.allocate(a, 12)
    computed(pool, a, 12)
    assert pool.num_cached_blocks == 3
    b = make_seq(list(range(12)), 1)  # identical prompt: last block must still be computed
    hits = pool.find_cached_prefix(b)
    assert hits == a.block_table[:2]
    assert pool.allocate(b, 12, hits)
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] != a.block_table[2]
    assert pool.ref_count(a.block_table[0]) == 2
    c = make_seq(list(range(8)) + [99, 98, 97, 96, 95], 2)  # shares two blocks, then differs
    assert pool.find_cached_prefix(c) == a.block_table[:2]
    d = make_seq([7] + list(range(1, 12)), 3)  # first block differs, so nothing after it matches
    assert pool.find_cached_prefix(d) == []
    for seq in (a, b):
        pool.free(seq)
    assert pool.num_free == 16


def test_freed_cached_blocks_stay_reusable_until_evicted_lru():
    pool = BlockPool(4, BS)
    a = make_seq(list(range(8)) + [50], 0)  # 2 full blocks + 1 partial
    assert pool.allocate(a, 9)
    computed(pool, a, 9)
    pool.free(a)
    assert pool.num_free == 4 and pool.num_cached_blocks == 2
    # a resubmitted prompt hits the freed, still cached blocks
    again = make_seq(list(range(8)) + [51], 1)
    hits = pool.find_cached_prefix(again)
    assert len(hits) == 2
    assert pool.allocate(again, 9, hits)
    assert pool.num_free == 1
    computed(pool, again, 9)
    pool.free(again)
    # a different sequence needing all 4 blocks evicts cached ones only after the free list is empty
    other = make_seq([60 + i for i in range(16)], 2)
    assert pool.allocate(other, 8)
    assert pool.num_cached_blocks == 2 and pool.num_evictions == 0
    assert pool.allocate(other, 12)
    assert pool.num_evictions == 1
    # the tail block went first (freed first), so the leading block of the prefix is still cached
    probe = make_seq(list(range(4)) + [70, 71], 3)
    assert len(pool.find_cached_prefix(probe)) == 1
    pool.free(other)
    assert pool.num_free == 4


def test_reviving_an_evictable_block_counts_against_free():
    pool = BlockPool(3, BS)
    a = make_seq(list(range(9)), 0)
    assert pool.allocate(a, 9)
    computed(pool, a, 9)
    pool.free(a)
    holder = make_seq([40, 41, 42, 43], 1)  # takes the one never-cached block
    assert pool.allocate(holder, 4)
    b = make_seq(list(range(8)) + [77, 78, 79, 80, 81], 2)
    hits = pool.find_cached_prefix(b)
    assert len(hits) == 2
    # 2 evictable hits + 2 new blocks > 2 free blocks
    assert not pool.can_allocate(b, 13, hits)
    assert not pool.allocate(b, 9, hits)  # 2 revived + 1 new > 2 free
    assert b.block_table == []
    assert pool.allocate(b, 8, hits)  # the 2 revived blocks alone fit
    assert pool.num_free == 0 and pool.num_cached_blocks == 2
    pool.free(b)
    pool.free(holder)
    assert pool.num_free == 3


def test_duplicate_block_stays_private():
    pool = BlockPool(8, BS)
    a, b = make_seq(list(range(5)), 0), make_seq(list(range(5)), 1)
    assert pool.allocate(a, 5) and pool.allocate(b, 5)  # admitted in the same step: no hit
    computed(pool, a, 5)
    computed(pool, b, 5)
    assert pool.num_cached_blocks == 1
    pool.free(a)
    pool.free(b)
    assert pool.num_free == 8


def test_prefix_caching_disabled():
    pool = BlockPool(8, BS, enable_prefix_caching=False)
    a = make_seq(list(range(9)), 0)
    assert pool.allocate(a, 9)
    computed(pool, a, 9)
    assert pool.num_cached_blocks == 0
    assert pool.find_cached_prefix(make_seq(list(range(9)), 1)) == []
    pool.free(a)
    assert pool.num_free == 8


def test_rejects_empty_pool():
    with pytest.raises(ValueError):
        BlockPool(0, BS)


def image_seq(seq_id: int, content_hash: bytes) -> Sequence:
    """16 tokens whose [5, 11) are one image's span (the same ids whatever the image)."""
    from engine.types import ImagePlacement, PreparedImage

    image = PreparedImage(content_hash=content_hash, aspect_ratio=(1, 1), num_chunks=1, tokens_per_chunk=4, pixels=None)
    seq = make_seq(list(range(16)), seq_id)
    seq.images = (ImagePlacement(image, offset=5, length=6),)
    return seq


def test_prefix_hits_are_keyed_by_image_content():
    pool = BlockPool(16, BS)
    a = image_seq(0, b"cat" * 8)
    assert pool.allocate(a, 16)
    computed(pool, a, 16)
    assert pool.find_cached_prefix(image_seq(1, b"cat" * 8)) == a.block_table[:3]  # the same image in the same place
    # another image: the block before its span hits; the blocks holding its tokens (and all after) never do
    assert pool.find_cached_prefix(image_seq(2, b"dog" * 8)) == a.block_table[:1]
    assert pool.find_cached_prefix(make_seq(list(range(16)), 3)) == a.block_table[:1]  # the same ids, no image
    pool.free(a)
    assert pool.num_free == 16
