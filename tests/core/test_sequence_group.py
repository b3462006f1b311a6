"""Model-free tests of parallel sampling's bookkeeping: a real Scheduler, BlockManager and
SequenceGroup, no model. The worker is replaced by ``sample``, which answers as the engine
does (one row per sequence in the step that completes a group's prompt)."""

from __future__ import annotations

import random

from slipstream.core.request import Request, RequestStatus
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from slipstream.core.sequence_group import SequenceGroup, child_params
from scheduler_support import EOS, make_scheduler


def make_group(rid: str, prompt_len: int, max_tokens: int, n: int, **params) -> Request:
    req = Request(
        rid,
        list(range(100, 100 + prompt_len)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=n, **params),
        EOS,
    )
    SequenceGroup.create(req)
    return req


def sample(sched: SchedulerOutput, rng: random.Random) -> ModelRunnerOutput:
    out = ModelRunnerOutput.empty(0)
    for item in sched.scheduled:
        reaches_end = item.num_computed_before + item.num_new_tokens == item.num_tokens_before
        rows = 1 + len(item.forks) if reaches_end else 0
        out.token_ids.append([rng.randrange(10, 1000) for _ in range(rows)])
        out.logprobs.append([-rng.random() for _ in range(rows)])
    return out


def step(s, rng) -> SchedulerOutput:
    sched = s.schedule()
    s.update_from_output(sched, sample(sched, rng), lambda r: None)
    return sched


def refcounts(s) -> list[int]:
    return [b.ref_count for b in s.bm.blocks]


def test_fork_shares_full_prompt_blocks_and_copies_the_partial_one():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    parent = make_group("g", 10, 5, n=3)  # 2 full blocks + 2 tokens in the third
    s.add(parent)
    sched = step(s, random.Random(0))
    seqs = parent.group.sequences
    assert [q.status for q in seqs] == [RequestStatus.RUNNING] * 3
    assert all(q.num_output_tokens == 1 and q.num_computed_tokens == 10 for q in seqs)
    shared = parent.block_table[:2]
    assert all(q.block_table[:2] == shared for q in seqs)
    assert [s.bm.blocks[b].ref_count for b in shared] == [3, 3]
    partials = [q.block_table[2] for q in seqs]
    assert len(set(partials)) == 3  # each sequence writes its own copy
    assert sched.block_copies == [(partials[0], partials[1]), (partials[0], partials[2])]
    assert s.bm.num_used_blocks == 2 + 3


def test_fork_at_a_block_boundary_copies_nothing():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_batched_tokens=64)
    parent = make_group("g", 8, 5, n=4)
    s.add(parent)
    sched = step(s, random.Random(0))
    assert sched.block_copies == []
    assert s.bm.num_used_blocks == 2
    assert [s.bm.blocks[b].ref_count for b in parent.block_table] == [4, 4]


def test_fork_without_a_free_block_recomputes_the_partial_block():
    s = make_scheduler(num_blocks=4, block_size=4, max_num_batched_tokens=64)  # 3 usable
    parent = make_group("g", 10, 2, n=2)  # 12 tokens: the whole pool
    s.add(parent)
    sched = step(s, random.Random(0))
    child = parent.group.children[0]
    assert sched.block_copies == []
    assert child.num_computed_tokens == 8 and child.block_table == parent.block_table[:2]
    rng = random.Random(1)
    while s.has_work():
        step(s, rng)
        s.bm.check_invariants()
    assert all(q.num_output_tokens == 2 for q in parent.group.sequences)
    assert refcounts(s) == [0] * 4


def test_group_is_admitted_only_with_seats_for_every_sequence():
    s = make_scheduler(max_num_seqs=4)
    s.add(Request("a", [5, 6, 7], SamplingParams(max_tokens=50), EOS))
    s.add(make_group("g", 6, 5, n=4))  # 1 + 4 sequences > 4 seats: it waits
    sched = s.schedule()
    assert [item.request.request_id for item in sched.scheduled] == ["a"]


def test_random_groups_with_preemption_and_swap_end_with_every_refcount_at_zero():
    for mode, swap_blocks in (("recompute", 0), ("swap", 40)):
        rng = random.Random(3)
        s = make_scheduler(
            num_blocks=30,
            block_size=4,
            swap_blocks=swap_blocks,
            preemption_mode=mode,
            max_num_seqs=16,
            max_num_batched_tokens=48,
        )
        groups = []
        for i in range(6):
            req = make_group(
                f"g{i}",
                rng.randrange(3, 30),
                rng.randrange(4, 20),
                n=rng.randrange(1, 4),
                best_of=None,
            )
            groups.append(req)
            s.add(req)
        preempted = 0
        for _ in range(2000):
            if not s.has_work():
                break
            sched = step(s, rng)
            preempted += len(sched.preempted)
            s.bm.check_invariants()
            if s.swap is not None:
                s.swap.check_invariants()
        assert not s.has_work()
        assert preempted > 0, mode
        for req in groups:
            seqs = req.group.sequences if req.group else [req]
            assert all(q.num_output_tokens == q.params.max_tokens for q in seqs)
        assert refcounts(s) == [0] * 30


def test_child_seeds_follow_vllm():
    params = SamplingParams(seed=7, n=3, prompt_logprobs=2)
    assert [child_params(params, i).seed for i in range(3)] == [7, 8, 9]
    assert child_params(params, 1).prompt_logprobs is None
    assert child_params(SamplingParams(n=2), 1).seed is None
