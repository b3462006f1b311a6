"""Request-level batching, the baselines that continuous batching is measured against.

A batch is formed only when the previous one has fully drained, then runs in lockstep:
prompts padded to the longest, finished rows kept as padding until its longest request
ends. ``static`` always computes ``max_batch_size`` rows (empty slots are padding);
``dynamic`` releases a batch when it is full or its oldest request has waited
``max_queue_delay_ms``, and computes only the rows it formed with.
"""

from __future__ import annotations

import time
from typing import Any, Optional

from slipstream.core.lora_limit import adapters_of, fits
from slipstream.core.request import Request, RequestStatus
from slipstream.core.scheduler import SchedulerBase
from slipstream.core.scheduler_output import BatchPadding, ScheduledRequest, SchedulerOutput


class BatchScheduler(SchedulerBase):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.dynamic = self.config.batching == "dynamic"
        self.batch: list[Request] = []  # the batch in flight, finished rows included

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if all(r.is_finished for r in self.batch):
            self.batch = []
            if not self._form_batch():
                return out
        live = [r for r in self.batch if not r.is_finished]
        for req in live:
            num_new = self._tokens_wanted(req)
            if not self.bm.can_allocate(req, num_new):
                raise RuntimeError(
                    "KV cache too small for the static batch: lower "
                    "max_batch_size or raise the KV budget"
                )
            self.bm.allocate(req, num_new)
            out.scheduled.append(ScheduledRequest(req, num_new))
        rows = len(self.batch) if self.dynamic else self.config.max_batch_size
        prefill = [s.num_new_tokens for s in out.scheduled if s.num_new_tokens > 1]
        out.padding = BatchPadding(
            padded_prompt_len=max(prefill, default=0), num_padding_seqs=rows - len(live)
        )
        return out

    def next_wakeup(self) -> Optional[float]:
        """Dynamic batching: when the pending batch will be released by its delay window."""
        if not self.dynamic or self.batch or not self.waiting:
            return None
        oldest = min(r.arrival_time for r in self.waiting)
        return oldest + self.config.max_queue_delay_ms / 1000

    def _form_batch(self) -> bool:
        if not self.waiting:
            return False
        now = time.monotonic()
        if self.dynamic and len(self.waiting) < self.config.max_batch_size:
            release = self.next_wakeup()  # set: no batch in flight, requests waiting
            if release is not None and now < release:
                return False
        ordered = sorted(self.waiting, key=lambda r: self.key(r, now))
        for req in ordered:
            if len(self.batch) == self.config.max_batch_size:
                break
            if not fits(req, adapters_of(self.batch), self.max_loras):
                continue  # its adapter would exceed max_loras: a later batch takes it
            self.waiting.remove(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self.batch.append(req)
        return True
