"""A Triton request taken in: its inputs read, handed to the request interface that speaks
its vocabulary (``request_interface``), split into rows, each row parsed and submitted to the
engine; the pending request goes to the sender thread. A request that cannot be served gets
its one error response here, and no other request notices.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from slipstream.core.sampling_params import SamplingParams
from slipstream.engine.loop import EngineDeadError, OverloadedError
from slipstream.engine.supervisor import EngineSupervisor
from slipstream.server.stub import embedding_request, input_table
from slipstream.server.stub.deadlines import Deadline, request_deadline
from slipstream.server.stub.input_values import BadRequestError
from slipstream.server.stub.metrics import ModelMetrics, NoMetrics
from slipstream.server.stub.model_config import ModelSettings
from slipstream.server.stub.pending import PendingRequest
from slipstream.server.stub.request_interface import (
    Interfaces,
    ModelContext,
    ModelRequest,
    RequestInterface,
)
from slipstream.server.stub.request_parser import (
    ParsedRequest,
    RequestOptions,
    lora_error,
    parameters_dict,
    parse_request,
)
from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.stub.row_sender import RowGroup
from slipstream.server.stub.sender import ResponseSender
from slipstream.server.stub.wire import ERROR_PREFIX, ErrorCode, error_response, send_final

# TensorRT-LLM backend's text (its clients match it) for any model that is not decoupled.
STREAMING_NOT_DECOUPLED = "Streaming is only supported if model is deployed using decoupled mode."


@dataclass(frozen=True)
class RowRequest:
    """One row of a Triton request, on its way to the engine."""

    inputs: Mapping[str, np.ndarray]
    parameters: Any  # the request's parameters (a JSON string or a dict)
    sender: Any  # its response sender (a row's, for batched requests)
    requested_outputs: frozenset[str]  # the outputs the client named (none: any)
    arrival: float
    batch_index: int
    deadline: Optional[Deadline]


class RequestIntake:
    def __init__(
        self,
        model_name: str,
        settings: ModelSettings,
        engine: EngineSupervisor,
        interfaces: Interfaces,
        model: ModelContext,
        sender: ResponseSender,
        metrics: ModelMetrics | NoMetrics,
        pb_utils,
        lora_names: Optional[Sequence[str]],
        max_queue_size: int,
    ) -> None:
        self.model_name, self.settings, self.engine = model_name, settings, engine
        self.interfaces, self.model, self.sender = interfaces, model, sender
        self.metrics, self.pb, self.logger = metrics, pb_utils, pb_utils.Logger
        self.lora_names, self.max_queue_size = lora_names, max_queue_size
        self.input_names = input_table.INPUT_NAMES + interfaces.input_names

    def take(self, request, refusing: Optional[str] = None) -> None:
        """One Triton request; ``refusing``: why every request is refused now (draining)."""
        arrival = time.monotonic()
        sender = request.get_response_sender()
        if refusing is not None:
            send_final(sender, error_response(refusing, ErrorCode.UNAVAILABLE), self.logger)
            return
        try:
            inputs = self._read_inputs(request)
            requested = self._named_outputs(request)
            interface = self.interfaces.pick(inputs, requested)
            rows = interface.split_rows(ModelRequest(inputs, requested, self.model))
        except Exception as e:  # never let one request take the batch down
            self.refuse(sender, e)
            return
        senders = [sender]
        if self.model.batched or not self.model.decoupled:
            senders = RowGroup(sender, len(rows), self.model.decoupled, self.pb).senders()
        deadline = request_deadline(
            arrival, _timeout_us(request), request.parameters(), self.settings.max_request_seconds
        )
        for index, (row, row_sender) in enumerate(zip(rows, senders)):
            self._submit(
                interface,
                RowRequest(
                    row,
                    request.parameters(),
                    row_sender,
                    requested,
                    arrival,
                    index,
                    deadline,
                ),
            )

    def _named_outputs(self, request) -> frozenset[str]:
        """The outputs the client named: Triton lists every declared output when it names
        none, which names nothing in particular."""
        requested = frozenset(request.requested_output_names())
        return frozenset() if requested == self.model.output_names else requested

    def _read_inputs(self, request) -> dict[str, np.ndarray]:
        inputs = {}
        for name in self.input_names:
            tensor = self.pb.get_input_tensor_by_name(request, name)
            if tensor is not None:
                inputs[name] = tensor.as_numpy()
        return inputs

    def _submit(self, interface: RequestInterface, row: RowRequest) -> None:
        """Parse one row and hand it to the engine; a bad one gets its error response."""
        if embedding_request.INPUT in row.inputs:
            self._submit_embedding(row)
            return
        try:
            lora = lora_error(row.inputs, row.parameters, self.lora_names)
            if lora is not None:  # vLLM answers this one without its prefix
                send_final(row.sender, error_response(lora, ErrorCode.INVALID_ARG), self.logger)
                return
            asked = ModelRequest(row.inputs, row.requested_outputs, self.model)
            translation = interface.translate(asked, row.batch_index)
            parsed = self._parse(translation.row.inputs, row.parameters, translation.row.parameters)
            stream = self.engine.submit(
                parsed.prompt, parsed.params, **_submit_options(parsed.options)
            )
        except Exception as e:  # never let one request take the batch down
            self.refuse(row.sender, e, interface)
            return
        native = ResponseBuilder(parsed, self.engine.tokenizer, translation.row.end_ids)
        track = self.metrics.track(row.arrival, parsed.params)
        self.sender.add(
            PendingRequest(
                stream,
                row.sender,
                parsed,
                translation.responses(native),
                track,
                row.arrival,
                row.deadline,
            )
        )

    def _submit_embedding(self, row: RowRequest) -> None:
        """A pooling request (``embedding_request.py``): one response with the vector."""
        try:
            req = embedding_request.parse_embedding_request(row.inputs, self.model_name)
            stream = self.engine.embed(
                req.prompt,
                req.params,
                add_special_tokens=req.add_special_tokens,
                truncate_prompt_tokens=req.truncate_prompt_tokens,
            )
        except Exception as e:  # never let one request take the batch down
            self.refuse(row.sender, e)
            return
        parsed = ParsedRequest("", SamplingParams(max_tokens=1), RequestOptions())
        track = self.metrics.track(row.arrival, parsed.params)
        builder = embedding_request.EmbeddingResponses(req)
        self.sender.add(
            PendingRequest(stream, row.sender, parsed, builder, track, row.arrival, row.deadline)
        )

    def _parse(
        self, inputs: Mapping[str, np.ndarray], parameters: Any, overrides: Mapping[str, Any]
    ) -> ParsedRequest:
        if overrides:  # an interface's settings win over the same request parameters
            parameters = {**parameters_dict(parameters), **overrides}
        parsed = parse_request(
            inputs,
            parameters,
            default_max_tokens=self.settings.default_max_tokens,
            default_apply_chat_template=self.settings.apply_chat_template,
            max_logprobs=self.settings.max_logprobs,
        )
        if parsed.options.stream and not self.model.decoupled:
            raise BadRequestError(STREAMING_NOT_DECOUPLED)
        return parsed

    def refuse(self, sender, e: Exception, interface: Optional[RequestInterface] = None) -> None:
        """The one error response of a request that cannot be served: UNAVAILABLE when the
        engine cannot take it, INVALID_ARG when the request is wrong, else an internal error
        (logged with its traceback)."""
        if isinstance(e, OverloadedError):
            text = interface.overloaded_text(self.max_queue_size) if interface else None
            answer = error_response(text or ERROR_PREFIX + str(e), ErrorCode.UNAVAILABLE)
        elif isinstance(e, EngineDeadError):
            answer = error_response(ERROR_PREFIX + str(e), ErrorCode.UNAVAILABLE)
        elif isinstance(e, ValueError):  # BadRequestError included
            answer = error_response(ERROR_PREFIX + str(e), ErrorCode.INVALID_ARG)
        else:
            self.logger.log_error(traceback.format_exc())
            answer = error_response(f"{ERROR_PREFIX}internal error: {e}")
        send_final(sender, answer, self.logger)


def _timeout_us(request) -> int:
    try:
        return int(request.timeout())
    except Exception:  # an older stub without InferenceRequest.timeout
        return 0


def _submit_options(options: RequestOptions) -> dict[str, object]:
    """``EngineLoop.submit``'s keyword arguments for a request's options (only what differs
    from its defaults)."""
    kwargs: dict[str, object] = {"priority": options.priority}
    if options.apply_chat_template:
        kwargs["apply_chat_template"] = True
    if not options.add_special_tokens:
        kwargs["add_special_tokens"] = False
    return kwargs
