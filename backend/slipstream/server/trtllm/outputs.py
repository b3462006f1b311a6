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
* ``end_id``'s text is not emitted (TRT-LLM stops on it without detokenizing it).

``merge_rows`` stacks the final outputs of a batched request's rows into one response, for
non-decoupled models (one response per request).
"""

from __future__ import annotations

import dataclasses
from typing import Dict, List, Optional, Sequence

import numpy as np

from slipstream.core.request import FinishReason
from slipstream.server.trtllm.inputs import TrtllmOptions


class TrtllmResponses:
    """Wraps a ``ResponseBuilder`` (same three methods) for one row of a request."""

    def __init__(self, inner, options: TrtllmOptions, tokenizer=None) -> None:
        self.inner, self.options, self.tokenizer = inner, options, tokenizer
        self.logprobs: List[float] = []

    streams = True  # a streaming request gets a response per output (or None: nothing)

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
        out = self._strip_end_id(out)
        outputs = self.inner.streamed(out)
        if self.options.num_return_sequences > 1:  # only the sequence that moved
            outputs = _one_sequence(outputs, out.index, self.options.num_return_sequences)
        return self._extend(outputs, out, list(out.logprobs or []))

    def absorb(self, out) -> None:
        out = self._strip_end_id(out)
        self.inner.absorb(out)
        self.logprobs.extend(out.logprobs or [])

    def final(self, out) -> Dict[str, np.ndarray]:
        out = self._strip_end_id(out)
        outputs = self.inner.final(out)  # absorbs ``out`` into the inner builder
        self.logprobs.extend(out.logprobs or [])
        if self.options.beam_width > 1:
            return self._beams(outputs, out)
        return self._extend(outputs, out, self.logprobs)

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
            responses.append(self._extend(one, seq_out, seq.logprobs))
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
        return self._indices(outputs, out)

    def _beams(self, outputs: Dict[str, np.ndarray], out) -> Dict[str, np.ndarray]:
        beams = self.inner.sequences
        if self.options.return_log_probs:
            outputs.update(
                _log_prob_table([b.logprobs for b in beams], [b.cumulative_logprob for b in beams])
            )
        return self._indices(self._perf(outputs, out), out)

    def _extend(
        self, outputs: Dict[str, np.ndarray], out, logprobs: Sequence[float]
    ) -> Dict[str, np.ndarray]:
        if self.options.return_log_probs:
            outputs["cum_log_probs"] = np.array([[out.cumulative_logprob]], dtype=np.float32)
            outputs["output_log_probs"] = np.array(
                [[[float(x) for x in logprobs]]], dtype=np.float32
            ).reshape(1, 1, -1)
        return self._indices(self._perf(outputs, out), out)

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

    def _strip_end_id(self, out):
        """The finished output without the text of the ``end_id`` token that stopped it."""
        if not (
            self.options.end_ids
            and out.finished
            and out.token_ids
            and out.finish_reason is FinishReason.STOP
            and out.token_ids[-1] in self.options.end_ids
            and self.tokenizer is not None
        ):
            return out
        piece = self.tokenizer.decode([out.token_ids[-1]])
        if piece and out.text.endswith(piece):
            return dataclasses.replace(out, text=out.text[: -len(piece)])
        return out


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


def _ns(seconds) -> int:
    return 0 if seconds is None else int(round(seconds * 1e9))


def perf_metrics_outputs(m) -> Dict[str, np.ndarray]:
    """TensorRT-LLM's per-request perf metrics outputs (``RequestMetrics``), each [1, 1]."""

    def one(value, dtype) -> np.ndarray:
        return np.array([[value]], dtype=dtype)

    return {
        "kv_cache_alloc_new_blocks": one(m.kv_new_blocks, np.int32),
        "kv_cache_reused_blocks": one(m.kv_reused_blocks, np.int32),
        "kv_cache_alloc_total_blocks": one(m.kv_total_blocks, np.int32),
        "arrival_time_ns": one(_ns(m.arrival_time), np.int64),
        "first_scheduled_time_ns": one(_ns(m.first_scheduled_time), np.int64),
        "first_token_time_ns": one(_ns(m.first_token_time), np.int64),
        "last_token_time_ns": one(_ns(m.last_token_time), np.int64),
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


def merge_rows(rows: Sequence[Dict[str, np.ndarray]]) -> Dict[str, np.ndarray]:
    """One response from the rows' final outputs: each output stacked on a leading batch
    dimension (ragged ``output_log_probs`` padded with zeros, as TRT-LLM pads)."""
    merged: Dict[str, np.ndarray] = {}
    for name in rows[0]:
        parts = [np.asarray(r[name]) for r in rows]
        if parts[0].ndim == 0:
            merged[name] = np.stack(parts)
            continue
        longest = max(p.shape[-1] for p in parts)
        if any(p.shape[-1] != longest for p in parts):
            parts = [
                np.pad(p, [(0, 0)] * (p.ndim - 1) + [(0, longest - p.shape[-1])]) for p in parts
            ]
        merged[name] = np.concatenate(parts, axis=0)
    return merged
