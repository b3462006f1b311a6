"""A failing engine is told from a failing request: a forward (or sampler) that fails for
every request, batched or one after another, makes the engine DEAD; one request that alone
breaks the forward fails alone and the engine serves on. In-process (the loop and its rule);
tests/test_engine_faults.py shows the same through a real tritonserver."""

from __future__ import annotations

import time

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import FinishReason, RequestOutput
from slipstream.engine import merge_output
from slipstream.engine.health import Health, HealthState, StepFailures
from slipstream.engine.loop import EngineLoop
from support import tiny_engine_config

GREEDY = dict(temperature=0, ignore_eos=True)
POISON_LEN = 40  # prompts this long break the forward (a fault of one request's own)


def config(**overrides) -> EngineConfig:
    return tiny_engine_config(max_num_batched_tokens=256, **overrides)


def collect(stream, timeout=60) -> RequestOutput:
    total = RequestOutput(stream.request_id)
    deadline = time.monotonic() + timeout
    while not stream.finished:
        merge_output(total, stream.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return total


def out(rid: str, reason=None) -> RequestOutput:
    error = "internal error: boom" if reason is FinishReason.ERROR else None
    return RequestOutput(rid, finished=reason is not None, finish_reason=reason, error=error)


def wait_dead(loop, timeout=10.0) -> bool:
    deadline = time.monotonic() + timeout
    while loop.health().state is not HealthState.DEAD and time.monotonic() < deadline:
        time.sleep(0.01)
    return loop.health().state is HealthState.DEAD


# ----------------------------------------------------------------------------- the rule
def test_k_failed_steps_each_holding_another_request_are_fatal():
    rule, health = StepFailures(3), Health(HealthState.HEALTHY)
    for i in range(3):
        health, death = rule.record(health, [out(f"r{i}", FinishReason.ERROR)], None)
    assert death is not None and "3 engine steps in a row failed" in death


def test_k_requests_failing_in_one_step_are_fatal():
    """A batch retried one request at a time: each fails alone, in one failed step."""
    rule, health = StepFailures(3), Health(HealthState.HEALTHY)
    failed = [out(f"r{i}", FinishReason.ERROR) for i in range(3)]
    health, death = rule.record(health, failed, None)
    assert death is not None and "3 requests in a row failed in the engine" in death


def test_a_request_served_in_between_closes_the_window():
    rule, health = StepFailures(3), Health(HealthState.HEALTHY)
    for i in range(10):
        health, death = rule.record(health, [out(f"bad{i}", FinishReason.ERROR)], None)
        assert death is None
        health, death = rule.record(health, [out(f"ok{i}")], None)
        assert death is None and health.consecutive_failures == 0
    # failing beside requests that are served is a request's own fault
    mixed = [out("bad", FinishReason.ERROR), out("a"), out("b")]
    for _ in range(10):
        health, death = rule.record(health, mixed, None)
        assert death is None


def test_steps_without_outputs_say_nothing():
    rule, health = StepFailures(2), Health(HealthState.HEALTHY)
    health, _ = rule.record(health, [out("r0", FinishReason.ERROR)], None)
    for _ in range(5):
        health, death = rule.record(health, [], None)
        assert death is None and health.consecutive_failures == 1


# ----------------------------------------------------------------------------- the loop
@pytest.mark.parametrize("where", ["forward", "sampler"])
def test_a_fault_failing_every_request_of_a_batch_kills_the_engine_at_once(where):
    """Five requests decoding together, then the forward (or sampler) fails for all of them:
    each fails alone in one step. Before: one failed step of five, the engine stayed HEALTHY
    and took the next requests, failing them one by one."""
    deaths = []
    loop = EngineLoop(config(), on_dead=deaths.append).start()
    try:
        streams = [
            loop.submit([5 + i, 6, 7], SamplingParams(max_tokens=200, **GREEDY)) for i in range(5)
        ]
        for stream in streams:
            stream.get(timeout=60)  # each is decoding
        engine = loop.engine
        if where == "forward":
            engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("lost"))
        else:
            engine.sampler._sample = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("lost"))
        outs = [collect(stream) for stream in streams]
        assert all(o.finish_reason is FinishReason.ERROR and "lost" in o.error for o in outs)
        assert wait_dead(loop), loop.health()
        assert "requests in a row failed in the engine" in loop.health().error
        assert deaths and deaths[0].state is HealthState.DEAD
    finally:
        loop.shutdown()


def test_one_request_that_alone_breaks_the_forward_fails_alone_and_the_engine_serves_on():
    loop = EngineLoop(config()).start()
    try:
        real = loop.engine.runner.execute

        def execute(sched):
            if any(item.request.num_prompt_tokens >= POISON_LEN for item in sched.scheduled):
                raise RuntimeError("this request breaks the forward")
            return real(sched)

        loop.engine.runner.execute = execute
        poison = list(range(5, 5 + POISON_LEN))
        for round_ in range(8):  # past the threshold (5), alone and beside good requests
            good = [
                loop.submit([9 + i, round_ + 1], SamplingParams(max_tokens=6, **GREEDY))
                for i in range(round_ % 3)
            ]
            bad = collect(loop.submit(poison, SamplingParams(max_tokens=6, **GREEDY)))
            assert bad.finish_reason is FinishReason.ERROR and "breaks the forward" in bad.error
            for stream in good:
                assert collect(stream).finish_reason is FinishReason.LENGTH
            served = collect(loop.submit([3, round_ + 2], SamplingParams(max_tokens=3, **GREEDY)))
            assert served.finish_reason is FinishReason.LENGTH and served.num_output_tokens == 3
            assert loop.health().ok, loop.health()
    finally:
        loop.shutdown()
