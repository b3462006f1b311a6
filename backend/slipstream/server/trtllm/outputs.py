"""TensorRT-LLM ensemble outputs of one engine request, added to what ``ResponseBuilder``
builds. Pure Python (no Triton).

* ``cum_log_probs`` FP32 [1, 1] and ``output_log_probs`` FP32 [1, 1, T] (batch, beam, tokens of
  this response) when the request set ``return_log_probs``;
* ``batch_index`` / ``sequence_index`` INT32 [1, 1] for batched requests and for
  ``num_return_sequences``;
* beam search (``beam_width`` > 1): one response with every returned beam, best first:
  ``text_output`` [beams], ``cum_log_probs`` [1, beams], ``output_log_probs`` [1, beams, T]
  (zero-padded), ``sequence_index`` 0; streamed, such a response after every round (every
  live beam's whole text), as TRT-LLM streams beams;
* ``num_return_sequences`` > 1 without streaming: one response per sequence, each with its
  ``sequence_index`` (``finals``);
* ``return_perf_metrics``: ``kv_cache_*_blocks``, ``*_time_ns``, ``acceptance_rate``,
  ``total_*draft_tokens`` [1, 1] on the request's last response(s);
* ``sequence_length`` INT32 [1, 1] (beam search [1, beams]) when the request names it: the
  tokens its text holds (the prompt's too when the prompt is prepended, as TRT-LLM counts);
* ``end_id``'s text is not emitted (the stub's ``ResponseBuilder`` drops it).

``OUTPUTS`` are the outputs a model declares for them.
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Mapping, Optional, Sequence

import numpy as np

from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.trtllm.inputs import TrtllmOptions


def _scalars(data_type: str, *names: str) -> list[Mapping[str, object]]:
    """Outputs of one value each, all of one type."""
    return [{"name": n, "data_type": data_type, "dims": [1]} for n in names]


# TensorRT-LLM ensemble outputs (built here); the logits are never produced. Not
# declared in vLLM backend's layout unless asked for (its config must stay vLLM's).
OUTPUTS: tuple[Mapping[str, object], ...] = (
    {"name": "cum_log_probs", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "output_log_probs", "data_type": "TYPE_FP32", "dims": [-1, -1]},
    {"name": "context_logits", "data_type": "TYPE_FP32", "dims": [-1, -1]},
    {"name": "generation_logits", "data_type": "TYPE_FP32", "dims": [-1, -1, -1]},
    {"name": "batch_index", "data_type": "TYPE_INT32", "dims": [1]},
    {"name": "sequence_index", "data_type": "TYPE_INT32", "dims": [1]},
    # return_perf_metrics (TensorRT-LLM's types; times in ns since the epoch)
    *_scalars(
        "TYPE_INT32",
        "kv_cache_alloc_new_blocks",
        "kv_cache_reused_blocks",
        "kv_cache_alloc_total_blocks",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
    ),
    *_scalars(
        "TYPE_INT64",
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "last_token_time_ns",
    ),
    {"name": "acceptance_rate", "data_type": "TYPE_FP32", "dims": [1]},
    # the tokens of each returned sequence's text (beams: [1, beams]), as TensorRT-LLM's model
    # reports beside its token ids
    {"name": "sequence_length", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1, -1]},  # refused by name
)


class TrtllmResponses:
    """Wraps a ``ResponseBuilder`` (the stub's ``Responses``) for one row of a request."""

    def __init__(self, inner: ResponseBuilder, options: TrtllmOptions) -> None:
        self.inner, self.options, self.tokenizer = inner, options, inner.tokenizer
        self.logprobs: List[float] = []

    def streamed(self, out) -> Optional[Dict[str, np.ndarray]]:
        """A streamed response. Beam search streams as TRT-LLM does: every beam's whole text
        after each round (beams change their past), then the finished beams."""
        if out.beams is not None:
            return self._snapshot(out) if self.options.beam_width > 1 else None
        if self.options.beam_width > 1:
            if not out.finished:  # the finished beams come one by one: answered together
                self.absorb(out)
                return None
            return self.final(out)
        outputs = self.inner.delta(out)
        if self.options.num_return_sequences > 1:  # only the sequence that moved
            outputs = _one_sequence(outputs, out.index, self.options.num_return_sequences)
        return self._extend(outputs, out, list(out.logprobs or []), len(out.token_ids))

    def absorb(self, out) -> None:
        self.inner.absorb(out)
        self.logprobs.extend(out.logprobs or [])

    def final(self, out) -> Dict[str, np.ndarray]:
        outputs = self.inner.final(out)  # absorbs ``out`` into the inner builder
        self.logprobs.extend(out.logprobs or [])
        if self.options.beam_width > 1:
            return self._beams(outputs, out)
        length = len(self.inner.sequences[out.index].token_ids) + self._prompt_tokens(out)
        return self._extend(outputs, out, self.logprobs, length)

    def finals(self, out) -> List[Dict[str, np.ndarray]]:
        """The last responses of a request that is not streamed: one, or with
        ``num_return_sequences`` > 1 one per sequence (its ``sequence_index``), as TRT-LLM
        answers them."""
        outputs = self.final(out)
        n = self.options.num_return_sequences
        if n == 1 or self.options.beam_width > 1:
            return [outputs]
        responses = []
        for i, seq in enumerate(self.inner.sequences):
            one = _one_sequence(outputs, i, n)
            seq_out = dataclasses.replace(out, index=i, cumulative_logprob=seq.cumulative_logprob)
            length = len(seq.token_ids) + self._prompt_tokens(out)
            responses.append(self._extend(one, seq_out, seq.logprobs, length))
        return responses

    def _snapshot(self, out) -> Dict[str, np.ndarray]:
        texts = [self.tokenizer.decode(b.token_ids, skip_special_tokens=True) for b in out.beams]
        outputs = {"text_output": np.array([t.encode("utf-8") for t in texts], np.object_)}
        if self.options.return_log_probs:
            outputs.update(
                _log_prob_table(
                    [b.logprobs for b in out.beams], [b.cumulative_logprob for b in out.beams]
                )
            )
        self._lengths(outputs, [len(b.token_ids) for b in out.beams])
        return self._indices(outputs, out)

    def _beams(self, outputs: Dict[str, np.ndarray], out) -> Dict[str, np.ndarray]:
        beams = self.inner.sequences
        if self.options.return_log_probs:
            outputs.update(
                _log_prob_table([b.logprobs for b in beams], [b.cumulative_logprob for b in beams])
            )
        prompt = self._prompt_tokens(out)
        self._lengths(outputs, [len(b.token_ids) + prompt for b in beams])
        return self._indices(self._perf(outputs, out), out)

    def _extend(
        self, outputs: Dict[str, np.ndarray], out, logprobs: Sequence[float], length: int
    ) -> Dict[str, np.ndarray]:
        """``length``: the tokens this response's text holds (``sequence_length``)."""
        self._lengths(outputs, [length])
        if self.options.return_log_probs:
            outputs["cum_log_probs"] = np.array([[out.cumulative_logprob]], dtype=np.float32)
            outputs["output_log_probs"] = np.array(
                [[[float(x) for x in logprobs]]], dtype=np.float32
            ).reshape(1, 1, -1)
        return self._indices(self._perf(outputs, out), out)

    def _prompt_tokens(self, out) -> int:
        """The prompt's tokens when a final text starts with the prompt (TensorRT-LLM's
        ``sequence_length`` counts them then: its output ids hold the prompt)."""
        return 0 if self.inner.options.exclude_input_in_output else int(out.num_prompt_tokens)

    def _lengths(self, outputs: Dict[str, np.ndarray], lengths: Sequence[int]) -> None:
        if self.options.sequence_length:  # [1, beams], as TensorRT-LLM's
            outputs["sequence_length"] = np.array([list(lengths)], dtype=np.int32)

    def _indices(self, outputs: Dict[str, np.ndarray], out) -> Dict[str, np.ndarray]:
        if self.options.with_indices:
            outputs["batch_index"] = np.array([[self.options.batch_index]], dtype=np.int32)
            index = getattr(out, "index", 0) if self.options.beam_width == 1 else 0
            outputs["sequence_index"] = np.array([[index]], dtype=np.int32)
        return outputs

    def _perf(self, outputs: Dict[str, np.ndarray], out) -> Dict[str, np.ndarray]:
        metrics = getattr(out, "metrics", None)
        if self.options.return_perf_metrics and metrics is not None:
            outputs.update(perf_metrics_outputs(metrics))
        return outputs


def _log_prob_table(
    logprobs: Sequence[Sequence[float]], cumulative: Sequence[float]
) -> Dict[str, np.ndarray]:
    """``cum_log_probs`` [1, beams] and ``output_log_probs`` [1, beams, T] (zero-padded)."""
    longest = max(len(lps) for lps in logprobs)
    table = np.zeros((1, len(logprobs), longest), dtype=np.float32)
    for i, lps in enumerate(logprobs):
        table[0, i, : len(lps)] = [float(x) for x in lps]
    return {
        "cum_log_probs": np.array([list(cumulative)], dtype=np.float32),
        "output_log_probs": table,
    }


def nanoseconds(seconds) -> int:
    return 0 if seconds is None else int(round(seconds * 1e9))


def perf_metrics_outputs(m) -> Dict[str, np.ndarray]:
    """TensorRT-LLM's per-request perf metrics outputs (``RequestMetrics``), each [1, 1]."""

    def one(value, dtype) -> np.ndarray:
        return np.array([[value]], dtype=dtype)

    return {
        "kv_cache_alloc_new_blocks": one(m.kv_new_blocks, np.int32),
        "kv_cache_reused_blocks": one(m.kv_reused_blocks, np.int32),
        "kv_cache_alloc_total_blocks": one(m.kv_total_blocks, np.int32),
        "arrival_time_ns": one(nanoseconds(m.arrival_time), np.int64),
        "first_scheduled_time_ns": one(nanoseconds(m.first_scheduled_time), np.int64),
        "first_token_time_ns": one(nanoseconds(m.first_token_time), np.int64),
        "last_token_time_ns": one(nanoseconds(m.last_token_time), np.int64),
        "acceptance_rate": one(m.acceptance_rate, np.float32),
        "total_accepted_draft_tokens": one(m.accepted_draft_tokens, np.int32),
        "total_draft_tokens": one(m.draft_tokens, np.int32),
    }


def _one_sequence(outputs: Dict[str, np.ndarray], index: int, n: int) -> Dict[str, np.ndarray]:
    """TRT-LLM answers each of ``num_return_sequences`` on its own (``sequence_index`` says
    which): keep that sequence's element of every per-sequence output."""
    return {
        name: (value[index : index + 1] if np.ndim(value) and len(value) == n else value)
        for name, value in outputs.items()
    }
