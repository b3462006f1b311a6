"""TensorRT-LLM's LLM-API model interface (``all_models/llmapi/tensorrt_llm``): ``text_input``,
``streaming``, ``sampling_param_*`` and ``return_*_reason`` inputs; ``text_output`` and STRING
``finish_reason`` / ``stop_reason`` / ``cumulative_logprob`` outputs; with
``sampling_param_return_perf_metrics`` the per-request metrics as STRING outputs under the
names its docs show. Pure Python (no Triton).

A model config selects it with the parameter ``interface: "llmapi"``
(``samples/trtllm_llmapi_model_repository``). ``translate`` maps a request onto what
``parse_request`` reads; ``LlmapiResponses`` builds the responses (same methods as
``TrtllmResponses``). Semantics are the LLM API's: greedy unless ``top_k`` or ``top_p`` is set,
the prompt prepended unless ``sampling_param_exclude_input_from_output``, and a streamed
response carries the whole text so far (its ``CompletionOutput.text``), not a delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional

import numpy as np

from slipstream.server.stub.input_table import Reading, RequestInput, TritonType
from slipstream.server.stub.input_values import BadRequestError, flag_value, scalar
from slipstream.server.stub.request_interface import NativeRow
from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.trtllm.inputs import TranslatedRow, TrtllmOptions, greedy_unless_sampling
from slipstream.server.trtllm.outputs import nanoseconds


def _llmapi(
    name: str, data_type: TritonType, description: str, dims: tuple[int, ...] = (1,)
) -> RequestInput:
    return RequestInput(name, data_type, dims, Reading.INTERFACE, description)


# sampling_param_<name> -> (Triton type, the input parse_request reads)
SAMPLING_INPUTS: dict[str, tuple[TritonType, str]] = {
    "max_tokens": (TritonType.INT32, "max_tokens"),
    "temperature": (TritonType.FP32, "temperature"),
    "top_k": (TritonType.INT32, "top_k"),
    "top_p": (TritonType.FP32, "top_p"),
    "frequency_penalty": (TritonType.FP32, "frequency_penalty"),
    "presence_penalty": (TritonType.FP32, "presence_penalty"),
    "seed": (TritonType.UINT64, "seed"),
    "exclude_input_from_output": (TritonType.BOOL, "exclude_input_in_output"),
}
# The LLM-API model's own inputs, added to input_table.INPUTS by its auto-complete.
INPUTS: tuple[RequestInput, ...] = (
    _llmapi("streaming", TritonType.BOOL, "stream the answer"),
    *[
        _llmapi(f"sampling_param_{name}", data_type, f"becomes `{target}`")
        for name, (data_type, target) in SAMPLING_INPUTS.items()
    ],
    _llmapi("sampling_param_best_of", TritonType.INT32, "sequences generated"),
    _llmapi("sampling_param_return_perf_metrics", TritonType.BOOL, "add the per-request metrics"),
    _llmapi("sampling_param_stop", TritonType.STRING, "stop strings", dims=(-1,)),
    _llmapi("return_stop_reason", TritonType.BOOL, "add `stop_reason`"),
)
INPUT_NAMES: tuple[str, ...] = tuple(row.name for row in INPUTS)
PERF_METRICS = (
    "acceptance_rate",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks",
    "kv_cache_hit_rate",
    "kv_cache_missed_block",
    "kv_cache_reused_block",
    "last_token_time_ns",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)
OUTPUTS: list[Mapping[str, object]] = [
    {"name": n, "data_type": "TYPE_STRING", "dims": [-1]}
    for n in ("text_output", "finish_reason", "stop_reason", "cumulative_logprob", *PERF_METRICS)
]


@dataclass
class LlmapiOptions(TrtllmOptions):
    return_stop_reason: bool = False
    return_finish_reason: bool = False
    return_cumulative_logprob: bool = False
    stop_words: tuple = ()


def translate(row: Mapping[str, np.ndarray]) -> TranslatedRow:
    """One LLM-API request -> parse_request's inputs; its own options ride in the options."""
    present = {k: v for k, v in row.items() if v is not None}
    inputs = _renamed_inputs(present)
    opts = LlmapiOptions()
    params: Dict[str, Any] = {}
    if "sampling_param_best_of" in present:
        best_of = int(scalar("sampling_param_best_of", present["sampling_param_best_of"]))
        if best_of < 1:
            raise BadRequestError(f"input 'sampling_param_best_of' must be >= 1, got {best_of}")
        if best_of > 1:
            params["best_of"] = best_of
    if "sampling_param_stop" in present:
        _read_stop(present["sampling_param_stop"], inputs, opts)
    _read_flags(present, opts)
    greedy_unless_sampling(inputs)
    stream = "stream" in inputs and flag_value("streaming", inputs["stream"])
    if stream:  # the whole text so far is sent each time: the prompt is never repeated
        inputs.pop("exclude_input_in_output", None)
    # Its reasons and logprob are STRING outputs here: asked for under vLLM's names, converted.
    inputs["return_finish_reason"] = np.array([True])
    inputs["return_cumulative_logprob"] = np.array([True])
    return TranslatedRow(NativeRow(inputs, params), opts)


def _renamed_inputs(present: Mapping[str, np.ndarray]) -> Dict[str, np.ndarray]:
    """The inputs parse_request reads under other names."""
    inputs: Dict[str, np.ndarray] = {}
    if "text_input" in present:
        inputs["text_input"] = present["text_input"]
    if "streaming" in present:
        inputs["stream"] = present["streaming"]
    for name, (_, target) in SAMPLING_INPUTS.items():
        if f"sampling_param_{name}" in present:
            inputs[target] = present[f"sampling_param_{name}"]
    return inputs


def _read_stop(arr: np.ndarray, inputs: Dict[str, np.ndarray], opts: LlmapiOptions) -> None:
    words = [
        w.decode() if isinstance(w, (bytes, np.bytes_)) else str(w)
        for w in np.asarray(arr).reshape(-1)
    ]
    opts.stop_words = tuple(w for w in words if w)
    if opts.stop_words:
        inputs["stop_words"] = np.array([w.encode() for w in opts.stop_words], np.object_)


def _read_flags(present: Mapping[str, np.ndarray], opts: LlmapiOptions) -> None:
    for name in ("return_finish_reason", "return_cumulative_logprob", "return_stop_reason"):
        if name in present:
            setattr(opts, name, flag_value(name, present[name]))
    opts.return_perf_metrics = "sampling_param_return_perf_metrics" in present and flag_value(
        "sampling_param_return_perf_metrics", present["sampling_param_return_perf_metrics"]
    )


def _strings(values) -> np.ndarray:
    return np.array([str(v).encode("utf-8") for v in values], dtype=np.object_)


class LlmapiResponses:
    """Wraps a ``ResponseBuilder``: the LLM-API model's outputs for one request."""

    def __init__(self, inner: ResponseBuilder, options: LlmapiOptions) -> None:
        self.inner, self.options = inner, options
        self.text = ""  # streamed: the whole text so far

    def streamed(self, out) -> Optional[Dict[str, np.ndarray]]:
        if out.beams is not None:  # beam search is not an input of this interface
            return None
        outputs = self.inner.delta(out)
        self.text += "".join(x.decode() for x in outputs["text_output"])
        outputs["text_output"] = _strings([self.text])
        return self._convert(outputs, out)

    def absorb(self, out) -> None:
        self.inner.absorb(out)

    def final(self, out) -> Dict[str, np.ndarray]:
        return self._convert(self.inner.final(out), out)

    def finals(self, out) -> List[Dict[str, np.ndarray]]:
        return [self.final(out)]

    def _convert(self, outputs: Dict[str, np.ndarray], out) -> Dict[str, np.ndarray]:
        reasons = outputs.pop("finish_reason")
        cumulative = outputs.pop("cumulative_logprob")
        o = self.options
        if o.return_finish_reason:
            outputs["finish_reason"] = reasons
        if o.return_cumulative_logprob:
            outputs["cumulative_logprob"] = _strings([float(x) for x in cumulative])
        if o.return_stop_reason:
            outputs["stop_reason"] = _strings([self._stop_reason(out)])
        metrics = getattr(out, "metrics", None)
        if o.return_perf_metrics and metrics is not None:
            outputs.update(perf_metrics_strings(metrics))
        return outputs

    def _stop_reason(self, out) -> str:
        """The token id that ended the request (EOS or a stop token), as the LLM API reports
        it; "None" otherwise (a stop string's text is not reported)."""
        if (
            not out.finished
            or str(out.finish_reason) != "stop"
            or self.options.stop_words
            or not out.token_ids
        ):
            return "None"
        return str(out.token_ids[-1])


def perf_metrics_strings(m) -> Dict[str, np.ndarray]:
    """The LLM API model's perf metrics: every value a string, its names."""
    looked_up = m.kv_total_blocks
    values = {
        "acceptance_rate": m.acceptance_rate,
        "arrival_time_ns": nanoseconds(m.arrival_time),
        "first_scheduled_time_ns": nanoseconds(m.first_scheduled_time),
        "first_token_time_ns": nanoseconds(m.first_token_time),
        "kv_cache_alloc_new_blocks": m.kv_new_blocks,
        "kv_cache_alloc_total_blocks": m.kv_total_blocks,
        "kv_cache_hit_rate": m.kv_reused_blocks / looked_up if looked_up else 0.0,
        "kv_cache_missed_block": m.kv_new_blocks,
        "kv_cache_reused_block": m.kv_reused_blocks,
        "last_token_time_ns": nanoseconds(m.last_token_time),
        "total_accepted_draft_tokens": m.accepted_draft_tokens,
        "total_draft_tokens": m.draft_tokens,
    }
    return {name: _strings([value]) for name, value in values.items()}
