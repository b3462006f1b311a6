"""The compiled decode stack (``worker/decode_stack.py``, ``kernels/csrc/cpu_decode_stack.cpp``):
every
decoder layer of an all-decode step in one call, with the Python loop's results bit for bit."""

import pytest
import torch

from slipstream import SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker import kernels
from slipstream.worker.attention.metadata import DecodeRows, DecodeStep
from support import chunked_engine, stack_and_loop_logits

REDUCED = [dict(quantization="int8"), dict(dtype="bfloat16")]


def _engine(arch: str, **settings) -> LLMEngine:
    if not kernels.load():
        pytest.skip(f"no CPU kernels: {kernels.unavailable_reason()}")
    return chunked_engine(arch, device="cpu", **settings)


@pytest.mark.parametrize("settings", REDUCED, ids=["int8", "bf16"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q, k, v biases
def test_decode_steps_on_the_stack_give_the_python_loops_logits_bit_for_bit(arch, settings):
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    loop, stack, calls = stack_and_loop_logits(lambda: _engine(arch, **settings), params)
    assert calls >= 4  # the all-decode steps ran on it (prompt chunks never do)
    assert len(stack) == len(loop) > calls
    for a, b in zip(loop, stack):
        assert torch.equal(a, b)


def test_fp32_layers_keep_the_python_loop():
    engine = _engine("llama")
    assert engine.runner.forward.lean is not None and engine.runner.forward.lean.stack is None


def test_a_step_with_a_prompt_chunk_runs_the_python_loop():
    engine = _engine("llama", quantization="int8")
    fast = engine.runner.forward.lean
    assert fast is not None and fast.stack is not None
    seen: list = []
    run = fast.stack.run
    fast.stack.run = lambda hidden, *a, **k: seen.append(hidden.shape[0]) or run(hidden, *a, **k)
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), request_id="a")
    engine.step()  # a prompt step: not on the stack
    assert seen == []
    engine.step()
    assert seen == [1]  # its first decode step is


def test_the_stack_runs_without_the_gil():
    """Other Python threads (the server's response sender, tokenizer and step watchdog) run
    while a step's layers do: a spinning thread records ticks inside the stack's calls. The
    calls are made long (tens of thousands of rows) so that the spinner is scheduled inside
    them on a busy machine too; a call holding the GIL leaves no tick inside at any length."""
    import bisect
    import threading
    import time

    engine = _engine("llama", quantization="int8")
    fast = engine.runner.forward.lean
    assert fast is not None and fast.stack is not None
    t, block = 40_000, 16
    hkv, d = fast.num_kv_heads, fast.head_dim
    caches = [torch.zeros(t // block, block, hkv, d, dtype=torch.bfloat16) for _ in fast.layers]
    values = [c.clone() for c in caches]
    rows = torch.arange(t)
    step = DecodeStep(
        DecodeRows(
            rows,
            (rows // block).to(torch.int32)[:, None].contiguous(),
            torch.ones(t, dtype=torch.int32),
        ),
        None,
        rows,
    )
    hidden_size = fast.num_heads * d
    cos, sin = torch.ones(t, d), torch.zeros(t, d)

    def call() -> tuple[float, float]:
        hidden = torch.randn(t, hidden_size)
        start = time.perf_counter()
        fast.stack.run(hidden, cos, sin, caches, values, step)
        return start, time.perf_counter()

    call()  # warm
    ticks: list = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks.append(time.perf_counter())

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        windows = [call() for _ in range(4)]
    finally:
        stop.set()
        spinner.join()
    inside = [bisect.bisect_left(ticks, b) - bisect.bisect_right(ticks, a) for a, b in windows]
    assert sum(n > 0 for n in inside) >= 3, inside
