"""The background engine loop: concurrent submission, streaming, aborts, errors, shutdown."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from slipstream import SamplingParams
from slipstream.core.request import RequestOutput
from slipstream.engine import LLMEngine, merge_output
from slipstream.engine.loop import EngineLoop, OverloadedError
from support import tiny_engine_config

GREEDY = dict(temperature=0, ignore_eos=True)


def config(**overrides):
    return tiny_engine_config(**overrides)


@pytest.fixture(scope="module")
def loop():
    with EngineLoop(config()) as running:
        yield running


def test_threads_get_exactly_their_own_outputs(loop):
    prompts = [f"Request number {i} says" + " hello" * i for i in range(10)]
    reference = LLMEngine(config()).generate(prompts, SamplingParams(max_tokens=10, **GREEDY))
    results = [None] * len(prompts)

    def client(i):
        results[i] = loop.generate(prompts[i], SamplingParams(max_tokens=10, **GREEDY))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for ref, got in zip(reference, results):
        assert got.token_ids == ref.token_ids and got.text == ref.text
        assert got.finish_reason == "length" and got.num_output_tokens == 10


def test_streams_are_incremental(loop):
    stream = loop.submit("Stream me", SamplingParams(max_tokens=8, **GREEDY))
    outs = list(stream)
    assert sum(len(o.token_ids) for o in outs) == 8
    assert len(outs) >= 2 and outs[-1].finished and not any(o.finished for o in outs[:-1])


def test_abort_ends_stream_and_frees_blocks(loop):
    stream = loop.submit("Long one", SamplingParams(max_tokens=200, **GREEDY))
    first = stream.get(timeout=30)
    assert not first.finished
    loop.abort(stream.request_id)
    rest = list(stream)
    assert rest[-1].finish_reason == "abort"
    for _ in range(200):
        if loop.stats().kv_blocks_used == 0 and loop.stats().num_running == 0:
            break
        threading.Event().wait(0.01)
    assert loop.stats().kv_blocks_used == 0


def test_bad_request_raises_in_caller_and_loop_keeps_serving(loop):
    with pytest.raises(ValueError):
        loop.submit("", SamplingParams())
    with pytest.raises(ValueError, match="max_model_len"):
        loop.submit(list(range(100, 400)), SamplingParams())
    assert (
        loop.generate("still fine", SamplingParams(max_tokens=3, **GREEDY)).num_output_tokens == 3
    )


def test_step_error_fails_only_affected_requests():
    """A forward that raises whenever one poisoned request is in the batch: that request
    ends with the error, the two requests batched with it finish exactly as they do alone."""
    params = SamplingParams(max_tokens=12, **GREEDY)
    solo = LLMEngine(config()).generate(["healthy one", "healthy two"], params)
    with EngineLoop(config()) as lp:
        original = lp.engine.runner.execute
        batch_sizes = []

        def poisoned(sched):
            ids = [item.request.request_id for item in sched.scheduled]
            batch_sizes.append(len(ids))
            if "poisoned" in ids and ids_decoded(sched, "poisoned") >= 3:
                raise RuntimeError("boom")
            return original(sched)

        def ids_decoded(sched, rid):
            return next(
                i.request.num_output_tokens for i in sched.scheduled if i.request.request_id == rid
            )

        lp.engine.runner.execute = poisoned
        streams = [
            lp.submit("healthy one", params),
            lp.submit("poisoned prompt", params, request_id="poisoned"),
            lp.submit("healthy two", params),
        ]
        results = []
        for stream in streams:
            total = RequestOutput(stream.request_id)
            for out in stream:
                merge_output(total, out)
            results.append(total)
        first, doomed, second = results
        assert doomed.finish_reason == "error" and "boom" in doomed.error
        assert doomed.num_output_tokens == 3  # it ran fine until it raised
        for got, ref in ((first, solo[0]), (second, solo[1])):
            assert got.finish_reason == "length" and got.error is None
            assert got.token_ids == ref.token_ids and got.text == ref.text
        assert max(batch_sizes) == 3  # they really shared steps with the poisoned request
        assert lp.stats().kv_blocks_used == 0


def test_queue_limit_and_shutdown_abort_everything():
    lp = EngineLoop(config(max_queue_size=2, max_num_seqs=1)).start()
    streams, refused = [], 0
    for i in range(8):
        try:
            streams.append(lp.submit(f"p{i}", SamplingParams(max_tokens=100, **GREEDY)))
        except OverloadedError as exc:
            assert "overloaded" in str(exc)
            refused += 1
    assert refused > 0
    lp.shutdown()
    for s in streams:
        final = RequestOutput(s.request_id)
        for out in s:
            merge_output(final, out)
        assert final.finished
    with pytest.raises(RuntimeError):
        lp.submit("late", SamplingParams())


def test_on_output_wakes_a_reader_that_never_polls():
    """The notification comes after the outputs are in the streams: a reader that only
    sleeps on it (no timeout) receives every token and the final output."""
    wake = threading.Event()
    calls = []

    def on_output():
        calls.append(threading.current_thread().name)
        wake.set()

    with EngineLoop(config(), on_output=on_output) as running:
        stream = running.submit([5, 6, 7], SamplingParams(max_tokens=6, **GREEDY))
        tokens, finished = [], False
        while not finished:
            assert wake.wait(timeout=30), "no notification for pending outputs"
            wake.clear()
            while not stream._queue.empty():
                out = stream.get(timeout=0)
                tokens.extend(out.token_ids)
                finished = out.finished
    assert len(tokens) == 6
    assert 1 <= len(calls) <= 6 and set(calls) == {"slipstream-engine"}


def test_start_raises_what_building_the_engine_raised(tmp_path):
    lp = EngineLoop(config(model=str(tmp_path / "no-such-model")))
    with pytest.raises(Exception, match="no-such-model"):
        lp.start()
    with pytest.raises(RuntimeError, match="not running"):
        lp.submit("hello", SamplingParams())


def test_engine_is_built_on_the_loop_thread(monkeypatch):
    """All of the engine's torch work (model loading first) happens on the loop thread."""
    import slipstream.engine.loop as engine_loop

    built_on = []

    class Recording(LLMEngine):
        def __init__(self, *args, **kwargs):
            built_on.append(threading.current_thread().name)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_loop, "LLMEngine", Recording)
    with EngineLoop(config()) as lp:
        assert lp.generate([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY)).num_output_tokens == 2
    assert built_on == ["slipstream-engine"]


def test_start_freezes_the_loaded_heap_out_of_the_cyclic_collector():
    gc.unfreeze()  # what earlier tests' loops froze
    with EngineLoop(config()) as running:
        frozen = gc.get_freeze_count()
        # the model's modules and tensors are among the frozen objects
        assert frozen > 1000
        assert running.generate("after the freeze", SamplingParams(max_tokens=4, **GREEDY))


def test_a_replaced_loops_engine_is_collected_when_the_next_loop_freezes_its_heap():
    """The engine lives in reference cycles: freezing the heap again at the next start
    (as after a supervisor restart) must not make the dead one permanent."""
    first = EngineLoop(config()).start()
    dead = weakref.ref(first.engine)
    first.shutdown()
    del first
    with EngineLoop(config()):
        assert dead() is None
