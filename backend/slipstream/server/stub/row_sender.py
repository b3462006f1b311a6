"""The response sender of one row of a batched Triton request (``max_batch_size`` > 0: B
sequences in one request, each its own engine request).

Every row gets a ``RowSender`` standing in for the request's response sender, so the adapter
treats rows as requests. The ``RowGroup`` behind them ends the Triton request once: decoupled,
each row's responses go out as they come and the FINAL flag rides on the last row's last
response; non-decoupled (one response per request), the rows' final outputs are stacked into
one response (``merge_rows``), or the first row's error is the answer. A model that is not
decoupled answers its one-row requests through a group too. ``pb_utils`` is passed in: no
Triton import here.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Sequence

import numpy as np


class RowGroup:
    def __init__(self, sender, num_rows: int, decoupled: bool, pb_utils) -> None:
        self.sender, self.decoupled, self.pb = sender, decoupled, pb_utils
        self.final_flag = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
        self.pending = num_rows
        self.finals: List = [None] * num_rows  # each row's final response
        self.error = None  # the first row error (non-decoupled)
        self.lock = threading.Lock()

    def senders(self) -> List["RowSender"]:
        return [RowSender(self, i) for i in range(len(self.finals))]

    def _send(self, row: int, response, flags: int) -> None:
        with self.lock:
            if not flags & self.final_flag:
                if response is not None:
                    self.sender.send(response)
                return
            self.pending -= 1
            last = self.pending == 0
            if self.decoupled:
                if response is not None:
                    self.sender.send(response, flags=self.final_flag if last else 0)
                elif last:
                    self.sender.send(flags=self.final_flag)
                return
            self._keep(row, response)
            if last:
                self._answer()

    def _keep(self, row: int, response) -> None:
        if response is None:
            return
        if response.has_error():
            self.error = self.error or response
        else:
            self.finals[row] = response

    def _answer(self) -> None:
        if self.error is not None or any(f is None for f in self.finals):
            if self.error is not None:
                self.sender.send(self.error, flags=self.final_flag)
            else:
                self.sender.send(flags=self.final_flag)
            return
        if len(self.finals) == 1:
            self.sender.send(self.finals[0], flags=self.final_flag)
            return
        merged = merge_rows(
            [{t.name(): t.as_numpy() for t in r.output_tensors()} for r in self.finals]
        )
        self.sender.send(
            self.pb.InferenceResponse(
                output_tensors=[self.pb.Tensor(k, v) for k, v in merged.items()]
            ),
            flags=self.final_flag,
        )


class RowSender:
    """What the adapter calls instead of ``request.get_response_sender()``."""

    def __init__(self, group: RowGroup, row: int) -> None:
        self.group, self.row = group, row

    def send(self, response=None, flags: int = 0) -> None:
        self.group._send(self.row, response, flags)

    def is_cancelled(self) -> bool:
        return self.group.sender.is_cancelled()


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
