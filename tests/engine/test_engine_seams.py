"""The engine's seams (issue 23): the input processor refuses a bad request in one place,
the engine loop works through the narrow ``EngineSurface`` alone, one admission rule holds
``max_queue_size``, a step reports what it did, and the attention plan and context are made
once per step."""

from __future__ import annotations

import threading
from typing import Optional

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import FinishReason, Request, RequestOutput
from slipstream.core.stats import StatsSnapshot
from slipstream.engine import LLMEngine, OverloadedError, StepResult
from slipstream.engine.admission import QueueLimit
from slipstream.engine.input_processor import ClientRequest, InputProcessor, PromptOptions
from slipstream.engine.loop import EngineLoop, EngineSurface
from slipstream.worker.attention import transformers_hook as attention
from support import tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=4,
            max_model_len=64,
            num_gpu_blocks_override=64,
        )
    )


# -- the input processor -------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", SamplingParams(), "empty"),
        ("hi", SamplingParams(stop_token_ids=[10**9]), "stop_token_ids"),
        ("hi", SamplingParams(lora_name="nope"), "LoRA"),
        ("x" * 10**6, SamplingParams(), "bytes"),
    ],
)
def test_the_cheap_checks_refuse_the_same_request_in_the_loop_and_offline(
    engine, prompt, params, message
):
    """``check`` is what the loop runs in the caller's thread; ``process`` runs it too."""
    with pytest.raises(ValueError, match=message):
        engine.input_processor.check(prompt, params)
    with pytest.raises(ValueError, match=message):
        engine.make_request(prompt, params)


def test_process_refuses_what_only_token_ids_tell(engine):
    inputs, params = engine.input_processor, SamplingParams()
    with pytest.raises(ValueError, match="max_model_len"):
        inputs.process(ClientRequest(list(range(100, 200)), params))
    with pytest.raises(ValueError, match=r"prompt token ids must be in"):
        inputs.process(ClientRequest([10**7], params))
    with pytest.raises(ValueError, match="priority"):
        inputs.process(ClientRequest([1, 2], params, priority=True))
    req = inputs.process(
        ClientRequest(
            "hello there",
            SamplingParams(truncate_prompt_tokens=2),
            "mine",
            options=PromptOptions(add_special_tokens=False),
        )
    )
    assert req.request_id == "mine" and req.num_prompt_tokens == 2


# -- the admission rule --------------------------------------------------------------------
def test_one_queue_limit_rule():
    QueueLimit(0).check(10**6)  # 0: no limit
    QueueLimit(2).check(1)
    with pytest.raises(OverloadedError, match="server overloaded"):
        QueueLimit(2).check(2)


def test_the_offline_engine_admits_by_the_same_rule():
    eng = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=4,
            max_model_len=64,
            num_gpu_blocks_override=64,
            max_queue_size=1,
        )
    )
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=1))
    with pytest.raises(OverloadedError):
        eng.add_request([4, 5, 6], SamplingParams(max_tokens=1))


# -- the step ------------------------------------------------------------------------------
def test_step_says_whether_a_batch_ran(engine):
    assert engine.step() == StepResult([], ran=False)
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=2, **GREEDY), request_id="s")
    first = engine.step()
    assert first.ran and [o.request_id for o in first] == ["s"] and len(first) == 1
    while engine.has_unfinished():
        engine.step()
    assert not engine.requests


def test_the_attention_plan_is_made_once_per_step(engine, monkeypatch):
    calls = []
    ops = engine.runner.forward.ops
    original = ops.plan

    def counted(meta, *args):
        calls.append(meta)
        return original(meta, *args)

    monkeypatch.setattr(ops, "plan", counted)
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, **GREEDY))
    assert len(calls) == 3  # one prefill step, two decode steps
    assert all(meta.plan is not None for meta in calls)


def test_the_step_context_is_withdrawn_however_the_forward_ends():
    ctx = attention.StepContext(None, [], [], None)
    with pytest.raises(RuntimeError, match="boom"):
        with attention.step_context(ctx):
            assert attention.get_context() is ctx
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="outside an engine step"):
        attention.get_context()


# -- the loop over the narrow surface --------------------------------------------------------
class FakeEngine:
    """Only what ``EngineSurface`` names: each request gets one token per step, then ends."""

    def __init__(self, input_processor: InputProcessor, max_queue_size: int = 0) -> None:
        self.tokenizer = input_processor.tokenizer
        self.input_processor = input_processor
        self._limit = QueueLimit(max_queue_size)
        self._live: dict[str, Request] = {}
        self._left: dict[str, int] = {}  # tokens each request still makes
        self.hold = threading.Event()  # set: steps schedule nothing
        self.traced = False

    def add(self, req: Request, check_queue: bool = True) -> None:
        if check_queue:
            self.check_queue_room(len(self._live))
        self._live[req.request_id] = req
        self._left[req.request_id] = req.params.max_tokens

    def embed(self, token_ids: list[int], params) -> list[float]:
        return [float(len(token_ids))]

    def abort(self, request_id: str) -> Optional[RequestOutput]:
        if self._live.pop(request_id, None) is None:
            return None
        return RequestOutput(request_id, finished=True, finish_reason=FinishReason.ABORT)

    def step(self) -> StepResult:
        if self.hold.is_set() or not self._live:
            return StepResult([], ran=False)
        outputs = []
        for rid in list(self._live):
            self._left[rid] -= 1
            finished = self._left[rid] == 0
            if finished:
                del self._live[rid]
            outputs.append(
                RequestOutput(
                    rid,
                    token_ids=[7],
                    finished=finished,
                    finish_reason=FinishReason.LENGTH if finished else None,
                )
            )
        return StepResult(outputs, ran=True)

    def has_unfinished(self) -> bool:
        return bool(self._live)

    def num_waiting(self) -> int:
        return len(self._live) if self.hold.is_set() else 0

    def next_wakeup(self) -> Optional[float]:
        return None

    def check_queue_room(self, num_queued: int) -> None:
        self._limit.check(num_queued)

    def fail_running(self, message: str) -> list[RequestOutput]:
        return [
            RequestOutput(rid, finished=True, finish_reason=FinishReason.ERROR, error=message)
            for rid in list(self._live)
            if self._live.pop(rid)
        ]

    def abort_all(self) -> list[RequestOutput]:
        return [o for o in (self.abort(rid) for rid in list(self._live)) if o is not None]

    def save_trace(self) -> Optional[str]:
        self.traced = True
        return None

    def get_stats(self) -> StatsSnapshot:
        return StatsSnapshot(num_waiting=self.num_waiting())


def _surface_names() -> list[str]:
    return [n for n in vars(EngineSurface) if not n.startswith("_")] + list(
        EngineSurface.__annotations__
    )


def collect(stream) -> RequestOutput:
    total = RequestOutput(stream.request_id)
    for out in stream:
        total.token_ids += out.token_ids
        total.finished, total.finish_reason = out.finished, out.finish_reason
    return total


def test_the_loop_needs_nothing_but_the_narrow_surface(engine):
    fake = FakeEngine(engine.input_processor)
    assert not [
        name
        for name in ("scheduler", "requests", "config", "stats", "tracer")
        if hasattr(fake, name)
    ]
    assert all(hasattr(fake, name) for name in _surface_names())
    with EngineLoop(fake) as loop:
        text = collect(loop.submit("a text prompt", SamplingParams(max_tokens=3)))
        ids = collect(loop.submit([1, 2, 3], SamplingParams(max_tokens=2)))
        assert text.token_ids == [7, 7, 7] and text.finish_reason == "length"
        assert ids.token_ids == [7, 7]
        assert list(loop.embed([4, 5, 6]))[-1].embedding == [3.0]  # a pooling request
        with pytest.raises(ValueError, match="empty"):  # the input processor's refusal
            loop.submit("", SamplingParams())
    assert fake.traced and loop.health().state.value == "stopped"


def test_the_loop_admits_by_the_engines_rule_and_aborts_through_the_surface(engine):
    fake = FakeEngine(engine.input_processor, max_queue_size=2)
    fake.hold.set()
    with EngineLoop(fake) as loop:
        streams = [loop.submit([1, 2], SamplingParams(max_tokens=5)) for _ in range(2)]
        with pytest.raises(OverloadedError):
            for _ in range(5):
                loop.submit([1, 2], SamplingParams(max_tokens=5))
        loop.abort(streams[0].request_id)
        assert collect(streams[0]).finish_reason == "abort"
    assert collect(streams[1]).finish_reason == "abort"  # shutdown: abort_all


def test_a_raising_step_fails_the_running_requests_through_the_surface(engine):
    fake = FakeEngine(engine.input_processor)

    def crash():
        raise RuntimeError("kaput")

    fake.step = crash
    with EngineLoop(fake, failure_threshold=100) as loop:
        out = collect(loop.submit([1, 2], SamplingParams(max_tokens=5)))
    assert out.finish_reason == "error"
