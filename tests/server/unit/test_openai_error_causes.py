"""Every text the engine, the stub and Triton write for a failed request gets the HTTP status
of its cause (and a Retry-After where a retry can succeed), not 400: each message is made by
its real producer where one can run here (the engine loop on the tiny model, the admission
rule, the deadline, the request parser), else it is the producer's literal text."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from slipstream import SamplingParams
from slipstream.core.request import FinishReason
from slipstream.engine.admission import RETRY_AFTER_S, OverloadedError
from slipstream.engine.detokenizer import IncrementalDetokenizer
from slipstream.engine.loop import EngineDeadError, EngineLoop
from slipstream.server.openai.errors import (
    ENGINE_RETRY_AFTER_S,
    cause_of_triton_error,
    from_triton,
)
from slipstream.server.stub.deadlines import Deadline
from slipstream.server.stub.health import UNHEALTHY_MESSAGE
from slipstream.server.stub.request_parser import BadRequestError, parse_request
from slipstream.server.trtllm.inputs import trtllm_queue_full
from engine_support import GREEDY, config

PREFIX = "Error generating stream: "  # what the stub puts before the engine's texts


def last(stream, timeout=60.0):
    deadline = time.monotonic() + timeout
    while True:
        out = stream.get(timeout=max(deadline - time.monotonic(), 0.1))
        if out.finished:
            return out


def status(text: str) -> tuple[int, object]:
    error = from_triton(text)
    return error.status, error.headers().get("Retry-After")


@pytest.fixture
def loop():
    lp = EngineLoop(config(), step_timeout_s=0.5).start()
    yield lp
    lp.shutdown(timeout=5)


def test_a_step_that_raises_is_an_internal_error_500(loop):
    loop.engine.runner.execute = lambda sched: (_ for _ in ()).throw(RuntimeError("device lost"))
    out = last(loop.submit([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY)))
    assert out.finish_reason is FinishReason.ERROR
    assert status(PREFIX + out.error) == (500, None)


def test_a_hung_step_the_watchdog_ends_is_503_with_retry_after(loop):
    loop.generate([5, 6, 7], SamplingParams(max_tokens=4, **GREEDY))  # past the first steps
    hang = threading.Event()
    loop.engine.runner.execute = lambda sched: hang.wait()
    out = last(loop.submit([8, 9], SamplingParams(max_tokens=40, **GREEDY)))
    hang.set()
    assert "hung" in out.error
    assert status(PREFIX + out.error) == (503, str(ENGINE_RETRY_AFTER_S))
    # and the refusal of what comes after, while it is dead
    with pytest.raises(EngineDeadError) as refused:
        loop.submit([1, 2], SamplingParams(max_tokens=2))
    assert status(PREFIX + str(refused.value)) == (503, str(ENGINE_RETRY_AFTER_S))


def test_a_crashed_engine_loop_is_503_with_retry_after(loop):
    running = loop.submit([5, 6, 7], SamplingParams(max_tokens=200, **GREEDY))
    running.get(timeout=30)

    class Crash(BaseException):
        pass

    def crash():
        raise Crash("segfault-like")

    loop.engine.step = crash
    out = last(running)
    assert "engine loop crashed" in out.error
    assert status(PREFIX + out.error) == (503, str(ENGINE_RETRY_AFTER_S))


def test_a_loop_that_is_not_running_refuses_with_503():
    lp = EngineLoop(config())
    with pytest.raises(EngineDeadError) as refused:
        lp.submit([1, 2], SamplingParams())
    assert status(PREFIX + str(refused.value))[0] == 503


def test_a_full_queue_is_429_with_retry_after():
    for text in (PREFIX + str(OverloadedError.queue_full(3)), trtllm_queue_full(3)):
        assert status(text) == (429, str(RETRY_AFTER_S))


@pytest.mark.parametrize(
    "text",
    [
        # the stub's drain and shutdown texts (server/stub/triton_model.py)
        "the server is shutting down",
        "request aborted: the server is shutting down and it did not finish within 27 s",
        "request aborted (server shutting down)",
        UNHEALTHY_MESSAGE,
        # Triton's own, once the model is unloaded
        "Request for unknown model: 'tiny' is not found",
        "Request for unknown model: 'tiny' version 1 is not at ready state",
    ],
)
def test_a_server_or_model_going_away_is_503_without_retry_after(text):
    assert status(text) == (503, None)


def test_the_servers_max_request_seconds_is_504_and_the_requests_timeout_408():
    server = Deadline(0.0, 30.0, "max_request_seconds").message(31.2)
    own = Deadline(0.0, 2.0, "the request's timeout").message(2.5)
    assert status(PREFIX + server) == (504, None)
    assert status(PREFIX + own) == (408, None)


def test_a_detokenization_failure_is_500():
    class Broken:
        def decode(self, ids, **kwargs):
            raise UnicodeError("bad bytes")

    detok = IncrementalDetokenizer(Broken(), [1, 2])
    detok.update([1, 2, 3])
    assert detok.error is not None and status(PREFIX + detok.error) == (500, None)


@pytest.mark.parametrize(
    "sampling",
    ['{"temperature": -1}', '{"max_tokens": 0}', '{"n": "x"}', "[1]", '{"logprobs": 99}'],
)
def test_the_clients_own_mistakes_stay_400(sampling):
    inputs = {
        "text_input": np.array([b"hi"], dtype=np.object_),
        "sampling_parameters": np.array([sampling.encode()], dtype=np.object_),
    }
    with pytest.raises(BadRequestError) as refused:
        parse_request(inputs)
    assert status(PREFIX + str(refused.value)) == (400, None)


def test_the_causes_are_matched_case_insensitively():
    assert cause_of_triton_error("SERVER OVERLOADED: ...").status == 429
