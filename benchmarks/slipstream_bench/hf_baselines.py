"""Two outside baselines on the same workload, model and token ids, EOS ignored.

* ``hf_static``: ``model.generate`` on padded static batches (left padding, batch 8 in
  arrival order). A batch starts when its last request has arrived and the previous batch is
  done, and runs ``max_new_tokens`` = its longest request; each request is credited only its
  own tokens, stamped by a streamer as the steps produce them. The rows that already have
  all their tokens keep computing: that waste is what static batching costs.
* ``hf_continuous``: Hugging Face transformers' own continuous batching
  (``init_continuous_batching``, paged cache, ``sdpa`` attention on CPU), per-request
  ``max_new_tokens`` and ``eos_token_id=-1``; per-token times come from its
  ``record_timestamps``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from typing import Iterator, Optional, Sequence

import torch

from slipstream.worker.model.loader import resolve_model_path
from slipstream_bench.driver import Progress, send_on_schedule
from slipstream_bench.metrics import RequestRecord, records_to_json, summarize
from slipstream_bench.workload import Workload

STATIC_BATCH_SIZE = 8
CB_PAGE_SIZE = 64  # tokens per page; HF's 256 default wastes most of a page per request here
CB_MAX_BATCH_TOKENS = 512  # the same token budget per step as the engine's default


def load_hf(model: str = "default"):
    """The plain Hugging Face model (sdpa attention, fp32) and its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()  # CB's "flash is better" notes and friends
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    path = resolve_model_path(model)
    m = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="sdpa"
    ).eval()
    tok = AutoTokenizer.from_pretrained(str(path))
    return m, tok


# ------------------------------------------------------------------------ static batches
class _StepClock:
    """A ``generate`` streamer that only notes when each step's tokens exist."""

    def __init__(self) -> None:
        self.times: list = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate first hands over the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def _pad_left(prompts: Sequence[list], pad_id: int) -> tuple:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.inference_mode()
def _generate_batch(model, prompts: Sequence[list], new_tokens: int, pad_id: int) -> list:
    ids, mask = _pad_left(prompts, pad_id)
    clock = _StepClock()
    model.generate(
        input_ids=ids,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=pad_id,
        streamer=clock,
    )
    return clock.times


def run_hf_static(
    model,
    tokenizer,
    workload: Workload,
    offsets: Sequence[float],
    warmup: Optional[Workload],
    *,
    batch_size: int = STATIC_BATCH_SIZE,
    label: str = "hf_static",
    progress: bool = True,
) -> dict:
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    if warmup is not None:
        _generate_batch(model, warmup.prompt_ids(tokenizer)[:batch_size], 4, pad_id)
    prompts = workload.prompt_ids(tokenizer)
    records = [RequestRecord(r.id, r.prompt_len, r.max_tokens) for r in workload.requests]
    bar = Progress(label, workload.total_output_tokens, progress)
    start = time.perf_counter()
    for rec, offset in zip(records, offsets):
        rec.send_time = start + offset
    for b in range(0, len(records), batch_size):
        batch = range(b, min(b + batch_size, len(records)))
        wait = start + max(offsets[i] for i in batch) - time.perf_counter()
        if wait > 0:
            time.sleep(wait)
        longest = max(records[i].max_tokens for i in batch)
        times = _generate_batch(model, [prompts[i] for i in batch], longest, pad_id)
        for i in batch:
            records[i].token_times = times[: records[i].max_tokens]
            bar.update(records[i].num_output_tokens)
    bar.close()
    return {
        "label": label,
        "kind": "hf",
        "settings": {
            "batch_size": batch_size,
            "attn_implementation": "sdpa",
            "padding_side": "left",
        },
        "summary": summarize(records),
        "records": records_to_json(records),
    }


# ------------------------------------------------------------------------ continuous batching
def _cb_manager(model, workload: Workload, warmup: Optional[Workload]):
    from transformers import ContinuousBatchingConfig, GenerationConfig

    # Room for every request at once (as the engine's KV pool has), so nothing is evicted.
    pages = sum(-(-(r.prompt_len + r.max_tokens) // CB_PAGE_SIZE) for r in workload.requests)
    if warmup is not None:
        pages += sum(-(-(r.prompt_len + r.max_tokens) // CB_PAGE_SIZE) for r in warmup.requests)
    cb = ContinuousBatchingConfig(
        page_size=CB_PAGE_SIZE,
        num_blocks=pages + 8,
        max_batch_tokens=CB_MAX_BATCH_TOKENS,
        max_requests_per_batch=max(len(workload), 1),
        auto_switch_to_flash=False,
        allow_block_sharing=False,
    )
    gen = GenerationConfig(
        do_sample=False,
        eos_token_id=-1,
        max_new_tokens=max(r.max_tokens for r in workload.requests),
    )
    return model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)


def _cb_run(
    manager,
    prompts: Sequence[list],
    records: Sequence[RequestRecord],
    offsets: Sequence[float],
    bar: Progress,
    timeout: float = 3600.0,
) -> None:
    by_id = {r.id: r for r in records}
    done = threading.Event()

    def collect() -> None:
        left = len(records)
        deadline = time.monotonic() + timeout
        while left and time.monotonic() < deadline:
            out = manager.get_result(timeout=0.5)
            if out is None or not out.is_finished() or out.request_id not in by_id:
                if out is None and not manager.is_running():
                    break
                continue
            rec = by_id[out.request_id]
            rec.token_times = list(out.timestamps or [])
            rec.error = out.error
            bar.update(rec.num_output_tokens)
            left -= 1
        done.set()

    collector = threading.Thread(target=collect, name="hf-cb-collector", daemon=True)
    collector.start()

    def send(i: int) -> None:
        rec = records[i]
        rec.send_time = time.perf_counter()
        manager.add_request(
            prompts[i],
            request_id=rec.id,
            max_new_tokens=rec.max_tokens,
            record_timestamps=True,
            eos_token_id=-1,
        )

    send_on_schedule(offsets, send, records=records)
    done.wait()
    for rec in records:
        if not rec.token_times and rec.error is None:
            rec.error = "no result from the continuous batching manager"


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    """Torch work in here creates no OpenMP pool on this thread (a team of one has no
    workers), so the manager's own compute thread is the only pool: see
    ``runner.on_fresh_thread`` for what a second pool costs."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_hf_continuous(
    model,
    tokenizer,
    workload: Workload,
    offsets: Sequence[float],
    warmup: Optional[Workload],
    *,
    label: str = "hf_continuous",
    progress: bool = True,
) -> dict:
    with _single_threaded():  # the paged cache is allocated (and zeroed) here
        manager = _cb_manager(model, workload, warmup)
    manager.start()
    try:
        if warmup is not None:
            recs = [
                RequestRecord(f"warm{r.id}", r.prompt_len, r.max_tokens) for r in warmup.requests
            ]
            _cb_run(
                manager,
                warmup.prompt_ids(tokenizer),
                recs,
                [0.0] * len(recs),
                Progress("", 0, False),
            )
        records = [RequestRecord(r.id, r.prompt_len, r.max_tokens) for r in workload.requests]
        bar = Progress(label, workload.total_output_tokens, progress)
        _cb_run(manager, workload.prompt_ids(tokenizer), records, offsets, bar)
        bar.close()
    finally:
        manager.stop(block=True, timeout=30)
    return {
        "label": label,
        "kind": "hf",
        "settings": {
            "attn_implementation": "sdpa",
            "page_size": CB_PAGE_SIZE,
            "max_batch_tokens": CB_MAX_BATCH_TOKENS,
            "eos_token_id": -1,
        },
        "summary": summarize(records),
        "records": records_to_json(records),
    }


def release(model) -> None:
    """Drop a cached CB manager, if any, before the model goes away."""
    destroy = getattr(model, "destroy_cached_continuous_batching_manager", None)
    if destroy is not None:
        destroy()
