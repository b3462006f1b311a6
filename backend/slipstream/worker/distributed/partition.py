"""Which part of a model each rank of a tensor-parallel group holds: its attention heads, its
slice of the MLP's intermediate width and its rows of the vocabulary.

vLLM requires the query and KV heads to divide evenly over the ranks. Slipstream's embedded
model (SmolLM2-135M: 9 query heads, 3 KV heads) does not divide over 2, so the split here is
by KV group (a KV head and the query heads that read it), as even as whole groups allow:

* at least as many KV heads as ranks: each rank takes a contiguous run of whole groups, the
  first ranks one group more where they do not divide (3 groups over 2 ranks: 2 and 1, so
  rank 0 holds 6 query heads and 2 KV heads, rank 1 3 and 1). Attention work and KV memory
  follow the groups: uneven, but nothing is computed twice and nothing is padded;
* fewer KV heads than ranks: each rank holds one KV head, replicated on the ranks that share
  it (as vLLM replicates them), and those ranks split that head's query heads between them.

Where the ranks divide the heads evenly this is exactly vLLM's split. The MLP's intermediate
width is split the same way (contiguous, sizes differing by at most one); the vocabulary in
equal padded shares, so that the ranks' logits gather into one tensor (the padding rows are
zero and their logits are cut off after the gather).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """``[start, stop)`` of something split over the ranks."""

    start: int
    stop: int

    @property
    def size(self) -> int:
        return self.stop - self.start

    def scaled(self, factor: int) -> "Span":
        """The same span in units ``factor`` times smaller (heads -> weight rows)."""
        return Span(self.start * factor, self.stop * factor)


@dataclass(frozen=True)
class HeadShard:
    """One rank's attention heads: contiguous query heads and the KV heads they read."""

    query: Span
    kv: Span

    @property
    def group_size(self) -> int:
        """Query heads per KV head on this rank."""
        return self.query.size // self.kv.size


@dataclass(frozen=True)
class VocabShard:
    """One rank's rows of the embedding and the LM head: ``rows`` of the vocabulary, held
    in a table of ``padded`` rows (equal on every rank)."""

    rows: Span
    padded: int


def even_spans(n: int, parts: int) -> list[Span]:
    """``n`` items in ``parts`` contiguous spans whose sizes differ by at most one (the
    larger ones first)."""
    bounds = [(n * i) // parts for i in range(parts + 1)]
    sizes = [bounds[i + 1] - bounds[i] for i in range(parts)]
    sizes.sort(reverse=True)
    spans, start = [], 0
    for size in sizes:
        spans.append(Span(start, start + size))
        start += size
    return spans


def head_shards(num_heads: int, num_kv_heads: int, world: int) -> list[HeadShard]:
    """Every rank's heads (see the module); ``ValueError`` where the heads cannot be split
    so that each rank has at least one query head of a KV head it holds."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not form groups over {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        return [HeadShard(kv.scaled(group), kv) for kv in even_spans(num_kv_heads, world)]
    owners = [rank * num_kv_heads // world for rank in range(world)]  # each rank's KV head
    shards = []
    for head in range(num_kv_heads):
        sharing = owners.count(head)
        if sharing > group:
            raise ValueError(
                f"tensor_parallel_size={world}: {sharing} ranks would share KV head {head}, "
                f"which only {group} query heads read (the model has {num_heads} query heads, "
                f"{num_kv_heads} KV heads)"
            )
        for part in even_spans(group, sharing):
            query = Span(head * group + part.start, head * group + part.stop)
            shards.append(HeadShard(query, Span(head, head + 1)))
    return shards


def vocab_shards(vocab_size: int, world: int) -> list[VocabShard]:
    """Every rank's vocabulary rows: ``ceil(vocab / world)`` each, the last ones short (and
    padded), so that the gathered logits are the vocabulary in order, padding at the end."""
    padded = -(-vocab_size // world)
    return [
        VocabShard(Span(min(r * padded, vocab_size), min((r + 1) * padded, vocab_size)), padded)
        for r in range(world)
    ]
