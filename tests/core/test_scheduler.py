"""Model-free scheduler tests: a real Scheduler and BlockManager, no model, no torch
(the harness is ``scheduler_support``). Every step is checked against the invariants.
"""

from __future__ import annotations

import random
import time

import pytest

from slipstream.core.request import Request, RequestStatus
from scheduler_support import (
    EOS,
    check_step,
    make_request,
    make_scheduler,
    no_stop_strings,
    run_to_completion,
    sample,
)


@pytest.mark.parametrize("policy", ["fifo", "priority", "sjf"])
@pytest.mark.parametrize("num_blocks", [24, 200])  # 24 forces preemption
@pytest.mark.parametrize("chunked", [True, False])
def test_random_workload_keeps_budget_seq_limit_progress_and_block_invariants(
    policy, num_blocks, chunked
):
    rng = random.Random(f"{policy}{num_blocks}{chunked}")
    # Without chunking, a whole prompt must fit one step's budget (the config enforces it).
    budget = dict(max_num_batched_tokens=32, max_model_len=32 if not chunked else 256)
    s = make_scheduler(
        num_blocks=num_blocks, policy=policy, enable_chunked_prefill=chunked, **budget
    )
    shared = rng.randrange(0, 3)
    reqs = [
        make_request(
            f"r{i}",
            rng.randrange(3, 30),
            rng.randrange(1, 20),
            first_token=100 + 1000 * (i % 3 if shared else i),
            priority=rng.randrange(0, 3),
        )
        for i in range(20)
    ]
    run_to_completion(s, reqs)
    for req in reqs:  # max_tokens, or max_model_len / the cache's capacity, ends each one
        assert req.status is RequestStatus.FINISHED_LENGTH
        assert req.num_output_tokens == min(
            req.params.max_tokens, s.max_seq_len - req.num_prompt_tokens
        )
    assert s.bm.num_used_blocks == 0
    if num_blocks == 24:
        assert s.num_preemptions > 0


def test_long_prompt_is_prefilled_in_chunks_within_the_token_budget():
    s = make_scheduler(max_num_batched_tokens=16)
    req = make_request("long", 40, 2)
    s.add(req)
    chunks = []
    while req.num_output_tokens == 0:
        sched = s.schedule()
        chunks.append(sched.num_tokens)
        s.update_from_output(sched, sample(sched), no_stop_strings)
    assert chunks == [16, 16, 8]
    assert req.num_computed_tokens == 40 and req.num_tokens == 41


def test_running_decodes_are_scheduled_before_a_new_prefill_and_share_the_budget():
    s = make_scheduler(max_num_batched_tokens=16, enable_prefix_caching=False)
    first = make_request("first", 4, 5)
    s.add(first)
    sched = s.schedule()
    s.update_from_output(sched, sample(sched), no_stop_strings)
    late = make_request("late", 40, 2, first_token=500)
    s.add(late)
    sched = s.schedule()
    assert [(i.request.request_id, i.num_new_tokens) for i in sched.scheduled] == [
        ("first", 1),
        ("late", 15),
    ]


def test_without_chunked_prefill_a_prompt_over_the_budget_waits():
    s = make_scheduler(max_num_batched_tokens=16, max_model_len=16, enable_chunked_prefill=False)
    s.add(make_request("small", 8, 1))
    s.add(make_request("big", 12, 1, first_token=500))  # 8 + 12 > 16: big waits whole
    sched = s.schedule()
    assert [i.request.request_id for i in sched.scheduled] == ["small"]


def test_max_num_seqs_caps_the_running_set():
    s = make_scheduler(max_num_seqs=3, max_num_batched_tokens=256)
    for i in range(6):
        s.add(make_request(f"r{i}", 4, 3, first_token=100 * (i + 1)))
    sched = s.schedule()
    assert len(sched.scheduled) == 3 and len(s.running) == 3 and len(s.waiting) == 3


def test_recompute_preemption_resets_progress_and_frees_the_victims_blocks():
    s = make_scheduler(num_blocks=9, max_num_batched_tokens=64, enable_prefix_caching=False)
    a, b = make_request("a", 12, 30), make_request("b", 12, 30, first_token=500)
    s.add(a)
    s.add(b)
    preempted = None
    for _ in range(40):
        sched = s.schedule()
        if sched.preempted:
            preempted = sched.preempted[0]
            assert preempted.num_computed_tokens == 0 and preempted.block_table == []
            assert preempted.status is RequestStatus.WAITING
            assert preempted not in [i.request for i in sched.scheduled]
        s.update_from_output(sched, sample(sched), no_stop_strings)
        check_step(s, sched, [a, b])
        if preempted:
            break
    assert preempted is b  # FIFO: the later arrival is the victim


def test_swap_preemption_keeps_progress_and_lists_the_copies_in_order():
    s = make_scheduler(
        num_blocks=9,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        preemption_mode="swap",
        swap_blocks=32,
    )
    # 8 usable blocks hold 32 tokens: each request fits alone (27), not both at once.
    a, b = make_request("a", 12, 15), make_request("b", 12, 15, first_token=500)
    for r in (a, b):
        s.add(r)
    out_seen = in_seen = False
    while s.has_work():
        sched = s.schedule()
        for transfer in sched.swaps:
            if transfer.direction.value == "out":
                out_seen = True
                assert transfer.request.status is RequestStatus.SWAPPED
                assert transfer.request.num_computed_tokens > 0  # progress kept
                assert len(transfer.cpu_blocks) == len(transfer.device_blocks)
            else:
                in_seen = True
                assert (
                    transfer.device_blocks
                    == transfer.request.block_table[: len(transfer.cpu_blocks)]
                )
        s.update_from_output(sched, sample(sched), no_stop_strings)
        check_step(s, sched, [a, b])
        s.swap.check_invariants()
    assert out_seen and in_seen
    assert a.num_output_tokens == b.num_output_tokens == 15
    assert s.swap.num_used_blocks == 0


def test_update_from_output_rolls_back_rejected_drafts_and_keeps_accepted_ones():
    s = make_scheduler()
    req = make_request("spec", 8, 20)
    s.add(req)
    sched = s.schedule()
    s.update_from_output(sched, sample(sched, token=7), no_stop_strings)
    assert req.num_tokens == 9 and req.num_computed_tokens == 8
    req.spec_token_ids = [11, 12, 13]
    sched = s.schedule()
    assert sched.scheduled[0].num_new_tokens == 4 and sched.scheduled[0].spec_token_ids == [
        11,
        12,
        13,
    ]
    updates = s.update_from_output(
        sched, sample(sched, token=9, agree_with_drafts=2), no_stop_strings
    )
    # drafts 11, 12 accepted, 13 rejected: the target's token 9 replaces it
    assert updates[0].new_token_ids == [11, 12, 9]
    assert updates[0].num_drafted == 3 and updates[0].num_accepted == 2
    assert req.output_token_ids == [7, 11, 12, 9]
    assert (
        req.num_computed_tokens == req.num_tokens - 1 == 11
    )  # the rejected draft's KV is not kept
    assert req.spec_token_ids == []


def test_stop_token_and_max_tokens_finish_requests_and_free_their_blocks():
    s = make_scheduler()
    eos = make_request("eos", 6, 10)
    eos.params.ignore_eos = False
    capped = make_request("capped", 6, 1, first_token=500)
    for r in (eos, capped):
        s.add(r)
    sched = s.schedule()
    s.update_from_output(sched, sample(sched, token=EOS), no_stop_strings)
    assert eos.status is RequestStatus.FINISHED_STOPPED
    assert capped.status is RequestStatus.FINISHED_LENGTH
    assert eos.block_table == capped.block_table == [] and s.bm.num_used_blocks == 0


def test_stop_string_ends_the_request_at_the_token_that_completes_it():
    s = make_scheduler()
    req = make_request("stop", 6, 10, stop=["xy"])
    s.add(req)
    sched = s.schedule()
    s.update_from_output(sched, sample(sched), no_stop_strings)
    req.spec_token_ids = [11, 12, 13]
    sched = s.schedule()
    seen = []

    def stop_after_two_tokens(r: Request):
        seen.append(r.num_output_tokens)
        return "xy" if r.num_output_tokens == 3 else None

    updates = s.update_from_output(sched, sample(sched, agree_with_drafts=3), stop_after_two_tokens)
    assert seen == [2, 3]  # checked per token: accepted drafts past the stop are dropped
    assert updates[0].new_token_ids == [11, 12] and updates[0].stop_string == "xy"
    assert req.status is RequestStatus.FINISHED_STOPPED and req.block_table == []


def test_a_failing_stop_check_fails_only_its_own_request():
    s = make_scheduler()
    bad = make_request("bad", 6, 5, stop=["boom"])
    good = make_request("good", 6, 5, first_token=500)
    for r in (bad, good):
        s.add(r)

    def broken(req: Request):
        raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")

    sched = s.schedule()
    s.update_from_output(sched, sample(sched), broken)
    assert bad.status is RequestStatus.FINISHED_ERROR and "invalid start byte" in bad.error
    assert bad.block_table == []
    assert good.status is RequestStatus.RUNNING and good.num_output_tokens == 1


def test_sampled_errors_fail_only_the_named_requests():
    s = make_scheduler()
    reqs = [make_request(f"r{i}", 5, 3, first_token=100 * (i + 1)) for i in range(3)]
    for r in reqs:
        s.add(r)
    sched = s.schedule()
    sampled = sample(sched)
    sampled.errors["r1"] = "internal error: bad row"
    updates = s.update_from_output(sched, sampled, no_stop_strings)
    assert [u.request.request_id for u in updates] == ["r0", "r1", "r2"]
    assert (
        reqs[1].status is RequestStatus.FINISHED_ERROR
        and reqs[1].error == "internal error: bad row"
    )
    assert reqs[0].num_output_tokens == reqs[2].num_output_tokens == 1
    assert reqs[1].block_table == []


def test_prefix_cache_hit_skips_cached_blocks_but_recomputes_the_last_token():
    s = make_scheduler()
    first = make_request("first", 12, 1)
    run_to_completion(s, [first])
    again = make_request("again", 12, 1)  # the same 12 prompt tokens
    s.add(again)
    sched = s.schedule()
    assert again.num_cached_tokens == 8  # two full blocks of 4; the last block holds the last token
    assert sched.scheduled[0].num_new_tokens == 4


def step(s, every: list) -> list:
    """One step; the (request id, new tokens) it scheduled."""
    sched = s.schedule()
    check_step(s, sched, every)
    s.update_from_output(sched, sample(sched), no_stop_strings)
    return [(i.request.request_id, i.num_new_tokens) for i in sched.scheduled]


def test_a_request_queued_with_a_prefix_being_computed_waits_for_it_instead_of_recomputing():
    """B shares A's six-block prompt prefix and is queued with A: it waits while A computes
    the prefix (the budget goes to C meanwhile) and then takes all six blocks from the cache,
    as vLLM's engine reuses blocks it schedules in the same step."""
    s = make_scheduler(max_num_batched_tokens=32)
    a, b = make_request("a", 24, 2), make_request("b", 28, 2)  # b = a's 24 tokens + 4
    c = make_request("c", 4, 2, first_token=900)
    every = [a, b, c]
    for r in every:
        s.add(r)
    assert step(s, every) == [("a", 24), ("c", 4)]
    assert b.status is RequestStatus.WAITING
    assert ("b", 4) in step(s, every)
    assert b.num_cached_tokens == 24
    assert s.bm.stats.hits == 24


def test_the_wait_for_a_prefix_ends_when_the_request_computing_it_leaves():
    """A long prefill in chunks: B waits for the block A computes next; A is aborted after
    its first chunk, so B takes that chunk's blocks and computes the rest itself."""
    s = make_scheduler(max_num_batched_tokens=16)
    a, b = make_request("a", 40, 2), make_request("b", 44, 2)
    for r in (a, b):
        s.add(r)
    assert step(s, [a, b]) == [("a", 16)]
    assert b.status is RequestStatus.WAITING
    s.finish(a, RequestStatus.FINISHED_ABORTED)
    assert step(s, [b]) == [("b", 16)]
    assert b.num_cached_tokens == 16  # a's first chunk, cached after a left
    while not b.is_finished:
        step(s, [b])
    assert b.status is RequestStatus.FINISHED_LENGTH and s.bm.num_used_blocks == 0


def test_static_batching_pads_to_the_batch_size_and_the_longest_prompt():
    s = make_scheduler(batching="static", max_batch_size=4, max_num_batched_tokens=256)
    short, long = make_request("short", 3, 2), make_request("long", 7, 4, first_token=500)
    for r in (short, long):
        s.add(r)
    sched = s.schedule()
    assert sched.padding.padded_prompt_len == 7 and sched.padding.num_padding_seqs == 2
    assert sched.padding.row_lengths(sched.scheduled) == [
        4,
        7,
        7,
    ]  # 7-3 padded tokens, 2 empty rows
    s.update_from_output(sched, sample(sched), no_stop_strings)
    s.add(make_request("late", 3, 1, first_token=900))
    steps = 1
    while short.num_output_tokens < 2 or long.num_output_tokens < 4:
        sched = s.schedule()
        assert "late" not in [i.request.request_id for i in sched.scheduled]  # waits for the batch
        s.update_from_output(sched, sample(sched), no_stop_strings)
        steps += 1
    assert steps == 4 and short.is_finished and long.is_finished
    sched = s.schedule()
    assert [i.request.request_id for i in sched.scheduled] == ["late"]


def test_dynamic_batching_waits_for_a_full_batch_or_the_delay_window():
    s = make_scheduler(batching="dynamic", max_batch_size=3, max_queue_delay_ms=50)
    assert s.next_wakeup() is None
    s.add(make_request("a", 4, 1))
    assert s.schedule().is_empty
    wake = s.next_wakeup()
    assert wake is not None and wake > time.monotonic()
    time.sleep(max(wake - time.monotonic(), 0) + 0.005)
    sched = s.schedule()
    assert [i.request.request_id for i in sched.scheduled] == ["a"]
    assert sched.padding.num_padding_seqs == 0  # dynamic computes only the rows it formed with


def test_continuous_scheduler_never_asks_to_be_woken():
    s = make_scheduler()
    s.add(make_request("a", 4, 1))
    assert s.next_wakeup() is None
