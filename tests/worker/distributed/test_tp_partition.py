"""How a model's heads, MLP and vocabulary are split over tensor-parallel ranks."""

import pytest

from slipstream.worker.distributed.partition import Span, even_spans, head_shards, vocab_shards


def test_even_spans_cover_everything_with_sizes_one_apart():
    spans = even_spans(10, 4)
    assert [s.size for s in spans] == [3, 3, 2, 2]
    assert spans[0].start == 0 and spans[-1].stop == 10
    assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))


def test_the_embedded_models_heads_split_by_kv_group_over_two_ranks():
    """SmolLM2-135M: 9 query heads in 3 KV groups of 3; two ranks take 2 and 1 groups."""
    first, second = head_shards(9, 3, 2)
    assert (first.query, first.kv) == (Span(0, 6), Span(0, 2))
    assert (second.query, second.kv) == (Span(6, 9), Span(2, 3))
    assert first.group_size == second.group_size == 3


def test_divisible_heads_split_as_vllm_splits_them():
    shards = head_shards(32, 8, 4)
    assert [(s.query, s.kv) for s in shards] == [
        (Span(8 * r, 8 * r + 8), Span(2 * r, 2 * r + 2)) for r in range(4)
    ]


@pytest.mark.parametrize("heads, kv_heads, world", [(4, 2, 4), (4, 1, 3), (8, 2, 8), (12, 4, 6)])
def test_fewer_kv_heads_than_ranks_replicate_each_kv_head(heads, kv_heads, world):
    shards = head_shards(heads, kv_heads, world)
    assert all(s.kv.size == 1 for s in shards)
    # every query head on exactly one rank, and on a rank that holds its KV head
    covered = [h for s in shards for h in range(s.query.start, s.query.stop)]
    assert sorted(covered) == list(range(heads))
    group = heads // kv_heads
    assert all(h // group == s.kv.start for s in shards for h in range(s.query.start, s.query.stop))


def test_more_ranks_than_a_kv_heads_queries_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="3 ranks would share KV head 0, which only 2 query"):
        head_shards(4, 2, 6)


def test_the_vocabulary_splits_into_equal_padded_shares_in_order():
    shards = vocab_shards(10, 4)
    assert [s.padded for s in shards] == [3] * 4
    assert [s.rows for s in shards] == [Span(0, 3), Span(3, 6), Span(6, 9), Span(9, 10)]
    assert [s.rows for s in vocab_shards(49152, 2)] == [Span(0, 24576), Span(24576, 49152)]
