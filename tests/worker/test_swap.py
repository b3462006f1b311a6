"""Preemption by swap: KV blocks go to the CPU pool and come back bit-exact."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import RequestStatus
from slipstream.core.scheduler_output import SchedulerOutput, SwapDirection
from slipstream.engine import LLMEngine
from support import random_workload, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)
# 10 requests of 10-70 prompt tokens and up to 40 outputs need ~100 blocks of 4 at once.
PROMPTS, OUTS = random_workload(10, seed=5, lengths=(10, 30, 50, 70), max_out=40)
# A shared 24-token prefix makes prefix-cache blocks (ref_count > 1) part of what is swapped.
SHARED = [random.Random(1).randrange(100, 40000) for _ in range(24)]
PREFIXED = [SHARED + p[:20] for p in PROMPTS]


def make_engine(**overrides) -> LLMEngine:
    settings = dict(
        model=str(tiny_model_dir("llama")),
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=512,
        num_gpu_blocks_override=400,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def params():
    return [SamplingParams(max_tokens=o, **GREEDY) for o in OUTS]


@pytest.fixture(scope="module")
def reference():
    """Outputs with a KV cache large enough that nothing is ever preempted."""
    engine = make_engine()
    plain = [r.token_ids for r in engine.generate(PROMPTS, params())]
    prefixed = [r.token_ids for r in engine.generate(PREFIXED, params())]
    assert engine.scheduler.num_preemptions == 0
    return {"plain": plain, "prefixed": prefixed}


def assert_clean(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    pool = engine.scheduler.swap
    pool.check_invariants()
    assert pool.num_used_blocks == 0 and not pool.swapped


@pytest.mark.parametrize("mode", ["swap", "auto"])
@pytest.mark.parametrize("workload", ["plain", "prefixed"])
def test_swap_preemption_matches_unpreempted_run(reference, mode, workload):
    prompts = PROMPTS if workload == "plain" else PREFIXED
    engine = make_engine(
        num_gpu_blocks_override=45,
        preemption_mode=mode,
        enable_prefix_caching=workload == "prefixed",
    )
    results = engine.generate(prompts, params())
    assert [r.token_ids for r in results] == reference[workload]
    pool = engine.scheduler.swap
    assert pool.stats.swap_outs > 0 and pool.stats.swap_ins == pool.stats.swap_outs
    if mode == "auto":
        # Short contexts are recomputed, long ones swapped (the prefixed prompts are all long).
        recomputed = engine.scheduler.num_preemptions - pool.stats.swap_outs
        assert recomputed > 0 if workload == "plain" else recomputed >= 0
    else:
        assert pool.stats.swap_outs == engine.scheduler.num_preemptions
    assert_clean(engine)


def test_full_pool_falls_back_to_recompute(reference):
    bytes_per_block = make_engine().kv_cache.geometry.bytes_per_block
    engine = make_engine(
        num_gpu_blocks_override=45,
        preemption_mode="swap",
        enable_prefix_caching=False,
        swap_space_bytes=12 * bytes_per_block,
    )
    pool = engine.scheduler.swap
    assert pool.num_cpu_blocks == 12
    results = engine.generate(PROMPTS, params())
    assert [r.token_ids for r in results] == reference["plain"]
    assert pool.stats.refused > 0 and pool.stats.swap_outs > 0
    assert engine.scheduler.num_preemptions > pool.stats.swap_outs
    assert_clean(engine)


def test_swap_roundtrip_is_bit_exact():
    engine = make_engine(num_gpu_blocks_override=20, preemption_mode="swap")
    kv, bm, space = engine.kv_cache, engine.block_manager, engine.scheduler.swap
    kv.data.copy_(torch.randn_like(kv.data))
    req = engine.add_request(list(range(100, 113)), SamplingParams(max_tokens=2, **GREEDY))
    bm.allocate(req, 13)
    req.num_computed_tokens = 13
    before = kv.copy_blocks_out(req.block_table).clone()
    assert space.should_swap(req)
    out = space.swap_out(req)
    assert out.direction is SwapDirection.OUT and len(out.device_blocks) == 4
    assert req.block_table == [] and req.num_computed_tokens == 13
    assert bm.num_used_blocks == 0 and space.num_used_blocks == 4
    engine.swap_pool.copy(out)
    kv.data.zero_()
    bm.allocate(engine.make_request([5] * 9), 9)  # another request takes the freed blocks
    assert space.can_swap_in(req)
    back = space.swap_in(req)
    engine.swap_pool.copy(back)
    assert len(req.block_table) == 4 and space.num_used_blocks == 0
    assert back.device_blocks == req.block_table and back.cpu_blocks == out.cpu_blocks
    assert torch.equal(kv.copy_blocks_out(req.block_table), before)
    space.check_invariants()


def test_swap_copies_run_in_the_order_the_scheduler_decided():
    """A swap-in whose device blocks a swap-out of the same step released must read its
    data after that swap-out has copied the old contents away."""
    engine = make_engine(num_gpu_blocks_override=8, preemption_mode="swap")
    kv, bm, space = engine.kv_cache, engine.block_manager, engine.scheduler.swap
    kv.data.copy_(torch.randn_like(kv.data))
    a = engine.make_request(list(range(100, 108)))
    b = engine.make_request(list(range(200, 208)))
    bm.allocate(b, 8)
    b.num_computed_tokens = 8
    b_data = kv.copy_blocks_out(b.block_table).clone()
    b_out = space.swap_out(b)
    engine.swap_pool.copy(b_out)
    bm.allocate(a, 8)  # a takes the blocks b left
    a.num_computed_tokens = 8
    a_data = kv.copy_blocks_out(a.block_table).clone()
    sched = SchedulerOutput()
    sched.swaps.append(space.swap_out(a))
    sched.swaps.append(space.swap_in(b))
    assert sched.swaps[1].device_blocks == sched.swaps[0].device_blocks  # same blocks reused
    engine.swap_pool.apply(sched)
    assert torch.equal(kv.copy_blocks_out(b.block_table), b_data)
    bm.free_request(b)
    engine.swap_pool.copy(space.swap_in(a))
    assert torch.equal(kv.copy_blocks_out(a.block_table), a_data)


def test_abort_while_swapped_returns_pool_blocks():
    engine = make_engine(
        num_gpu_blocks_override=45, preemption_mode="swap", enable_prefix_caching=False
    )
    reqs = [engine.add_request(p, sp) for p, sp in zip(PROMPTS, params())]
    pool = engine.scheduler.swap
    for _ in range(200):
        engine.step()
        swapped = [r for r in reqs if r.status is RequestStatus.SWAPPED]
        if swapped:
            break
    assert swapped, "the workload should swap something out"
    victim = swapped[0]
    held = len(pool.swapped[victim.request_id])
    used = pool.num_used_blocks
    out = engine.abort(victim.request_id)
    assert out.finished and out.finish_reason == "abort"
    assert pool.num_used_blocks == used - held and victim.request_id not in pool.swapped
    while engine.has_unfinished():
        engine.step()
    assert_clean(engine)


def test_recompute_mode_has_no_pool():
    engine = make_engine(preemption_mode="recompute")
    assert engine.scheduler.swap is None and engine.swap_pool is None


def test_auto_mode_swaps_only_long_contexts():
    engine = make_engine(num_gpu_blocks_override=60, preemption_mode="auto")
    pool, bm = engine.scheduler.swap, engine.block_manager
    assert pool.min_swap_tokens == 16  # max(2 blocks, max_num_batched_tokens // 4)
    short = engine.make_request(list(range(100, 110)))
    long = engine.make_request(list(range(100, 140)))
    for req in (short, long):
        bm.allocate(req, req.num_prompt_tokens)
        req.num_computed_tokens = req.num_prompt_tokens
    assert not pool.should_swap(short) and pool.should_swap(long)
    pool.mode = "swap"
    assert pool.should_swap(short)
    fresh = engine.make_request([1, 2, 3])
    assert not pool.should_swap(fresh)  # nothing computed: nothing to keep
