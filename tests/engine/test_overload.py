"""Overload: a bounded waiting queue refuses what does not fit at once, everything admitted
completes, nothing leaks; a prompt that could never fit in the KV cache is refused."""

from __future__ import annotations

import random
import threading
import time

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import RequestOutput
from slipstream.engine import LLMEngine, merge_output
from slipstream.engine.loop import EngineLoop, OverloadedError
from support import hf_greedy, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)
MAX_QUEUE, MAX_SEQS = 4, 4
THREADS, PER_THREAD = 8, 8  # 64 requests, 8 times what runs plus what may wait


def config(**overrides) -> EngineConfig:
    # 24 blocks of 4 tokens: four running requests of up to 46 tokens do not all fit, so
    # the admitted ones also preempt each other.
    settings = dict(
        model=str(tiny_model_dir("llama")),
        block_size=4,
        max_num_batched_tokens=32,
        max_num_seqs=MAX_SEQS,
        max_model_len=128,
        num_gpu_blocks_override=24,
        max_queue_size=MAX_QUEUE,
    )
    settings.update(overrides)
    return EngineConfig(**settings)


def workload(seed: int = 0) -> list:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(100, 40000) for _ in range(rng.choice((5, 12, 20, 30)))],
            rng.randrange(4, 17),
        )
        for _ in range(THREADS * PER_THREAD)
    ]


def client(loop: EngineLoop, jobs: list, start: threading.Barrier, results: dict) -> None:
    """Submit each job (a few ms apart), then read every admitted stream to the end."""
    rng = random.Random(id(jobs))
    streams = []
    start.wait()
    for index, (prompt, max_tokens) in jobs:
        try:
            streams.append(
                (index, loop.submit(prompt, SamplingParams(max_tokens=max_tokens, **GREEDY)))
            )
        except OverloadedError as exc:
            results[index] = exc
        time.sleep(rng.uniform(0, 0.05))  # several times what the engine serves, spread out
    for index, stream in streams:
        total = RequestOutput(stream.request_id)
        for out in stream:
            merge_output(total, out)
        results[index] = total


def test_stress_admitted_complete_refused_get_overloaded_no_leaks():
    jobs = workload()
    results: dict = {}
    loop = EngineLoop(config()).start()
    loop.generate([1, 2], SamplingParams(max_tokens=2))  # warm up: the first step is slow
    start = threading.Barrier(THREADS)
    threads = [
        threading.Thread(
            target=client, args=(loop, list(enumerate(jobs))[t::THREADS], start, results)
        )
        for t in range(THREADS)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
        assert not t.is_alive(), "a client never got its final output"
    assert len(results) == len(jobs)

    refused = [i for i, r in results.items() if isinstance(r, Exception)]
    admitted = [i for i, r in results.items() if not isinstance(r, Exception)]
    assert refused and len(admitted) >= MAX_QUEUE
    for i in refused:
        assert isinstance(results[i], OverloadedError) and "overloaded" in str(results[i])
    path = tiny_model_dir("llama")
    for i in admitted:
        out, (prompt, max_tokens) = results[i], jobs[i]
        assert out.finished and out.finish_reason == "length" and out.error is None
        assert out.num_output_tokens == len(out.token_ids) == max_tokens
        assert out.token_ids == hf_greedy(path, prompt, max_tokens)

    # Drained: the queue admits again, and nothing refused ever reached the engine.
    assert loop.generate([7, 8, 9], SamplingParams(max_tokens=3, **GREEDY)).num_output_tokens == 3
    loop.shutdown()
    engine = loop.engine
    assert engine.stats.num_finished == len(admitted) + 2
    assert not engine.has_unfinished() and not engine.requests
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_queue_limit_counts_requests_not_yet_seen_by_the_loop():
    """Submissions racing the loop thread are counted as waiting: exactly max_queue_size
    are admitted while one long request holds the only running slot."""
    loop = EngineLoop(config(max_num_seqs=1, max_queue_size=3)).start()
    try:
        first = loop.submit([5, 6, 7], SamplingParams(max_tokens=60, **GREEDY))
        deadline = time.monotonic() + 30
        while loop.stats().num_running == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        admitted, refused = [], 0
        for i in range(12):
            try:
                admitted.append(loop.submit([100 + i, 5], SamplingParams(max_tokens=2, **GREEDY)))
            except OverloadedError:
                refused += 1
        assert len(admitted) == 3 and refused == 9
        for stream in [first] + admitted:
            outs = list(stream)
            assert outs[-1].finished and outs[-1].error is None
    finally:
        loop.shutdown()


def test_request_that_can_never_fit_is_refused_clearly():
    engine = LLMEngine(config(num_gpu_blocks_override=10, max_queue_size=0))  # 40 tokens
    with pytest.raises(ValueError, match="prompt has 45 tokens and can never fit in the KV cache"):
        engine.add_request(list(range(100, 145)))
    with pytest.raises(ValueError, match="prompt has 40 tokens and can never fit"):
        engine.add_request(list(range(100, 140)))  # no room left for a generated token
    assert not engine.has_unfinished()
    assert (
        engine.scheduler.max_seq_len == 40
    )  # the cache, not max_model_len (128), bounds a sequence
    # A request that would outgrow the whole cache ends there ("length"), like at
    # max_model_len, instead of preempting itself forever.
    out = engine.generate([list(range(100, 110))], SamplingParams(max_tokens=500, **GREEDY))[0]
    assert out.num_output_tokens == 30 and out.finish_reason == "length"
    assert engine.scheduler.num_preemptions == 0
    assert engine.block_manager.num_used_blocks == 0


def test_loop_refuses_unfittable_prompt_in_the_callers_thread():
    with EngineLoop(config(num_gpu_blocks_override=10)) as loop:
        with pytest.raises(ValueError, match="never fit"):
            loop.submit(list(range(100, 160)))
        out = loop.generate([1, 2, 3], SamplingParams(max_tokens=100, **GREEDY))
        assert out.num_output_tokens == 37 and out.finish_reason == "length"
        assert loop.stats().kv_blocks_used == 0
