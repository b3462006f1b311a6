"""The gRPC streaming client ``slipstream serve --prompt`` answers its prompt with (Triton's
generate inputs, vLLM backend's layout), printing the text as it streams."""

from __future__ import annotations

import json
import queue
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

from slipstream.server.launch.repository import DEFAULT_MODEL_NAME


@dataclass
class StreamedAnswer:
    """What the responses of one streamed prompt added up to so far."""

    start: float  # time.monotonic() when the request went out
    parts: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_output_tokens: int = 0
    ttft_s: Optional[float] = None

    def take(self, result, on_text: Optional[Callable[[str], None]]) -> bool:
        """Add one response; True when it was the final one."""
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            piece = text.reshape(-1)[0].decode("utf-8")
            if piece and self.ttft_s is None:
                self.ttft_s = time.monotonic() - self.start
            self.parts.append(piece)
            if on_text:
                on_text(piece)
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.size and reason.reshape(-1)[0]:
            self.finish_reason = reason.reshape(-1)[0].decode()
        count = result.as_numpy("num_output_tokens")
        if count is not None and count.size:
            self.num_output_tokens += int(count.reshape(-1)[0])
        return result.get_response().parameters["triton_final_response"].bool_param

    def summary(self) -> dict:
        return {
            "text": "".join(self.parts),
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "seconds": time.monotonic() - self.start,
            "num_output_tokens": self.num_output_tokens,
        }


def prompt_inputs(prompt: str, max_tokens: int, temperature: float, chat: bool) -> list:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    sampling = json.dumps({"max_tokens": max_tokens, "temperature": temperature}).encode()
    return [
        tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([sampling], dtype=np.object_), "BYTES"),
        tensor("apply_chat_template", np.array([chat]), "BOOL"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
    ]


def stream_prompt(
    grpc_url: str,
    prompt: str,
    *,
    model: str = DEFAULT_MODEL_NAME,
    max_tokens: int = 128,
    temperature: float = 0.0,
    chat: bool = True,
    on_text: Optional[Callable[[str], None]] = None,
    timeout: float = 600.0,
) -> dict:
    """Stream one answer over gRPC; returns {"text", "finish_reason", "ttft_s", "seconds",
    "num_output_tokens"}. Raises RuntimeError with the server's message on an error."""
    import tritonclient.grpc as grpcclient

    inputs = prompt_inputs(prompt, max_tokens, temperature, chat)
    responses: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    answer = StreamedAnswer(start=time.monotonic())
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"server error: {error}")
            if answer.take(result, on_text):
                break
    finally:
        client.stop_stream()
        client.close()
    return answer.summary()
