"""TensorRT-LLM's two request vocabularies as the stub's ``RequestInterface``: the
``inflight_batcher_llm`` ensemble's (``TrtllmInterface``) and the LLM-API model's
(``LlmapiInterface``), with what each adds to a model's config (``config_additions``).

A native model (vLLM's vocabulary) takes the ensemble's as an extension: only a request that
carries one of its inputs (or names one of its refused outputs) comes here. A model written
for TensorRT-LLM's clients (``compatibility: "trtllm"``, or a batch dimension) takes it for
every request; ``interface: "llmapi"`` the LLM-API model's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

import numpy as np

from slipstream.server.stub.input_values import BadRequestError
from slipstream.server.stub.model_config import config_parameter
from slipstream.server.stub.request_interface import (
    ConfigAdditions,
    ModelContext,
    ModelRequest,
    NativeRow,
    Responses,
    Translation,
)
from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.trtllm import llmapi
from slipstream.server.trtllm.inputs import (
    INPUT_NAMES,
    INPUTS,
    REFUSED_OUTPUTS,
    TranslatedRow,
    check_unsupported,
    split_rows,
    translate,
    trtllm_queue_full,
)
from slipstream.server.trtllm.outputs import OUTPUTS, TrtllmResponses

# Each of num_return_sequences > 1 is answered on its own (with its sequence_index): one
# response per request (a model not decoupled) cannot carry them.
PER_SEQUENCE_NEEDS_DECOUPLED = (
    "input 'num_return_sequences' > 1 needs a decoupled model: each sequence is answered on its own"
)


@dataclass(frozen=True)
class TrtllmTranslation:
    translated: TranslatedRow

    @property
    def row(self) -> NativeRow:
        return self.translated.row

    def responses(self, native: ResponseBuilder) -> Responses:
        options = self.translated.options
        if isinstance(options, llmapi.LlmapiOptions):  # the LLM-API model's STRING outputs
            return llmapi.LlmapiResponses(native, options)
        return TrtllmResponses(native, options)


class TrtllmInterface:
    """The ensemble's inputs and outputs. ``trtllm_semantics``: TensorRT-LLM's defaults and
    error texts where they differ from vLLM's (``compatibility: "trtllm"``)."""

    input_names: tuple[str, ...] = INPUT_NAMES

    def __init__(self, trtllm_semantics: bool = False) -> None:
        self.trtllm_semantics = trtllm_semantics

    def claims(self, inputs: Mapping[str, np.ndarray], requested_outputs: Collection[str]) -> bool:
        return any(inputs.get(name) is not None for name in INPUT_NAMES) or any(
            name in REFUSED_OUTPUTS for name in requested_outputs
        )

    def split_rows(self, request: ModelRequest) -> list[dict[str, np.ndarray]]:
        check_unsupported(request.inputs, request.requested_outputs, request.model.output_names)
        return split_rows(request.inputs, request.model.batched)

    def translate(self, row: ModelRequest, batch_index: int) -> Translation:
        translated = self.translate_row(row.inputs, batch_index, row.model)
        translated.options.sequence_length = "sequence_length" in row.requested_outputs
        _check_outputs(translated, row.model)
        return TrtllmTranslation(translated)

    def translate_row(
        self, row: Mapping[str, np.ndarray], batch_index: int, model: ModelContext
    ) -> TranslatedRow:
        """One row of this vocabulary mapped onto the stub's."""
        return translate(
            row,
            model.encode,
            batch_index=batch_index,
            with_indices=model.batched,
            trtllm_defaults=self.trtllm_semantics,
        )

    def overloaded_text(self, max_queue_size: int) -> Optional[str]:
        return trtllm_queue_full(max_queue_size) if self.trtllm_semantics else None


class LlmapiInterface(TrtllmInterface):
    """The LLM-API model's inputs (``sampling_param_*``) and STRING outputs."""

    input_names: tuple[str, ...] = INPUT_NAMES + llmapi.INPUT_NAMES

    def claims(self, inputs: Mapping[str, np.ndarray], requested_outputs: Collection[str]) -> bool:
        return True

    def translate_row(
        self, row: Mapping[str, np.ndarray], batch_index: int, model: ModelContext
    ) -> TranslatedRow:
        return llmapi.translate(row)


def _check_outputs(translated: TranslatedRow, model: ModelContext) -> None:
    """What a row asks for that the model's outputs (or its transaction policy) cannot carry."""
    options = translated.options
    if options.return_log_probs and "cum_log_probs" not in model.output_names:
        raise BadRequestError(
            "input 'return_log_probs' needs the outputs cum_log_probs "
            "and output_log_probs, which this model does not declare "
            '(set its compatibility parameter to "trtllm")'
        )
    if options.return_perf_metrics and "arrival_time_ns" not in model.output_names:
        raise BadRequestError(
            "input 'return_perf_metrics' needs the perf metrics "
            "outputs, which this model does not declare (set its "
            'compatibility parameter to "trtllm")'
        )
    options.with_indices &= "batch_index" in model.output_names
    if options.num_return_sequences > 1 and not model.decoupled:
        raise BadRequestError(PER_SEQUENCE_NEEDS_DECOUPLED)


def trtllm_style(declared: Mapping[str, Any]) -> bool:
    """A config written for TensorRT-LLM's clients: its compatibility, or a batch dimension."""
    return (
        config_parameter(declared, "compatibility") == "trtllm"
        or int(declared.get("max_batch_size") or 0) > 0
    )


def config_additions(declared: Mapping[str, Any]) -> ConfigAdditions:
    """The ensemble's inputs on every model (a native one refuses or maps them by name), its
    outputs on Slipstream's own layout (``backend: "python"``) and TensorRT-LLM-style configs
    (vLLM backend's layout keeps exactly vLLM's); the LLM-API model's inputs and only its
    outputs under ``interface: "llmapi"``. A TensorRT-LLM-style prompt is optional, so that a
    token-id request reaches the interface and is refused by name."""
    optional_prompt = trtllm_style(declared)
    if config_parameter(declared, "interface") == "llmapi":
        return ConfigAdditions(INPUTS + llmapi.INPUTS, tuple(llmapi.OUTPUTS), True, optional_prompt)
    own_layout = declared.get("backend", "python") == "python"
    outputs = OUTPUTS if own_layout or trtllm_style(declared) else ()
    return ConfigAdditions(INPUTS, outputs, False, optional_prompt)
