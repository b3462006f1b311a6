"""Tensor parallelism in the engine: rank 0 in this process, rank 1 a process it starts, two
ranks of one core each over gloo. Two ranks generate what one does; every feature the engine
serves runs on them; a rank that dies or hangs ends the engine with an error naming it; a
stop leaves no process or port behind."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import FinishReason, RequestOutput
from slipstream.engine import LLMEngine, merge_output
from slipstream.engine.loop import EngineDeadError, EngineLoop, HealthState
from slipstream.engine.supervisor import EngineSupervisor
from support import random_workload, tiny_model_dir

# prompts of 1-90 tokens through 48-token steps: chunked prefill beside decode rows
PROMPTS, OUTS = random_workload(6, seed=5, lengths=(3, 40, 17, 90, 1, 7), max_out=20)
SHARED = PROMPTS[3][:40]  # a 40-token prefix repeated: prefix-cache hits on 4-token blocks


def settings(**more) -> dict:
    base = dict(
        model=str(tiny_model_dir(more.pop("arch", "llama"))),
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        max_model_len=256,
        num_gpu_blocks_override=300,
    )
    return {**base, **more}


def workload() -> tuple[list, list]:
    """Greedy prompts, chunked and prefix-shared, one scoring its prompt, one forking into
    two sampled sequences (copy-on-write of its last prompt block: a block copy every rank
    makes), one beam search."""
    prompts = PROMPTS + [SHARED + [11, 12, 13], SHARED + [21, 22], PROMPTS[1], PROMPTS[2]]
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for n in OUTS]
    params += [
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=7, n=2, temperature=0.8, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=6, n=2, beam_width=3, temperature=0, ignore_eos=True),
    ]
    return prompts, params


def generate(config: EngineConfig) -> list:
    engine = LLMEngine(config)
    try:
        prompts, params = workload()
        outs = engine.generate_sequences(prompts, params)
        return [[(o.token_ids, o.prompt_logprobs) for o in seqs] for seqs in outs]
    finally:
        engine.close()


def tokens(results: list) -> list:
    return [[ids for ids, _ in seqs] for seqs in results]


def prompt_scores(results: list) -> list:
    """The prompt logprobs of the requests that asked for them: per position, token id ->
    TokenLogprob (the prompt token and the top ones)."""
    return [position for seqs in results if seqs[0][1] is not None for position in seqs[0][1][1:]]


def score_gaps(got: list, want: list) -> list:
    """Per entry, how far ``got``'s logprob is from ``want``'s (the same top tokens; a
    random model's prompt token, deep in a nearly flat distribution, may move a rank)."""
    assert len(got) == len(want) > 0
    gaps = []
    for a, b in zip(got, want):
        assert a.keys() == b.keys()
        gaps += [abs(a[t] - b[t]) for t in a]
    return gaps


@pytest.mark.parametrize(
    "arch, ranks, more",
    [
        ("llama", 2, {}),  # model/llama's module tree, the lean forward
        ("llama", 2, {"speculative_method": "ngram", "num_speculative_tokens": 3}),
        ("qwen2", 2, {"fast_forward": False}),  # transformers' forward, q/k/v biases
        ("mistral", 2, {}),  # one KV head, replicated on both ranks
        ("llama", 3, {}),  # 2 KV heads over 3 ranks: one shared by two, 1 + 1 + 2 query heads
    ],
    ids=["lean", "ngram", "transformers-qwen2", "mistral", "three-ranks"],
)
def test_ranks_generate_what_one_does(arch, ranks, more):
    one = generate(EngineConfig(**settings(arch=arch, **more)))
    two = generate(EngineConfig(**settings(arch=arch, tensor_parallel_size=ranks, **more)))
    assert tokens(two) == tokens(one)
    assert max(score_gaps(prompt_scores(two), prompt_scores(one))) < 1e-4


@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float32", "int8")])
def test_reduced_weight_formats_run_on_the_shares(dtype, quantization):
    """bf16 / int8 round each rank's partial products on their own: close to one rank's
    scores, not equal."""
    more = dict(dtype=dtype, quantization=quantization)
    one = prompt_scores(generate(EngineConfig(**settings(**more))))
    two = prompt_scores(generate(EngineConfig(**settings(tensor_parallel_size=2, **more))))
    gaps = [abs(b[t] - a[t]) for b, a in zip(two, one) for t in a if t in b]
    assert len(gaps) >= len(one) and max(gaps) < 0.1


def _port_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def test_close_leaves_no_rank_process_or_port_behind():
    """And undoes rank 0's pinning: the thread that built the engine ran on rank 0's cores."""
    before = (os.sched_getaffinity(0), torch.get_num_threads())
    engine = LLMEngine(EngineConfig(**settings(tensor_parallel_size=2)))
    leader = engine.parallel
    assert leader is not None
    ranks = list(leader.local)
    ports = [leader.topology.master_port, leader.sockets.plan_port, leader.sockets.report_port]
    cores = sorted(before[0])
    assert os.sched_getaffinity(0) == set(cores[: len(cores) // 2] or cores[:1])
    assert engine.generate([[5, 6, 7]], SamplingParams(max_tokens=3))[0].num_output_tokens == 3
    engine.close()
    assert [r.process.poll() for r in ranks] == [0]  # told to stop, it exited by itself
    assert all(_port_free(p) for p in ports), ports
    assert (os.sched_getaffinity(0), torch.get_num_threads()) == before
    engine.close()  # twice: nothing more to do


def test_a_taken_master_port_fails_the_load_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError, match=f"cannot listen on .*127.0.0.1:{port}.*in use"):
            LLMEngine(EngineConfig(**settings(tensor_parallel_size=2, master_port=port)))


def test_a_master_address_of_another_machine_fails_the_load_naming_it():
    with pytest.raises(RuntimeError, match="203.0.113.9 is not an address of this machine"):
        LLMEngine(EngineConfig(**settings(tensor_parallel_size=2, master_addr="203.0.113.9")))


def test_a_rank_that_dies_starting_fails_the_load_naming_it():
    """Rank 1 asked to run on a core this machine does not have exits before it joins."""
    missing = max(os.sched_getaffinity(0)) + 64
    config = EngineConfig(**settings(tensor_parallel_size=2, cpu_threads_bind=f"0|{missing}"))
    with pytest.raises(RuntimeError, match=r"did not start: rank 1 \(pid \d+\) exited with code"):
        LLMEngine(config)


# -- faults while serving -----------------------------------------------------------------
def _collect(stream, timeout=120) -> RequestOutput:
    total = RequestOutput(stream.request_id)
    deadline = time.monotonic() + timeout
    while not stream.finished:
        merge_output(total, stream.get(timeout=max(deadline - time.monotonic(), 0.01)))
    return total


def _rank_pid(loop) -> int:
    return loop.engine.parallel.local[0].process.pid


def _wait_for(predicate, timeout: float) -> float:
    """Seconds until ``predicate()`` held (fails the test after ``timeout``)."""
    start = time.monotonic()
    while not predicate():
        assert time.monotonic() - start < timeout, "not within the time allowed"
        time.sleep(0.05)
    return time.monotonic() - start


def test_a_killed_rank_fails_the_requests_in_flight_and_the_engine():
    with EngineLoop(EngineConfig(**settings(tensor_parallel_size=2, max_model_len=1024))) as loop:
        stream = loop.submit([5, 6, 7], SamplingParams(max_tokens=900, ignore_eos=True))
        stream.get(timeout=60)  # generating
        os.kill(_rank_pid(loop), signal.SIGKILL)
        out = _collect(stream)
        assert out.finish_reason is FinishReason.ERROR
        assert "rank 1" in out.error and "SIGKILL" in out.error, out.error
        _wait_for(lambda: loop.health().state is HealthState.DEAD, timeout=5)
        with pytest.raises(EngineDeadError, match="rank 1"):
            loop.submit([1, 2], SamplingParams(max_tokens=2))


def test_a_rank_killed_while_idle_takes_the_engine_down_within_seconds():
    with EngineLoop(EngineConfig(**settings(tensor_parallel_size=2))) as loop:
        os.kill(_rank_pid(loop), signal.SIGKILL)
        seconds = _wait_for(lambda: loop.health().state is HealthState.DEAD, timeout=5)
        assert "rank 1" in loop.health().error and seconds < 5


def test_a_hung_rank_is_seen_by_its_silence():
    from slipstream.worker.distributed.plan_channel import HEARTBEAT_TIMEOUT_S

    with EngineLoop(EngineConfig(**settings(tensor_parallel_size=2))) as loop:
        rank = loop.engine.parallel.local[0].process
        os.kill(rank.pid, signal.SIGSTOP)
        try:
            _wait_for(lambda: loop.health().state is HealthState.DEAD, HEARTBEAT_TIMEOUT_S + 10)
            assert "rank 1 has sent no heartbeat" in loop.health().error
            rank.wait(10)  # the hung rank was killed, not left stopped
        finally:
            if rank.poll() is None:
                rank.kill()


def test_the_supervisor_restarts_the_whole_group():
    supervisor = EngineSupervisor(
        EngineConfig(**settings(tensor_parallel_size=2)), max_restarts=2, restart_backoff_s=0.1
    ).start()
    try:
        first = supervisor.loop.engine.parallel.local[0].process
        os.kill(first.pid, signal.SIGKILL)
        _wait_for(lambda: supervisor.restarts == 1 and supervisor.health().ok, timeout=120)
        second = supervisor.loop.engine.parallel.local[0].process
        assert second.pid != first.pid and first.poll() is not None
        out = supervisor.loop.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
        assert out.num_output_tokens == 4
    finally:
        supervisor.shutdown()
    assert second.poll() == 0  # stopped by word before the engine thread ended
