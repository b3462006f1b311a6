"""The OpenAI frontend's way into Triton: one gRPC bidirectional stream per generation, as any
Triton client sends it, so Triton's scheduling, metrics and model control stay in charge.

Each request is Triton vLLM backend's wire format (``text_input``, ``stream``,
``sampling_parameters`` JSON, ``return_*`` flags). The model streams one response per engine
output; with ``n`` > 1 each output tensor holds one element per sequence (the one that moved
carries its delta, the others empty ones). Cancelling the gRPC call (the HTTP client went away)
cancels the request in Triton, which the adapter polls and turns into an engine abort.
"""

from __future__ import annotations

import asyncio
import json
import math
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, Optional, Sequence, Union

import numpy as np

from slipstream.server.openai.errors import OpenAIError, from_triton

CALL_END_GRACE_S = 5.0  # how long a finished request's call may take to end by itself
# vLLM's stand-in for a logprob of -inf in OpenAI responses (JSON has no infinity)
MIN_LOGPROB = -9999.0


@dataclass
class TokenLogprob:
    """One generated token: its text and logprob, and the top alternatives by rank."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass
class SequenceDelta:
    """What one response adds to one of the request's sequences."""

    index: int
    text: str
    num_tokens: int
    logprobs: Optional[list[TokenLogprob]] = None
    finish_reason: Optional[str] = None  # set once, on the response that ends the sequence


@dataclass
class Step:
    num_input_tokens: int
    sequences: list[SequenceDelta]


@dataclass
class EmbedRequest:
    model: str
    input: Union[str, list[int]]
    pooling: dict[str, Any]  # embedding_request's pooling_params
    truncate_prompt_tokens: Optional[int] = None
    add_special_tokens: Optional[bool] = None


@dataclass
class GenerateRequest:
    model: str
    prompt: str
    sampling: dict[str, Any]
    n: int = 1
    top_logprobs: Optional[int] = None  # None: no logprobs


def _tensor(grpcclient, name: str, value: np.ndarray, dtype: str):
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def _bytes(text: str) -> np.ndarray:
    return np.array([text.encode("utf-8")], dtype=np.object_)


def _logprob(value: Any) -> float:
    value = float(value)
    return MIN_LOGPROB if math.isinf(value) or math.isnan(value) else max(value, MIN_LOGPROB)


def parse_logprobs(text: str, top_n: int) -> list[TokenLogprob]:
    """vLLM backend's ``logprobs`` JSON (per token ``{id: {logprob, rank, decoded_token}}``,
    the sampled token first) -> tokens with their ``top_n`` best alternatives by rank."""
    out = []
    for position in json.loads(text) or []:
        entries = list(position.values())
        sampled = entries[0]
        ranked = sorted(
            (e for e in entries if e.get("rank") is not None and e["rank"] <= top_n),
            key=lambda e: e["rank"],
        )
        out.append(
            TokenLogprob(
                sampled.get("decoded_token") or "",
                _logprob(sampled["logprob"]),
                [(e.get("decoded_token") or "", _logprob(e["logprob"])) for e in ranked],
            )
        )
    return out


async def _let_end(stream) -> None:
    """Wait (briefly) for a call whose request is complete to end: Triton closes it once
    the request's final response is out, as the client sent its only request. A call that
    does not end in ``CALL_END_GRACE_S``, or a caller cancelled meanwhile, is cancelled."""

    async def rest() -> None:
        async for _ in stream:
            pass

    try:
        await asyncio.wait_for(rest(), CALL_END_GRACE_S)
    except asyncio.CancelledError:
        stream.cancel()
        raise
    except Exception:  # timed out or failed: end it the hard way (nothing runs any more)
        stream.cancel()


def _rpc_error(e) -> OpenAIError:
    """A failed gRPC call (Triton unreachable, stopping, ...) as a server-side error."""
    import grpc

    code = e.code() if hasattr(e, "code") else None
    details = e.details() if hasattr(e, "details") else str(e)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return OpenAIError(503, f"Triton: {details}")
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        return OpenAIError(504, f"Triton: {details}")
    return OpenAIError(500, f"Triton: {details}")


class TritonGenerator:
    """One gRPC channel (tritonclient's asyncio client) shared by every request; made in the
    event loop that uses it."""

    def __init__(self, grpc_url: str) -> None:
        self.grpc_url = grpc_url
        self._client = None

    def client(self):
        if self._client is None:
            import tritonclient.grpc.aio as aio

            self._client = aio.InferenceServerClient(self.grpc_url)
        return self._client

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def problem(self, models: Sequence[str]) -> Optional[str]:
        """Why the server cannot serve (not ready, a model not ready or unreachable), or None."""
        try:
            client = self.client()
            if not await client.is_server_ready():
                return "the Triton server is not ready"
            for name in models:
                if not await client.is_model_ready(name):
                    return f"model {name} is not ready"
        except Exception as e:  # unreachable: it died or restarts
            return f"the Triton server is unreachable: {e}"
        return None

    def _inputs(self, req: GenerateRequest) -> list:
        import tritonclient.grpc as grpcclient

        flags = {
            "stream": True,
            "return_finish_reason": True,
            "return_num_input_tokens": True,
            "return_num_output_tokens": True,
            "return_logprobs": req.top_logprobs is not None,
        }
        return [
            _tensor(grpcclient, "text_input", _bytes(req.prompt), "BYTES"),
            _tensor(grpcclient, "sampling_parameters", _bytes(json.dumps(req.sampling)), "BYTES"),
            *[
                _tensor(grpcclient, name, np.array([value]), "BOOL")
                for name, value in flags.items()
            ],
        ]

    async def generate(self, req: GenerateRequest) -> AsyncGenerator[Step, None]:
        """The request's steps until every sequence has finished; an error raises
        ``OpenAIError``. Closing the iterator early cancels the request (``_call``)."""
        finished: set[int] = set()
        results = self._call(req.model, self._inputs(req))
        try:
            async for result in results:
                step = self._step(result, req, finished)
                last = len(finished) >= req.n
                if last:  # the final response: nothing to cancel, however we are closed
                    await results.asend(True)
                yield step
                if last:
                    return
        finally:
            await results.aclose()

    async def embed(self, req: EmbedRequest) -> tuple[list[float], int]:
        """A pooling request through the model's ``embedding_request`` input (vllm_backend's):
        (the vector, the prompt's tokens)."""
        import tritonclient.grpc as grpcclient

        body: dict[str, Any] = {"input": req.input, "pooling_params": req.pooling}
        if req.truncate_prompt_tokens is not None:
            body["truncate_prompt_tokens"] = req.truncate_prompt_tokens
        if req.add_special_tokens is not None:
            body["add_special_tokens"] = req.add_special_tokens
        inputs = [
            _tensor(grpcclient, "text_input", _bytes(""), "BYTES"),
            _tensor(grpcclient, "embedding_request", _bytes(json.dumps(body)), "BYTES"),
            _tensor(grpcclient, "return_num_input_tokens", np.array([True]), "BOOL"),
        ]
        results = self._call(req.model, inputs)
        try:
            async for result in results:
                await results.asend(True)
                text = result.as_numpy("text_output").reshape(-1)[0]
                tokens = result.as_numpy("num_input_tokens")
                count = int(tokens.reshape(-1)[0]) if tokens is not None else 0
                return json.loads(text), count
        finally:
            await results.aclose()
        raise OpenAIError(500, "the model returned no embedding")

    async def _call(self, model: str, inputs: list) -> AsyncGenerator[Any, Optional[bool]]:
        """One request's results on a gRPC stream of its own; an error response raises
        ``OpenAIError``. The caller ``asend(True)``s once the result it has is the request's
        last: the call is then left to end on its own, never cancelled (a cancel there can
        keep Triton 2.51 from unloading the model at exit, docs/robustness.md). Closed before
        that, the call is cancelled: Triton marks the request cancelled and the engine aborts
        it, freeing its blocks."""
        import grpc

        async def one_request():
            yield {
                "model_name": model,
                "inputs": inputs,
                "request_id": f"openai-{uuid.uuid4().hex[:16]}",
            }

        stream = self.client().stream_infer(one_request())
        complete = False  # the request's final response came: nothing to cancel
        try:
            async for result, error in stream:
                if error is not None:
                    complete = True  # an error response is the request's last one
                    raise from_triton(error.message() if hasattr(error, "message") else str(error))
                if (yield result):  # the caller says it was the last one
                    complete = True
                    yield None  # answers the asend; the caller closes us next
                    return
            complete = True  # the call ended
            raise OpenAIError(500, "the model's response stream ended before it finished")
        except grpc.RpcError as e:
            complete = True  # the call itself failed: it is over
            raise _rpc_error(e) from None
        finally:
            if complete:
                await _let_end(stream)
            else:
                stream.cancel()  # the engine aborts the request and frees its blocks

    @staticmethod
    def _step(result, req: GenerateRequest, finished: set[int]) -> Step:
        def strings(name: str) -> list[str]:
            value = result.as_numpy(name)
            if value is None:
                return []
            return [
                v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in value.reshape(-1)
            ]

        texts = strings("text_output")
        reasons = strings("finish_reason")
        counts = result.as_numpy("num_output_tokens")
        counts = [int(c) for c in counts.reshape(-1)] if counts is not None else [0] * len(texts)
        num_input = result.as_numpy("num_input_tokens")
        logprobs = strings("logprobs") if req.top_logprobs is not None else []
        sequences = []
        for index, text in enumerate(texts):
            reason = reasons[index] if index < len(reasons) else "None"
            ends = reason not in ("None", "") and index not in finished
            if ends:
                finished.add(index)
            if not text and not counts[index] and not ends:
                continue  # another sequence moved
            lps = None
            if index < len(logprobs) and logprobs[index] != "null":
                lps = parse_logprobs(logprobs[index], req.top_logprobs or 0)
            sequences.append(
                SequenceDelta(index, text, counts[index], lps, reason if ends else None)
            )
        return Step(int(num_input.reshape(-1)[0]) if num_input is not None else 0, sequences)
