"""The engine's one call into the worker per step: run the scheduled batch through the model
AND sample it, returning a typed ``ModelRunnerOutput``.

Around the runner's forward it does what turns logits into tokens: parallel sampling's
fan-out (the step that completes a group's prompt samples its last row once per sequence),
beam search's candidate offers (beam slots are ranked by their group, not sampled), the
sampler, prompt logprobs, and the fail-soft rule: if the batch raises, each request runs
alone (its KV writes are idempotent), so only requests that fail by themselves end. A
tensor-parallel group's failure (``GroupFailure``) is not retried: the engine is done.

Everything the host reads back from the step -- sampled tokens, the logprobs asked for, beam
candidates, prompt logprobs -- is queued on the logits' device first and comes back in one
copy (``transfer.DeviceToHost``): on a GPU, the step's one synchronisation.
"""

from __future__ import annotations

import logging
import traceback
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from slipstream.core.beam_search import BeamSearch
from slipstream.core.request import Request
from slipstream.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from slipstream.worker.distributed.errors import GroupFailure
from slipstream.worker.model_runner import ModelRunner
from slipstream.worker.sample.sampler import (
    PerRequestError,
    PromptLogprobs,
    SampleResult,
    TokenSampler,
)
from slipstream.worker.transfer import DeviceToHost, HostToDevice, HostValue

log = logging.getLogger("slipstream")


@dataclass
class _Rows:
    """The logits of one step's sampled rows and who owns them."""

    logits: torch.Tensor  # [rows, V]
    per_request: list[list[int]]  # per scheduled request: its rows
    owners: list[Request]  # per row: the request (sequence) that samples it


class ModelExecutor:
    def __init__(self, runner: ModelRunner, sampler: TokenSampler) -> None:
        self.runner = runner
        self.sampler = sampler

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run and sample the step (fail-soft, see the module)."""
        try:
            return self._execute_batch(sched)
        except GroupFailure:  # no rank can run another step: nothing to retry
            raise
        except Exception as exc:
            if len(sched.scheduled) == 1:
                return _failed_alone(sched, exc)
            log.warning(
                "engine step failed (%s); retrying its %d requests one by one",
                exc,
                len(sched.scheduled),
            )
        merged = ModelRunnerOutput.empty(0)
        for item in sched.scheduled:
            alone = SchedulerOutput(scheduled=[item])
            try:
                merged.extend(self._execute_batch(alone))
            except Exception as exc:
                merged.extend(_failed_alone(alone, exc))
        return merged

    def _execute_batch(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if any(item.request.params.prompt_logprobs is not None for item in sched.scheduled):
            logits, sample_rows, prompt_logits = self.runner.execute_with_prompt_logits(sched)
        else:
            logits, sample_rows = self.runner.execute(sched)
            prompt_logits = []
        upload = self.runner.upload
        fetch = DeviceToHost(logits.device, upload.staged)
        rows = _fan_out(sched, logits, sample_rows, upload)
        beams = [_in_beam_search(item.request) for item in sched.scheduled]
        offers: Optional[_BeamOffers] = None
        if any(beams):  # beam slots are ranked by their group, not sampled
            rows, offers = _offer_beams(rows, self.sampler, upload, fetch)
            rows.per_request = [[] if beam else r for r, beam in zip(rows.per_request, beams)]
        pending = self.sampler.launch(rows.logits, rows.owners, fetch) if rows.owners else None
        prompts = [
            (item.request, _prompt_logprobs(item.request, rows_logits, upload, fetch))
            for item, rows_logits in zip(sched.scheduled, prompt_logits)
            if rows_logits is not None
        ]
        fetch.fetch()  # the step's one copy back
        if offers is not None:
            offers.deliver()
        failed: dict[str, str] = {}
        result: Optional[SampleResult] = None
        try:
            result = pending.result() if pending is not None else None
        except PerRequestError as err:  # only these requests' own rows failed: keep the rest
            result, failed = err.result, err.failures
        out = _split(result, rows.per_request)
        out.errors.update(failed)
        for req, scored in prompts:
            out.prompt_logprobs[req.request_id] = scored.result()
        return out


def _prompt_logprobs(
    req: Request, logits: torch.Tensor, upload: HostToDevice, fetch: DeviceToHost
) -> PromptLogprobs:
    # the runner keeps prompt rows only for requests that ask for prompt_logprobs
    assert req.params.prompt_logprobs is not None
    return PromptLogprobs(
        logits,
        req.prompt_token_ids,
        len(req.prompt_logprobs) + 1,
        req.params.prompt_logprobs,
        upload,
        fetch,
    )


def _split(result: Optional[SampleResult], per_request: list[list[int]]) -> ModelRunnerOutput:
    """The sampler's flat rows, handed back per scheduled request."""
    out = ModelRunnerOutput.empty(0)
    cursor = 0
    for rows in per_request:
        if rows:
            assert result is not None  # there were rows to sample
            out.token_ids.append(result.token_ids[cursor : cursor + len(rows)])
            out.logprobs.append(result.logprobs[cursor : cursor + len(rows)])
        else:
            out.token_ids.append([])
            out.logprobs.append([])
        cursor += len(rows)
    return out


def _fan_out(
    sched: SchedulerOutput,
    logits: torch.Tensor,
    sample_rows: list[list[int]],
    upload: HostToDevice,
) -> _Rows:
    """Parallel sampling: the step that completes a group's prompt samples the prompt's last
    row once per sequence (the parent's row first, then its children's)."""
    forking = [item.forks if rows else [] for item, rows in zip(sched.scheduled, sample_rows)]
    if not any(forking):  # every step but a fork: no copy of the logits
        return _Rows(
            logits,
            sample_rows,
            [item.request for item, rows in zip(sched.scheduled, sample_rows) for _ in rows],
        )
    picks: list[int] = []
    rows_out: list[list[int]] = []
    owners: list[Request] = []
    cursor = 0  # the first logits row of this request
    for item, rows, forks in zip(sched.scheduled, sample_rows, forking):
        picks += list(range(cursor, cursor + len(rows))) + [cursor + len(rows) - 1] * len(forks)
        owners += [item.request] * len(rows) + forks
        rows_out.append(list(rows) + [rows[-1]] * len(forks) if rows else [])
        cursor += len(rows)
    return _Rows(logits.index_select(0, upload.tensor(picks, np.int64)), rows_out, owners)


@dataclass
class _BeamOffers:
    """Beam rows' best continuations, queued on the device; ``deliver`` once fetched."""

    owners: list[Request]  # per beam row
    values: HostValue  # [rows, width] logprobs
    ids: HostValue  # [rows, width] token ids

    def deliver(self) -> None:
        values: list[list[float]] = self.values.value.tolist()
        ids: list[list[int]] = self.ids.value.tolist()
        for row, req in enumerate(self.owners):
            beam = _beam(req)
            k = beam.num_candidates
            beam.offer(req.index, values[row][:k], ids[row][:k])


def _offer_beams(
    rows: _Rows, sampler: TokenSampler, upload: HostToDevice, fetch: DeviceToHost
) -> tuple[_Rows, Optional[_BeamOffers]]:
    """Each beam slot's row offers its group the best continuations (``beam_logprobs``: the
    distribution with what beam search applies), all beam rows of the step in one top-k.
    Returns the other rows, to be sampled, and the offers."""
    logits, owners = rows.logits, rows.owners
    picks = [i for i, r in enumerate(owners) if _in_beam_search(r)]
    rest = [i for i, r in enumerate(owners) if not _in_beam_search(r)]
    if not picks:  # the beam slots of this step are prefill chunks short of their end
        return rows, None
    index, keep = upload.upload(
        [np.asarray(picks, dtype=np.int64), np.asarray(rest, dtype=np.int64)]
    )
    logprobs = sampler.beam_logprobs(logits.index_select(0, index), [owners[i] for i in picks])
    vocab = logprobs.shape[-1]
    width = max(_beam(owners[i]).num_candidates for i in picks)
    top_values, top_ids = logprobs.topk(min(width, vocab), dim=-1)
    offers = _BeamOffers([owners[i] for i in picks], fetch.add(top_values), fetch.add(top_ids))
    if not rest:
        return _Rows(logits[:0], rows.per_request, []), offers
    return _Rows(logits.index_select(0, keep), rows.per_request, [owners[i] for i in rest]), offers


def _in_beam_search(req: Request) -> bool:
    return req.group is not None and req.group.beam is not None


def _beam(req: Request) -> BeamSearch:
    """The beam search of a request in one (``_in_beam_search``)."""
    assert req.group is not None and req.group.beam is not None
    return req.group.beam


def _failed_alone(sched: SchedulerOutput, exc: Exception) -> ModelRunnerOutput:
    rid = sched.scheduled[0].request.request_id
    log.error("request %s failed in the engine step:\n%s", rid, traceback.format_exc())
    failed = ModelRunnerOutput.empty(1)
    failed.errors[rid] = f"internal error: {exc}"
    return failed
