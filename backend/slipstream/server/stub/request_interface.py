"""The seam between the stub and the request vocabularies built on it.

The stub speaks one request vocabulary, its own (Triton vLLM backend's inputs plus typed
sampling inputs: ``input_table``), parsed by ``request_parser`` and answered by
``responses.ResponseBuilder``. Another vocabulary (TensorRT-LLM's ensemble, its LLM-API model:
``server/trtllm``) is a ``RequestInterface``: it splits a Triton request into rows, translates
each row into a ``NativeRow`` and wraps the native responses in its own. The stub never
imports one: the composition root (``slipstream.server.triton_model``) hands a model its
``Interfaces`` and the config additions and metric families that go with them.

Pure Python (no Triton import).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional, Protocol

import numpy as np

from slipstream.server.stub.input_table import RequestInput
from slipstream.server.stub.input_values import int_value, string_values
from slipstream.server.stub.responses import ResponseBuilder

Outputs = dict[str, np.ndarray]  # one response's tensors by name


@dataclass(frozen=True)
class ModelContext:
    """What an interface may know of the model a request reached."""

    batched: bool  # max_batch_size > 0: every tensor has a batch dimension
    decoupled: bool  # any number of responses per request (else exactly one)
    output_names: frozenset[str]  # the outputs its config declares
    encode: Callable[[str], list[int]]  # the model's tokenizer, without special tokens


@dataclass(frozen=True)
class ModelRequest:
    """What an interface splits or translates: a request's inputs (one row's, once split),
    the outputs its client named, and the model it reached."""

    inputs: Mapping[str, np.ndarray]
    requested_outputs: Collection[str]
    model: ModelContext


@dataclass
class NativeRow:
    """One engine request in the stub's vocabulary: the tensors ``parse_request`` reads, the
    settings merged over the request parameters, and the stop tokens whose text is not
    emitted (``end_id``)."""

    inputs: dict[str, np.ndarray]
    parameters: dict[str, Any] = field(default_factory=dict)
    end_ids: list[int] = field(default_factory=list)


class Responses(Protocol):
    """One request's responses (``ResponseBuilder`` is the native one)."""

    def streamed(self, out) -> Optional[Outputs]:
        """The response to one output of a streaming request (None: nothing to send)."""
        ...

    def absorb(self, out) -> None:
        """Keep an output of a request answered at its end."""
        ...

    def finals(self, out) -> list[Outputs]:
        """The last responses, after the finished output (not streaming)."""
        ...


class Translation(Protocol):
    """A row translated into the stub's vocabulary, and how its answers are built."""

    @property
    def row(self) -> NativeRow: ...

    def responses(self, native: ResponseBuilder) -> Responses:
        """This row's responses, built on the native ones."""
        ...


class RequestInterface(Protocol):
    """A request vocabulary served on the stub."""

    @property
    def input_names(self) -> tuple[str, ...]:
        """The inputs it reads beside the native ones."""
        ...

    def claims(self, inputs: Mapping[str, np.ndarray], requested_outputs: Collection[str]) -> bool:
        """Whether a request is in this vocabulary (an extension answers on its inputs)."""
        ...

    def split_rows(self, request: ModelRequest) -> list[dict[str, np.ndarray]]:
        """The request's engine requests; raises ``BadRequestError`` naming what is wrong."""
        ...

    def translate(self, row: ModelRequest, batch_index: int) -> Translation:
        """One row (its index in the request) in the stub's vocabulary; raises
        ``BadRequestError`` naming what it cannot honour."""
        ...

    def overloaded_text(self, max_queue_size: int) -> Optional[str]:
        """The error text of a full queue, when this vocabulary has its own."""
        ...


@dataclass(frozen=True)
class NativeTranslation:
    row: NativeRow

    def responses(self, native: ResponseBuilder) -> Responses:
        return native


class NativeInterface:
    """The stub's own vocabulary: one request, one engine request."""

    input_names: tuple[str, ...] = ()

    def claims(self, inputs: Mapping[str, np.ndarray], requested_outputs: Collection[str]) -> bool:
        return True

    def split_rows(self, request: ModelRequest) -> list[dict[str, np.ndarray]]:
        return [dict(request.inputs)]

    def translate(self, row: ModelRequest, batch_index: int) -> NativeTranslation:
        return NativeTranslation(native_row(row.inputs))

    def overloaded_text(self, max_queue_size: int) -> Optional[str]:
        return None


NATIVE = NativeInterface()


def native_row(inputs: Mapping[str, np.ndarray]) -> NativeRow:
    """Native inputs made ready for ``parse_request``: empty stop words mean none (TRT-LLM's
    clients send ``[""]``), and ``end_id`` is remembered so that its text is not emitted."""
    kept = {name: value for name, value in inputs.items() if value is not None}
    if "stop_words" in kept:
        words = string_values("stop_words", kept["stop_words"])
        if words:
            kept["stop_words"] = np.array([w.encode() for w in words], dtype=np.object_)
        else:
            del kept["stop_words"]
    end_ids = [int_value("end_id", kept["end_id"])] if "end_id" in kept else []
    return NativeRow(kept, end_ids=end_ids)


@dataclass(frozen=True)
class Interfaces:
    """A model's vocabularies: an extension takes the requests it claims (the first that
    does), the primary every other one."""

    primary: RequestInterface = NATIVE
    extensions: tuple[RequestInterface, ...] = ()

    def pick(
        self, inputs: Mapping[str, np.ndarray], requested_outputs: Collection[str]
    ) -> RequestInterface:
        for extension in self.extensions:
            if extension.claims(inputs, requested_outputs):
                return extension
        return self.primary

    @property
    def input_names(self) -> tuple[str, ...]:
        """Every input some interface reads beside the native ones, once each."""
        names: dict[str, None] = {}
        for interface in (self.primary, *self.extensions):
            names.update(dict.fromkeys(interface.input_names))
        return tuple(names)


@dataclass(frozen=True)
class ConfigAdditions:
    """What interfaces add to a model config's auto-completion: inputs after the native
    ones, outputs (instead of the native ones when ``replace_outputs``), and whether the
    prompt is optional (so a request without one reaches the interface, which names what
    it carries instead)."""

    inputs: tuple[RequestInput, ...] = ()
    outputs: tuple[Mapping[str, object], ...] = ()
    replace_outputs: bool = False
    optional_prompt: bool = False


def no_additions(declared: Mapping[str, Any]) -> ConfigAdditions:
    return ConfigAdditions()
