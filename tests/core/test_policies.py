"""Scheduling policies: FIFO, priority (with preemption of less urgent running requests)
and shortest-job-first, and aging so a long or low-priority request is not starved.

Model-free (``scheduler_support``): a real scheduler and block manager, the worker replaced
by ``sample``. The clock is a fake one that advances a fixed amount per step, so aging is
measured in steps and the tests do not depend on the machine's speed. One engine test at the
end checks that requests preempted for an urgent one still produce the model's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import Request
from slipstream.core.scheduler import SchedulerBase
from slipstream.engine import LLMEngine
from scheduler_support import (
    FakeClock,
    check_step,
    make_request,
    make_scheduler,
    no_stop_strings,
    sample,
)
from support import hf_greedy, tiny_model_dir

STEP_SECONDS = 0.1  # fake time per step
# max_num_seqs=1: one request runs at a time, so the completion order is the service order.
ONE_AT_A_TIME = dict(block_size=4, max_num_batched_tokens=64, max_num_seqs=1, max_model_len=256)


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    return FakeClock().install(monkeypatch)


@dataclass
class Run:
    """What a run of the scheduler did, step by step."""

    finished: dict[str, int] = field(default_factory=dict)  # request id -> step it finished
    first: dict[str, int] = field(default_factory=dict)  # request id -> first step it ran in
    preempted: dict[int, list[str]] = field(default_factory=dict)  # step -> victims' ids
    steps: int = 0

    def completion_order(self) -> list[str]:
        return sorted(self.finished, key=self.finished.__getitem__)


def step_once(s: SchedulerBase, clock: FakeClock, run: Run, every: list[Request]) -> None:
    sched = s.schedule()
    if sched.preempted:
        run.preempted[run.steps] = [r.request_id for r in sched.preempted]
    for item in sched.scheduled:
        run.first.setdefault(item.request.request_id, run.steps)
    for update in s.update_from_output(sched, sample(sched), no_stop_strings):
        if update.request.is_finished:
            run.finished[update.request.request_id] = run.steps
    check_step(s, sched, every)
    run.steps += 1
    clock.now += STEP_SECONDS


def run_until_idle(
    s: SchedulerBase,
    clock: FakeClock,
    every: list[Request],
    arrivals=None,
    run: Run | None = None,
    max_steps: int = 2000,
) -> Run:
    """Step until idle; ``arrivals(step)`` may return requests to add before each step."""
    run = run or Run()
    while run.steps < max_steps:
        for req in arrivals(run.steps) if arrivals is not None else []:
            s.add(req)
            every.append(req)
        if not s.has_work():
            break
        step_once(s, clock, run, every)
    assert not s.has_work(), "the workload did not drain"
    return run


def add_all(s: SchedulerBase, clock: FakeClock, specs: list[tuple[int, int]]) -> list[Request]:
    """Add (max_tokens, priority) requests of 6-token prompts in order, 1 ms of fake time
    apart."""
    reqs = []
    for i, (max_tokens, priority) in enumerate(specs):
        req = make_request(f"r{i}", 6, max_tokens, first_token=1000 + 37 * i, priority=priority)
        s.add(req)
        reqs.append(req)
        clock.now += 0.001
    return reqs


SPECS = [(8, 2), (2, 0), (5, 3), (1, 1)]  # (max_tokens, priority) of r0..r3


@pytest.mark.parametrize(
    "policy, specs, order",
    [
        ("fifo", SPECS, ["r0", "r1", "r2", "r3"]),
        ("priority", SPECS, ["r1", "r3", "r0", "r2"]),  # a lower priority value first
        ("priority", [(3, 1), (1, 0), (2, 1), (1, 1)], ["r1", "r0", "r2", "r3"]),  # ties: FIFO
        ("sjf", SPECS, ["r3", "r1", "r2", "r0"]),  # fewest requested tokens first
    ],
    ids=[
        "fifo-arrival-order",
        "priority-lower-value-first",
        "priority-ties-fifo",
        "sjf-fewest-tokens-first",
    ],
)
def test_policy_serves_requests_in_its_order(clock, policy, specs, order):
    s = make_scheduler(num_blocks=200, policy=policy, **ONE_AT_A_TIME)
    reqs = add_all(s, clock, specs)
    assert run_until_idle(s, clock, reqs).completion_order() == order
    assert s.bm.num_used_blocks == 0


# -- preemption by a more urgent arrival ----------------------------------------------------
def urgent_arrival(policy: str, mode: str, clock: FakeClock) -> tuple[SchedulerBase, Run, int]:
    """Two low-priority requests (16-token prompts) fill most of a 20-block cache, then an
    urgent request arrives (40 tokens: 10 blocks of 4) that needs more blocks than are free.
    Returns the scheduler, the run and the step the urgent request arrived before."""
    s = make_scheduler(
        num_blocks=20,
        policy=policy,
        max_num_seqs=4,
        max_num_batched_tokens=64,
        enable_prefix_caching=False,
        aging_seconds=0,
        preemption_mode=mode,
        swap_blocks=32,
    )
    low = [
        make_request(f"low{i}", 16, 20, first_token=2000 + 100 * i, priority=5) for i in range(2)
    ]
    for req in low:
        s.add(req)
    run = Run()
    every = list(low)
    for _ in range(7):  # both running, 22 tokens computed each: 12 blocks used, 7 free
        step_once(s, clock, run, every)
    assert not run.finished and s.bm.num_free_blocks < 10
    arrival = run.steps
    urgent = make_request("urgent", 40, 5, first_token=5000, priority=0)
    s.add(urgent)
    every.append(urgent)
    return s, run_until_idle(s, clock, every, run=run), arrival


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_priority_urgent_arrival_preempts_a_less_urgent_running_request(clock, mode):
    s, run, arrival = urgent_arrival("priority", mode, clock)
    # Admitted in the very step after it arrived, by evicting a low-priority request.
    assert run.first["urgent"] == arrival
    assert run.preempted.get(arrival) and set(run.preempted[arrival]) <= {"low0", "low1"}
    assert run.finished["urgent"] < min(run.finished["low0"], run.finished["low1"])
    if mode == "swap":
        assert s.swap.stats.swap_outs > 0 and s.swap.stats.swap_ins == s.swap.stats.swap_outs
        assert s.swap.num_used_blocks == 0
    assert s.bm.num_used_blocks == 0


def test_fifo_never_preempts_an_earlier_arrival_for_a_later_one(clock):
    s, run, arrival = urgent_arrival("fifo", "recompute", clock)
    assert run.first["urgent"] > arrival  # the urgent request waits for room
    assert arrival not in run.preempted
    assert run.finished["urgent"] > max(run.finished["low0"], run.finished["low1"])


# -- aging: no starvation -----------------------------------------------------------------
def starvation_run(
    policy: str, aging_seconds: float, clock: FakeClock, stream_steps: int = 60
) -> tuple[int, int]:
    """One big (sjf: long; priority: low-priority) request arrives with a continuous stream
    of small urgent ones, one per step, for ``stream_steps`` steps.
    Returns (step the big request finished, step the last small one finished)."""
    s = make_scheduler(num_blocks=200, policy=policy, aging_seconds=aging_seconds, **ONE_AT_A_TIME)
    big = make_request("big", 6, 10, first_token=1000, priority=1)
    s.add(big)
    clock.now += 0.001

    def arrivals(step: int) -> list[Request]:
        if step >= stream_steps:
            return []
        return [make_request(f"s{step}", 6, 1, first_token=1000 + 37 * (step + 1), priority=0)]

    finished = run_until_idle(s, clock, [big], arrivals).finished
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


# -- the engine: preempted requests still produce the model's tokens ----------------------
LOW = [list(range(2000 + 100 * i, 2016 + 100 * i)) for i in range(2)]  # 16 tokens each
URGENT = list(range(5000, 5040))  # 40 tokens = 10 blocks of 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_requests_preempted_for_an_urgent_one_still_match_hf_greedy(mode):
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=4,
            max_num_batched_tokens=64,
            max_num_seqs=4,
            max_model_len=256,
            num_gpu_blocks_override=20,
            policy="priority",
            enable_prefix_caching=False,
            aging_seconds=0,
            preemption_mode=mode,
        )
    )
    greedy = dict(temperature=0, ignore_eos=True)
    outputs: dict[str, list[int]] = {}

    def step() -> None:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(out.token_ids)

    for i, p in enumerate(LOW):
        engine.add_request(
            p, SamplingParams(max_tokens=20, **greedy), request_id=f"low{i}", priority=5
        )
    for _ in range(7):
        step()
    engine.add_request(
        URGENT, SamplingParams(max_tokens=5, **greedy), request_id="urgent", priority=0
    )
    while engine.has_unfinished():
        step()
    assert engine.scheduler.num_preemptions > 0  # the urgent request did evict one
    path = tiny_model_dir("llama")
    assert outputs["urgent"] == hf_greedy(path, URGENT, 5)
    for i, p in enumerate(LOW):
        assert outputs[f"low{i}"] == hf_greedy(path, p, 20)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
