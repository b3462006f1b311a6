"""TensorRT-LLM ``inflight_batcher_llm`` ensemble inputs, turned into what ``parse_request``
reads. Pure Python (no Triton).

TRT-LLM clients send every tensor with a batch dimension (``text_input`` [B, 1]) when the
model's config has ``max_batch_size`` > 0: ``split_rows`` cuts such a request into B rows, each
one engine request. ``translate`` then maps one row's TRT-LLM-only inputs onto Slipstream's
sampling settings (``min_length`` -> ``min_tokens``, ``random_seed`` -> ``seed``,
``num_return_sequences`` -> ``n``, ``bad_words``, ``embedding_bias_*`` -> ``logit_bias`` ...)
and refuses, naming the input, what a text model served here cannot honour (beam search,
logits outputs, LoRA by task id). Guided decoding's inputs pass on to ``parse_request``
(``guided_decoding.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional

import numpy as np

from slipstream.server.stub.input_table import Reading, RequestInput, TritonType
from slipstream.server.stub.input_values import (
    BadRequestError,
    flag_value,
    int_value,
    scalar,
    string_values,
)
from slipstream.server.stub.request_interface import NativeRow, native_row

_TOKEN_IDS = "refused: the TRT-LLM core model's token-id interface is not served"
_PTUNING = "refused: prompt tuning is not supported"
_LORA_WEIGHTS = "refused: LoRA weights in the request (serve adapters with `enable_lora`)"


def _row(name: str, data_type: TritonType, dims: tuple[int, ...], description: str) -> RequestInput:
    return RequestInput(name, data_type, dims, Reading.INTERFACE, description)


# The ensemble's inputs a model declares beside the native ones ("refused" = only when set).
INPUTS: tuple[RequestInput, ...] = (
    _row("bad_words", TritonType.STRING, (-1,), "words never generated"),
    _row("pad_id", TritonType.INT32, (1,), "accepted; outputs are text, nothing is padded"),
    _row("min_length", TritonType.INT32, (1,), "older name of `min_tokens`"),
    _row("beam_width", TritonType.INT32, (1,), "beam search's width"),
    _row("num_return_sequences", TritonType.INT32, (1,), "sequences returned (`n`)"),
    _row("length_penalty", TritonType.FP32, (1,), "beam search's length penalty"),
    _row("random_seed", TritonType.UINT64, (1,), "older name of `seed`"),
    _row("return_log_probs", TritonType.BOOL, (1,), "add `cum_log_probs`, `output_log_probs`"),
    _row("return_context_logits", TritonType.BOOL, (1,), "refused when true: no logits"),
    _row("return_generation_logits", TritonType.BOOL, (1,), "refused when true: no logits"),
    _row("return_perf_metrics", TritonType.BOOL, (1,), "add the per-request metrics"),
    _row("embedding_bias_words", TritonType.STRING, (-1,), "words whose logits get a bias"),
    _row("embedding_bias_weights", TritonType.FP32, (-1,), "each word's bias"),
    _row(
        "decoder_text_input",
        TritonType.STRING,
        (1,),
        "refused: encoder-decoder models are not supported",
    ),
    _row("lora_task_id", TritonType.UINT64, (1,), "refused: LoRA by task id"),
    # declared so that they are refused by name (check_unsupported) rather than
    # as unexpected inputs
    _row("prompt_embedding_table", TritonType.FP16, (-1, -1), _PTUNING),
    _row("prompt_table_extra_id", TritonType.UINT64, (1,), _PTUNING),
    _row("prompt_vocab_size", TritonType.INT32, (1,), _PTUNING),
    _row("lora_weights", TritonType.FP16, (-1, -1), _LORA_WEIGHTS),
    _row("lora_config", TritonType.INT32, (-1, 3), _LORA_WEIGHTS),
    _row("input_ids", TritonType.INT32, (-1,), _TOKEN_IDS),
    _row("input_lengths", TritonType.INT32, (1,), _TOKEN_IDS),
    _row("request_output_len", TritonType.INT32, (1,), _TOKEN_IDS),
    _row("stop", TritonType.BOOL, (1,), "refused when true: in-band stop"),
)
INPUT_NAMES: tuple[str, ...] = tuple(row.name for row in INPUTS)
# Inputs read here and never passed on to parse_request.
TRTLLM_INPUTS = (
    "bad_words",
    "pad_id",
    "length_penalty",
    "min_length",
    "random_seed",
    "return_log_probs",
    "return_context_logits",
    "return_generation_logits",
    "return_perf_metrics",
    "beam_width",
    "num_return_sequences",
    "embedding_bias_words",
    "embedding_bias_weights",
    "decoder_text_input",
    "lora_task_id",
    "stop",
)
# Inputs whose any non-empty value is refused: input name -> why.
REFUSED = {
    "decoder_text_input": "encoder-decoder models are not supported",
    "lora_task_id": "LoRA adapters by task id are not supported",
}
# Inputs refused whenever a request carries them (checked before anything else: a token-id
# request has no text_input): input name -> why.
_NO_PTUNING = "prompt tuning (p-tuning embedding tables) is not supported"
_NO_LORA_WEIGHTS = (
    "LoRA weights sent with the request are not supported; serve adapters "
    "with enable_lora and pick one by lora_name"
)
_NO_TOKEN_IDS = (
    "this model takes text (text_input) and answers text (text_output); the "
    "TRT-LLM core model's token-id interface (input_ids, input_lengths, "
    "request_output_len, output_ids) is not served"
)
REFUSED_ALWAYS = {
    "prompt_embedding_table": _NO_PTUNING,
    "prompt_table_extra_id": _NO_PTUNING,
    "prompt_vocab_size": _NO_PTUNING,
    "lora_weights": _NO_LORA_WEIGHTS,
    "lora_config": _NO_LORA_WEIGHTS,
    "input_ids": _NO_TOKEN_IDS,
    "input_lengths": _NO_TOKEN_IDS,
    "request_output_len": _NO_TOKEN_IDS,
}
REFUSED_OUTPUTS = {"output_ids": _NO_TOKEN_IDS}
# In-band stop (a second request with stop=true ending the first): refused when true.
STOP_IN_BAND = (
    "in-band stop requests are not supported: cancel the request instead (close "
    "the gRPC stream or the HTTP connection)"
)
# Flags that may be sent as false only.
REFUSED_FLAGS = {
    "return_context_logits": "this backend does not return logits",
    "return_generation_logits": "this backend does not return logits",
}
# TRT-LLM's texts: its executor's when the waiting queue is full (prefixed with Triton's own
# queue-policy text, which TRT-LLM's max_queue_size test matches).
QUEUE_FULL = (
    "Exceeds maximum queue size: Maximum queue size of {limit} has been reached, "
    "please try again later"
)
# Each of num_return_sequences > 1 is answered on its own (with its sequence_index): one
# response per request (a model not decoupled) cannot carry them.
PER_SEQUENCE_NEEDS_DECOUPLED = (
    "input 'num_return_sequences' > 1 needs a decoupled model: each sequence is answered on its own"
)


def trtllm_queue_full(limit: int) -> str:
    return QUEUE_FULL.format(limit=limit)


@dataclass
class TrtllmOptions:
    """What a row asked for that only the TRT-LLM outputs carry."""

    return_log_probs: bool = False
    with_indices: bool = False  # emit batch_index and sequence_index
    batch_index: int = 0
    num_return_sequences: int = 1  # > 1: one response stream per sequence, as TRT-LLM sends
    beam_width: int = 1  # > 1: every beam in one response, [1, beam_width, ...]
    return_perf_metrics: bool = False
    sequence_length: bool = False  # emit sequence_length (the request names it)


@dataclass
class TranslatedRow:
    row: NativeRow  # what parse_request reads, and the settings merged over the parameters
    options: TrtllmOptions


def split_rows(inputs: Mapping[str, np.ndarray], batched: bool) -> List[Dict[str, np.ndarray]]:
    """One dict per sequence of the request; each array without its batch dimension."""
    if not batched:
        return [dict(inputs)]
    if "text_input" not in inputs:
        raise BadRequestError("missing required input 'text_input'")
    size = np.asarray(inputs["text_input"]).shape[0]
    rows: List[Dict[str, np.ndarray]] = [{} for _ in range(size)]
    for name, value in inputs.items():
        arr = np.asarray(value)
        if arr.ndim == 0 or arr.shape[0] != size:
            raise BadRequestError(
                f"input '{name}' has batch size "
                f"{arr.shape[0] if arr.ndim else 0}, 'text_input' {size}"
            )
        for i in range(size):
            rows[i][name] = arr[i]
    return rows


def check_unsupported(
    inputs: Mapping[str, np.ndarray], requested_outputs=(), declared_outputs=()
) -> None:
    """Refuse, naming it, what a TRT-LLM client may send that is never served here. Triton
    lists every declared output as requested when the client names none: only outputs
    named among fewer than all are refused."""
    for name, why in REFUSED_ALWAYS.items():
        if inputs.get(name) is not None:
            raise BadRequestError(f"input '{name}' is not supported: {why}")
    named = set(requested_outputs or ())
    if named and named == set(declared_outputs or ()):
        named = set()
    for name in sorted(named):
        if name in REFUSED_OUTPUTS:
            raise BadRequestError(f"output '{name}' is not supported: {REFUSED_OUTPUTS[name]}")
    stop = inputs.get("stop")
    if stop is not None and np.asarray(stop).dtype.kind == "b" and bool(np.asarray(stop).any()):
        raise BadRequestError(f"input 'stop' is not supported: {STOP_IN_BAND}")


def translate(
    row: Mapping[str, np.ndarray],
    encode: Optional[Callable[[str], List[int]]] = None,
    *,
    batch_index: int = 0,
    with_indices: bool = False,
    trtllm_defaults: bool = False,
) -> TranslatedRow:
    """Map one row's TRT-LLM inputs; ``encode`` tokenizes embedding-bias words (no special
    tokens). ``trtllm_defaults``: TRT-LLM's semantics where they differ from vLLM's: greedy
    unless ``top_k`` or ``top_p`` is above 0, and a streamed request never repeats the prompt
    (``exclude_input_in_output=false`` is ignored, not refused). Raises ``BadRequestError``
    naming the input it cannot honour."""
    inputs = {k: v for k, v in row.items() if v is not None and k not in TRTLLM_INPUTS}
    present = {k: v for k, v in row.items() if v is not None and k in TRTLLM_INPUTS}
    params: Dict[str, Any] = {}
    opts = TrtllmOptions(batch_index=batch_index, with_indices=with_indices)
    _refuse(present)
    beam_width = _beam_width(present)
    _length_penalty(present, beam_width, params)
    if "return_perf_metrics" in present:
        opts.return_perf_metrics = flag_value("return_perf_metrics", present["return_perf_metrics"])
    if "pad_id" in present:
        int_value("pad_id", present["pad_id"])  # outputs are text: nothing is padded
    _older_names(present, inputs)
    _sequences(present, beam_width, params, opts)
    _bad_words_and_bias(present, params, encode)
    native = native_row(inputs)  # stop words and end_id, as the stub reads them
    native.parameters = params
    if trtllm_defaults:
        _trtllm_semantics(native.inputs, beam_width)
    return TranslatedRow(native, opts)


def _refuse(present: Mapping[str, np.ndarray]) -> None:
    for name, why in REFUSED.items():
        if (
            name in present
            and np.asarray(present[name]).size
            and any(x not in (b"", "", 0) for x in np.asarray(present[name]).reshape(-1))
        ):
            raise BadRequestError(f"input '{name}' is not supported: {why}")
    for name, why in REFUSED_FLAGS.items():
        if name in present and flag_value(name, present[name]):
            raise BadRequestError(f"input '{name}' is not supported: {why}")


def _beam_width(present: Mapping[str, np.ndarray]) -> int:
    beam_width = int_value("beam_width", present["beam_width"]) if "beam_width" in present else 1
    if beam_width < 1:
        raise BadRequestError(f"input 'beam_width' must be >= 1, got {beam_width}")
    return beam_width


def _length_penalty(
    present: Mapping[str, np.ndarray], beam_width: int, params: Dict[str, Any]
) -> None:
    if "length_penalty" not in present:
        return
    # TRT-LLM applies it to beam scores only: with one beam any finite value is a no-op.
    value = float(scalar("length_penalty", present["length_penalty"]))
    if not math.isfinite(value):
        raise BadRequestError(f"input 'length_penalty' must be a finite number, got {value}")
    if beam_width > 1:
        params["length_penalty"] = value


def _older_names(present: Mapping[str, np.ndarray], inputs: Dict[str, np.ndarray]) -> None:
    """Older ensembles' names for min_tokens and seed; the newer names win when both come."""
    if "min_length" in present and "min_tokens" not in inputs:
        inputs["min_tokens"] = np.asarray(present["min_length"])
    if "random_seed" in present and "seed" not in inputs:
        inputs["seed"] = np.asarray(present["random_seed"])


def _sequences(
    present: Mapping[str, np.ndarray], beam_width: int, params: Dict[str, Any], opts: TrtllmOptions
) -> None:
    """How many sequences come back, and with which log-probabilities."""
    if "num_return_sequences" in present:
        params["n"] = int_value("num_return_sequences", present["num_return_sequences"])
        opts.with_indices = True
        if beam_width == 1:
            opts.num_return_sequences = params["n"]
    if beam_width > 1:  # the n best beams (all unless num_return_sequences says fewer)
        params["beam_width"] = opts.beam_width = beam_width
        params.setdefault("n", beam_width)
    if "return_log_probs" in present and flag_value(
        "return_log_probs", present["return_log_probs"]
    ):
        opts.return_log_probs = True
        params["logprobs"] = 0  # the sampled tokens' own log-probabilities


def _bad_words_and_bias(
    present: Mapping[str, np.ndarray],
    params: Dict[str, Any],
    encode: Optional[Callable[[str], List[int]]],
) -> None:
    if "bad_words" in present:
        words = string_values("bad_words", present["bad_words"])
        if words:
            params["bad_words"] = words
    if "embedding_bias_words" in present or "embedding_bias_weights" in present:
        bias = _embedding_bias(present, encode)
        if bias:
            params["logit_bias"] = bias


def _trtllm_semantics(inputs: Dict[str, np.ndarray], beam_width: int) -> None:
    if "sampling_parameters" not in inputs and beam_width == 1:  # beams are never sampled
        greedy_unless_sampling(inputs)
    if (
        "stream" in inputs
        and np.asarray(inputs["stream"]).dtype.kind == "b"
        and flag_value("stream", inputs["stream"])
    ):
        inputs.pop("exclude_input_in_output", None)


def greedy_unless_sampling(inputs: Dict[str, np.ndarray]) -> None:
    """TRT-LLM samples only when top_k > 0 or top_p > 0 (both 0 or absent: greedy, whatever
    the temperature); Slipstream's own defaults (top_k off, top_p 1.0) sample."""
    top_k = inputs.get("top_k")
    top_p = inputs.get("top_p")
    k_off = top_k is None or (np.asarray(top_k).size == 1 and int(scalar("top_k", top_k)) == 0)
    p_off = top_p is None or (np.asarray(top_p).size == 1 and float(scalar("top_p", top_p)) == 0.0)
    if k_off and p_off:
        inputs["top_k"] = np.array([1], dtype=np.int32)
        inputs.pop("top_p", None)


def _embedding_bias(
    present: Mapping[str, np.ndarray], encode: Optional[Callable[[str], List[int]]]
) -> Dict[int, float]:
    """TRT-LLM's preprocessing: each word's tokens get the word's weight added to their logit."""
    words = string_values("embedding_bias_words", present.get("embedding_bias_words", np.array([])))
    raw = np.asarray(present.get("embedding_bias_weights", np.array([], np.float32)))
    if raw.size and raw.dtype.kind != "f":
        raise BadRequestError("input 'embedding_bias_weights' must be FP32")
    weights = [float(w) for w in raw.reshape(-1)]
    if len(words) != len(weights):
        raise BadRequestError(
            f"inputs 'embedding_bias_words' ({len(words)}) and "
            f"'embedding_bias_weights' ({len(weights)}) must have the same "
            "length"
        )
    if not words:
        return {}
    if encode is None:
        raise BadRequestError("input 'embedding_bias_words' needs the model's tokenizer")
    bias: Dict[int, float] = {}
    for word, weight in zip(words, weights):
        if not math.isfinite(weight):
            raise BadRequestError(f"input 'embedding_bias_weights' must be finite, got {weight}")
        for token in encode(word):
            bias[int(token)] = bias.get(int(token), 0.0) + weight
    return bias
