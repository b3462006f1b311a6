"""The engine loop's tokenizer thread: text prompts are tokenized here, so a long prompt holds
up neither the caller (Triton's ``execute``, which every other new request waits behind) nor
the engine's steps. A prompt found invalid here ends its request through its stream."""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass
from typing import Callable, Optional

from slipstream.core.pooling_params import PoolingParams
from slipstream.core.request import Request, RequestOutput
from slipstream.engine.input_processor import ClientRequest, InputProcessor, Prompt, PromptOptions
from slipstream.engine.output_stream import OutputStream
from slipstream.engine.stream_table import StreamTable


@dataclass
class TokenizeJob:
    stream: OutputStream
    client: ClientRequest  # its request_id is the stream's


@dataclass
class PoolingJob:
    """A pooling (embedding) request: tokenized here, run on the loop thread between steps
    (``LLMEngine.embed``)."""

    stream: OutputStream
    prompt: Prompt
    params: PoolingParams
    options: PromptOptions
    truncate: Optional[int] = None
    token_ids: Optional[list[int]] = None


class TokenizerThread:
    def __init__(
        self,
        inputs: Callable[[], InputProcessor],
        streams: StreamTable,
        refusing: Callable[[], bool],
        add: Callable[[Request], None],
        embed: Callable[[PoolingJob], None],
        deliver: Callable[[list[RequestOutput]], None],
    ) -> None:
        """``inputs``: the engine's input processor; ``refusing``: whether nothing new may
        reach the engine (it is closing or dead); ``add`` / ``embed`` hand a request to the
        loop thread; ``deliver`` ends a refused one."""
        self.inputs, self.streams, self.refusing = inputs, streams, refusing
        self.add, self.embed, self.deliver = add, embed, deliver
        self.jobs: "queue.Queue[Optional[TokenizeJob | PoolingJob]]" = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="slipstream-tokenizer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, job: "TokenizeJob | PoolingJob") -> None:
        self.jobs.put(job)

    def stop(self, timeout: float) -> None:
        """End what it holds: what is still queued never reaches the engine."""
        self.jobs.put(None)
        self.thread.join(timeout)

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                break
            if self.refusing() or self.streams.aborted_early(job.stream.request_id):
                self._reject(job.stream, None)
                continue
            inputs = self.inputs()
            try:
                if isinstance(job, PoolingJob):
                    job.token_ids = inputs.pooling_ids(job.prompt, job.options, job.truncate)
                    self.embed(job)
                    continue
                req = inputs.process(job.client)
            except Exception as exc:  # noqa: BLE001 - refused: this request alone
                self._reject(job.stream, exc)
                continue
            self.add(req)
        while True:  # shutting down
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            if job is not None:
                self._reject(job.stream, None)

    def _reject(self, stream: OutputStream, exc: Optional[Exception]) -> None:
        self.deliver([self.streams.reject(stream, exc)])
