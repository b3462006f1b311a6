"""The engine loop's own safety: text prompts are tokenized off the caller's thread, an engine
that fails step after step (or whose thread crashes) ends every request at once and refuses
new ones, and the supervisor brings a fresh engine back."""

from __future__ import annotations

import threading
import time

import pytest

from slipstream import SamplingParams
from slipstream.core.request import FinishReason, RequestOutput
from slipstream.engine import merge_output
from slipstream.engine.loop import EngineDeadError, EngineLoop, HealthState
from slipstream.engine.supervisor import EngineSupervisor
from engine_support import GREEDY, config


def collect(stream, timeout=60):
    total = RequestOutput(stream.request_id)
    deadline = time.monotonic() + timeout
    while not stream.finished:
        merge_output(total, stream.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return total


def test_text_prompt_is_refused_through_its_stream_after_tokenizing(loop):
    stream = loop.submit("word " * 400, SamplingParams(max_tokens=4))
    out = collect(stream)
    assert out.finish_reason is FinishReason.ERROR and "max_model_len" in out.error
    assert isinstance(stream.rejection, ValueError)
    assert (
        loop.generate("still fine", SamplingParams(max_tokens=3, **GREEDY)).num_output_tokens == 3
    )


def test_a_long_prompt_never_delays_another_submission(loop, monkeypatch):
    """The caller (Triton's execute) only queues a text prompt: a slow tokenization happens
    on the tokenizer thread while other requests are submitted and served."""
    engine = loop.engine.input_processor  # tokenizing is the input processor's
    original = engine._tokenize
    release = threading.Event()

    def slow(prompt, *args, **kwargs):  # runs holding the tokenizer's lock
        if isinstance(prompt, str) and prompt.startswith("slow"):
            release.wait(10)
        return original(prompt, *args, **kwargs)

    monkeypatch.setattr(engine, "_tokenize", slow)
    started = time.perf_counter()
    held = loop.submit("slow prompt", SamplingParams(max_tokens=2, **GREEDY))
    assert time.perf_counter() - started < 0.5
    quick = loop.submit(
        [5, 6, 7], SamplingParams(max_tokens=3, **GREEDY)
    )  # token ids: no tokenizer
    assert collect(quick).num_output_tokens == 3
    assert not held.finished
    release.set()
    assert collect(held).num_output_tokens == 2


def test_abort_before_the_engine_has_the_request(loop, monkeypatch):
    engine = loop.engine.input_processor  # tokenizing is the input processor's
    original = engine._tokenize
    gate = threading.Event()
    monkeypatch.setattr(
        engine, "_tokenize", lambda p, *a, **k: (gate.wait(10), original(p, *a, **k))[1]
    )
    first = loop.submit("blocked one", SamplingParams(max_tokens=50, **GREEDY))
    second = loop.submit("blocked two", SamplingParams(max_tokens=50, **GREEDY))
    loop.abort(second.request_id)
    loop.abort(first.request_id)
    gate.set()
    for stream in (first, second):
        assert collect(stream).finish_reason is FinishReason.ABORT
    deadline = time.monotonic() + 10
    while loop.stats().kv_blocks_used and time.monotonic() < deadline:
        time.sleep(0.01)
    assert loop.stats().kv_blocks_used == 0


def test_engine_failing_every_step_dies_ends_everything_and_refuses_new_requests():
    deaths = []
    lp = EngineLoop(config(), on_dead=deaths.append, failure_threshold=3).start()
    try:

        def broken(sched):
            raise RuntimeError("device lost")

        lp.engine.runner.execute = broken
        for i in range(3):  # one request per step: each fails, the third failure is fatal
            assert lp.health().ok
            out = collect(lp.submit(f"request {i}", SamplingParams(max_tokens=20, **GREEDY)))
            assert out.finish_reason is FinishReason.ERROR and "device lost" in out.error
        deadline = time.monotonic() + 10
        while lp.health().state is not HealthState.DEAD and time.monotonic() < deadline:
            time.sleep(0.01)
        health = lp.health()
        assert health.state is HealthState.DEAD and "device lost" in health.error
        assert deaths and deaths[0].state is HealthState.DEAD
        with pytest.raises(EngineDeadError, match="not serving"):
            lp.submit("late", SamplingParams())
    finally:
        lp.shutdown()
    assert lp.health().state is HealthState.DEAD  # shutdown does not hide why it died


def test_a_crashed_loop_thread_ends_every_stream():
    class Crash(BaseException):
        pass

    lp = EngineLoop(config()).start()
    try:
        running = lp.submit([5, 6, 7], SamplingParams(max_tokens=200, **GREEDY))
        running.get(timeout=30)

        def crash():
            raise Crash("segfault-like")

        lp.engine.step = crash
        out = collect(running, timeout=30)
        assert out.finish_reason is FinishReason.ERROR and "engine loop crashed" in out.error
        assert lp.health().state is HealthState.DEAD
    finally:
        lp.shutdown()


def test_supervisor_restarts_a_dead_engine_and_serves_again():
    supervisor = EngineSupervisor(lambda: config(), failure_threshold=2, restart_backoff_s=0.0)
    supervisor.start()
    try:
        first = supervisor.loop
        first.engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("boom"))
        failed = collect(supervisor.submit([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY)))
        assert failed.finish_reason is FinishReason.ERROR
        collect(supervisor.submit([8, 9], SamplingParams(max_tokens=5, **GREEDY)))
        deadline = time.monotonic() + 60
        while (
            supervisor.loop is first or not supervisor.health().ok
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.health().ok and supervisor.restarts == 1
        out = collect(supervisor.submit([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY)))
        assert out.finish_reason is FinishReason.LENGTH and out.num_output_tokens == 5
    finally:
        supervisor.shutdown()


def test_supervisor_gives_up_after_too_many_restarts():
    gave_up = threading.Event()
    builds = []

    def broken_config():
        builds.append(1)
        if len(builds) > 1:
            return config(model="/no/such/model")
        return config()

    supervisor = EngineSupervisor(
        broken_config,
        failure_threshold=1,
        restart_backoff_s=0.0,
        max_restarts=2,
        on_give_up=lambda health: gave_up.set(),
    )
    supervisor.start()
    try:
        supervisor.loop.engine.runner.execute = lambda sched: (_ for _ in ()).throw(
            RuntimeError("boom")
        )
        collect(supervisor.submit([5, 6, 7], SamplingParams(max_tokens=5, **GREEDY)))
        assert gave_up.wait(60)
        assert not supervisor.health().ok
        with pytest.raises(EngineDeadError):
            supervisor.submit([1, 2], SamplingParams())
    finally:
        supervisor.shutdown()


def test_a_restarted_engine_tells_kv_event_consumers_its_cache_is_empty():
    """The sink outlives engines (the publisher keeps its sequence numbers): the engine that
    replaces a dead one starts with AllBlocksCleared, so routers forget the old blocks."""
    from slipstream.core.kv_cache_events import AllBlocksCleared, BlockStored

    events: list = []
    supervisor = EngineSupervisor(
        lambda: config(prefix_caching_hash_algo="sha256_cbor"),
        failure_threshold=2,
        restart_backoff_s=0.0,
        engine_kwargs={"kv_event_sink": events.extend},
    )
    supervisor.start()
    try:
        first = supervisor.loop
        collect(supervisor.submit(list(range(5, 40)), SamplingParams(max_tokens=2, **GREEDY)))
        assert events[0] == AllBlocksCleared()
        assert any(isinstance(e, BlockStored) for e in events)
        seen = len(events)
        first.engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("boom"))
        for prompt in ([50, 51, 52], [60, 61]):
            collect(supervisor.submit(prompt, SamplingParams(max_tokens=5, **GREEDY)))
        deadline = time.monotonic() + 60
        while (
            supervisor.loop is first or not supervisor.health().ok
        ) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert supervisor.restarts == 1
        assert AllBlocksCleared() in events[seen:]
    finally:
        supervisor.shutdown()
