"""Scheduling policies: FIFO, priority (with preemption of less urgent running requests)
and shortest-job-first, and aging so a long or low-priority request is not starved.

The scheduler's clock is replaced by a fake one that advances a fixed amount per engine
step, so aging is measured in steps and the tests do not depend on the machine's speed.
"""
from __future__ import annotations

import types

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from support import hf_greedy, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)
STEP_SECONDS = 0.1  # fake time per engine step


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    module = types.SimpleNamespace(monotonic=fake.monotonic)
    for name in ("slipstream.core.scheduler", "slipstream.core.request"):
        monkeypatch.setattr(f"{name}.time", module)
    return fake


def make_engine(**overrides) -> LLMEngine:
    settings = dict(model=str(tiny_model_dir("llama")), block_size=4, max_num_batched_tokens=64,
                    max_num_seqs=1, max_model_len=256, num_gpu_blocks_override=200,
                    trace_steps=True)
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


def prompt(i: int, length: int = 6) -> list:
    return [1000 + 37 * i + k for k in range(length)]


def add_all(engine: LLMEngine, clock: FakeClock, specs: list) -> list:
    """Add (max_tokens, priority) requests in order, 1 ms of fake time apart."""
    reqs = []
    for i, (max_tokens, priority) in enumerate(specs):
        reqs.append(engine.add_request(prompt(i), SamplingParams(max_tokens=max_tokens, **GREEDY),
                                       request_id=f"r{i}", priority=priority))
        clock.now += 0.001
    return reqs


def run(engine: LLMEngine, clock: FakeClock, arrivals=None, max_steps: int = 2000) -> dict:
    """Step until idle; ``arrivals(step)`` may add requests before each step.
    Returns request id -> step at which it finished."""
    finished = {}
    for step in range(max_steps):
        if arrivals is not None:
            arrivals(step)
        if not engine.has_unfinished():
            break
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = step
        clock.now += STEP_SECONDS
    assert not engine.has_unfinished(), "the workload did not drain"
    return finished


def first_scheduled(engine: LLMEngine) -> dict:
    """request id -> the first step it ran in (from the step trace)."""
    first = {}
    for rec in engine.tracer.records:
        for e in rec.entries:
            first.setdefault(e.request_id, rec.step)
    return first


def completion_order(finished: dict) -> list:
    return sorted(finished, key=finished.get)


SPECS = [(8, 2), (2, 0), (5, 3), (1, 1)]  # (max_tokens, priority) of r0..r3


def test_fifo_serves_in_arrival_order(clock):
    engine = make_engine(policy="fifo")
    add_all(engine, clock, SPECS)
    assert completion_order(run(engine, clock)) == ["r0", "r1", "r2", "r3"]


def test_priority_serves_lower_value_first(clock):
    engine = make_engine(policy="priority")
    add_all(engine, clock, SPECS)
    assert completion_order(run(engine, clock)) == ["r1", "r3", "r0", "r2"]


def test_priority_ties_are_fifo(clock):
    engine = make_engine(policy="priority")
    add_all(engine, clock, [(3, 1), (1, 0), (2, 1), (1, 1)])
    assert completion_order(run(engine, clock)) == ["r1", "r0", "r2", "r3"]


def test_sjf_serves_fewest_requested_tokens_first(clock):
    engine = make_engine(policy="sjf")
    add_all(engine, clock, SPECS)
    assert completion_order(run(engine, clock)) == ["r3", "r1", "r2", "r0"]


# -- preemption by a more urgent arrival ----------------------------------------------------
LOW = [list(range(2000 + 100 * i, 2016 + 100 * i)) for i in range(2)]  # 16 tokens each
URGENT = list(range(5000, 5040))  # 40 tokens = 10 blocks of 4


def urgent_arrival(policy: str, mode: str, clock: FakeClock) -> tuple:
    """Two low-priority requests fill most of a 20-block cache, then an urgent request
    arrives that needs more blocks than are free."""
    engine = make_engine(policy=policy, max_num_seqs=4, num_gpu_blocks_override=20,
                         enable_prefix_caching=False, aging_seconds=0, preemption_mode=mode)
    params = SamplingParams(max_tokens=20, **GREEDY)
    for i, p in enumerate(LOW):
        engine.add_request(p, params, request_id=f"low{i}", priority=5)
    for _ in range(7):  # both running, 22 tokens computed each: 12 blocks used, 8 free
        assert not any(out.finished for out in engine.step())
        clock.now += STEP_SECONDS
    assert engine.block_manager.num_free_blocks < 10
    finished = {}
    arrival = engine.stats.steps
    engine.add_request(URGENT, SamplingParams(max_tokens=5, **GREEDY), request_id="urgent",
                       priority=0)
    for rid, step in run(engine, clock).items():
        finished[rid] = step + arrival
    return engine, arrival, finished


def check_outputs_and_blocks(engine: LLMEngine, outputs: dict) -> None:
    path = tiny_model_dir("llama")
    assert outputs["urgent"] == hf_greedy(path, URGENT, 5)
    for i, p in enumerate(LOW):
        assert outputs[f"low{i}"] == hf_greedy(path, p, 20)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("policy, mode", [("priority", "recompute"), ("priority", "swap"),
                                          ("fifo", "recompute")])
def test_urgent_arrival_preempts_less_urgent_running_request(clock, monkeypatch, policy, mode):
    outputs: dict = {}
    original_step = LLMEngine.step

    def step(self):
        outs = original_step(self)
        for out in outs:
            outputs.setdefault(out.request_id, []).extend(out.token_ids)
        return outs

    monkeypatch.setattr(LLMEngine, "step", step)
    engine, arrival, finished = urgent_arrival(policy, mode, clock)
    first = first_scheduled(engine)
    preempted = {r.step: r.preempted for r in engine.tracer.records if r.preempted}
    if policy == "priority":
        # Admitted in the very step after it arrived, by evicting a low-priority request.
        assert first["urgent"] == arrival
        assert preempted.get(arrival) and set(preempted[arrival]) <= {"low0", "low1"}
        assert finished["urgent"] < min(finished["low0"], finished["low1"])
        if mode == "swap":
            pool = engine.scheduler.swap
            assert pool.stats.swap_outs > 0 and pool.stats.swap_ins == pool.stats.swap_outs
            assert pool.num_used_blocks == 0
    else:
        # FIFO never evicts an earlier arrival for a later one: the urgent request waits.
        assert first["urgent"] > arrival
        assert arrival not in preempted
    check_outputs_and_blocks(engine, outputs)


# -- aging: no starvation -----------------------------------------------------------------
def starvation_run(policy: str, aging_seconds: float, clock: FakeClock,
                   stream_steps: int = 60) -> tuple:
    """One big (sjf: long; priority: low-priority) request arrives with a continuous stream
    of small urgent ones, one per step, for ``stream_steps`` steps.
    Returns (step the big request finished, step the last small one finished)."""
    engine = make_engine(policy=policy, aging_seconds=aging_seconds)
    big = SamplingParams(max_tokens=10, **GREEDY)
    small = SamplingParams(max_tokens=1, **GREEDY)
    engine.add_request(prompt(0), big, request_id="big", priority=1)
    clock.now += 0.001

    def arrivals(step: int) -> None:
        if step < stream_steps:
            engine.add_request(prompt(step + 1), small, request_id=f"s{step}", priority=0)

    finished = run(engine, clock, arrivals)
    assert len(finished) == stream_steps + 1
    return finished["big"], max(v for k, v in finished.items() if k != "big")


# Aging rates that make the big request one step-10 overtake: it is one class behind each
# small request under priority, and (16 - 7) / 64 of a class under sjf (sizes in tokens).
AGING = {"priority": 1.0, "sjf": 7.0}


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_aging_bounds_the_wait_of_a_big_request(clock, policy):
    # A step is 0.1 s of fake time: after ~10 steps of waiting the big request outranks a
    # fresh small one, runs its 10 steps, and the stream resumes.
    done, last_small = starvation_run(policy, aging_seconds=AGING[policy], clock=clock)
    assert done <= 25
    assert done < last_small  # served while the stream was still going


@pytest.mark.parametrize("policy", ["sjf", "priority"])
def test_without_aging_a_big_request_starves_while_small_ones_keep_coming(clock, policy):
    done, last_small = starvation_run(policy, aging_seconds=0, clock=clock)
    assert done > last_small  # it ran only after the stream of small requests stopped
    assert done >= 60
