"""Block manager invariants: allocation, freeing, ref counts, prefix-cache hashing and LRU."""

from __future__ import annotations

import random

from slipstream.core.block_manager import BlockManager
from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams


def req(rid, tokens):
    return Request(rid, tokens, SamplingParams())


def allocate_all(bm, r):
    cached = bm.find_cached_prefix(r)
    r.num_computed_tokens = len(cached) * bm.block_size
    n = r.num_tokens - r.num_computed_tokens
    assert bm.can_allocate(r, n, cached)
    bm.allocate(r, n, cached)
    r.num_computed_tokens = r.num_tokens
    bm.register_full_blocks(r)
    return len(cached)


def test_allocate_and_free_keep_totals():
    bm = BlockManager(num_blocks=11, block_size=4)
    a, b = req("a", list(range(10))), req("b", list(range(50, 57)))
    allocate_all(bm, a)
    allocate_all(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_used_blocks == 5 and bm.num_free_blocks == 5
    bm.check_invariants()
    bm.free_request(a)
    assert a.block_table == [] and bm.num_used_blocks == 2
    bm.check_invariants()
    assert 0 not in b.block_table  # the scratch block is never handed out


def test_can_allocate_refuses_when_full():
    bm = BlockManager(num_blocks=4, block_size=4)
    big = req("a", list(range(16)))
    assert not bm.can_allocate(big, 16)
    assert bm.can_allocate(big, 12)


def test_prefix_hit_shares_blocks_with_ref_counts():
    bm = BlockManager(num_blocks=20, block_size=4)
    a = req("a", list(range(13)))
    allocate_all(bm, a)
    b = req("b", list(range(12)) + [99, 98])
    hits = allocate_all(bm, b)
    assert hits == 3 and b.block_table[:3] == a.block_table[:3]
    assert all(bm.blocks[x].ref_count == 2 for x in a.block_table[:3])
    bm.free_request(a)
    assert all(bm.blocks[x].ref_count == 1 for x in b.block_table[:3])
    bm.free_request(b)
    bm.check_invariants()
    # Freed but still cached: a third request hits the same blocks again.
    c = req("c", list(range(12)) + [5])
    assert allocate_all(bm, c) == 3


def test_last_token_is_never_a_hit_and_tokens_are_compared():
    bm = BlockManager(num_blocks=20, block_size=4)
    allocate_all(bm, req("a", list(range(8))))
    same = req("b", list(range(8)))
    assert len(bm.find_cached_prefix(same)) == 1  # block 2 holds the last token: recompute it
    differs = req("c", [0, 1, 2, 9] + list(range(4, 9)))
    assert bm.find_cached_prefix(differs) == []


def test_lru_eviction_prefers_unhashed_then_oldest():
    bm = BlockManager(num_blocks=5, block_size=2)  # 4 usable
    a = req("a", [1, 2, 3, 4])
    allocate_all(bm, a)
    bm.free_request(a)  # 2 cached blocks, free
    b = req("b", [7, 8, 9])  # needs 2 blocks: takes the 2 never-used ones first
    allocate_all(bm, b)
    assert len(bm.find_cached_prefix(req("x", [1, 2, 3, 4, 5]))) == 2
    c = req("c", [20, 21, 22])  # now cached blocks must be evicted
    allocate_all(bm, c)
    assert bm.find_cached_prefix(req("y", [1, 2, 3, 4, 5])) == []
    bm.check_invariants()


def test_random_workload_invariants():
    rng = random.Random(0)
    bm = BlockManager(num_blocks=64, block_size=4)
    live = []
    for i in range(500):
        if live and rng.random() < 0.45:
            bm.free_request(live.pop(rng.randrange(len(live))))
        else:
            prefix = [1, 2, 3, 4, 5, 6, 7, 8] if rng.random() < 0.5 else []
            r = req(f"r{i}", prefix + [rng.randrange(100) for _ in range(rng.randrange(1, 20))])
            cached = bm.find_cached_prefix(r)
            r.num_computed_tokens = len(cached) * 4
            if bm.can_allocate(r, r.num_tokens - r.num_computed_tokens, cached):
                bm.allocate(r, r.num_tokens - r.num_computed_tokens, cached)
                r.num_computed_tokens = r.num_tokens
                bm.register_full_blocks(r)
                live.append(r)
        bm.check_invariants()
    for r in live:
        bm.free_request(r)
    assert bm.num_used_blocks == 0
