"""The step plan rank 0 sends the other ranks rebuilds the batch rank 0 runs."""

import torch

from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler_output import ScheduledRequest, SchedulerOutput
from slipstream.worker.distributed import step_plan
from slipstream.worker.distributed.step_plan import PlanKind, StepPlan
from slipstream.worker.kv_cache import KVCache, KVGeometry
from slipstream.worker.model_runner import ModelRunner
from slipstream.worker.transfer import HostToDevice


def _batch():
    """A runner's batch of a prompt chunk and a decode row (packed as the runner packs)."""
    runner = ModelRunner.__new__(ModelRunner)  # prepare() needs only these
    runner.block_size, runner.lora, runner.device = 4, None, torch.device("cpu")
    runner.upload = HostToDevice(runner.device)
    first = Request("a", list(range(100, 110)), SamplingParams(max_tokens=4))
    first.block_table = [3, 5, 7]
    second = Request("b", [7, 8, 9], SamplingParams(max_tokens=4, prompt_logprobs=1))
    second.block_table = [2]
    sched = SchedulerOutput([ScheduledRequest(first, 6), ScheduledRequest(second, 3)])
    return ModelRunner.prepare(runner, sched)


def test_a_plan_round_trips_the_batch_and_the_block_copies():
    batch = _batch()
    plan = step_plan.decode(step_plan.encode(StepPlan.of_batch(batch, [(1, 2), (3, 4)])))
    assert plan.kind is PlanKind.STEP and plan.block_copies == [(1, 2), (3, 4)]
    again = plan.batch(torch.device("cpu"))
    for name in ("input_ids", "positions"):
        assert torch.equal(getattr(again, name), getattr(batch, name))
    for name in ("slot_mapping", "cu_seqlens_q", "seq_lens", "block_tables"):
        got, want = getattr(again.meta, name), getattr(batch.meta, name)
        assert got.dtype == want.dtype and torch.equal(got, want)
    for name in ("max_seqlen_q", "max_seqlen_k", "block_size", "query_lens_host", "seq_lens_host"):
        assert getattr(again.meta, name) == getattr(batch.meta, name)
    # the rows rank 0 keeps: sampled, then prompt-logprob rows, as one request's
    rows = [r for rs in batch.sample_rows for r in rs] + [r for rs in batch.prompt_rows for r in rs]
    assert again.sample_rows == [rows] and len(rows) > 2


def test_a_plan_without_a_batch_says_only_its_kind():
    plan = step_plan.decode(step_plan.encode(StepPlan.bare(PlanKind.STOP)))
    assert plan.kind is PlanKind.STOP and plan.input_ids is None


def test_the_recorded_cache_hands_each_copy_over_once():
    from slipstream.worker.distributed.recorded_kv_cache import RecordedKVCache

    cache = RecordedKVCache(KVGeometry(1, 1, 2, 4, torch.float32), 4, torch.device("cpu"))
    cache.data[:, :, 1] = 5.0
    cache.copy_blocks([(1, 3)])
    assert torch.equal(cache.data[:, :, 3], cache.data[:, :, 1])  # made here, as on one rank
    assert cache.take_copies() == [(1, 3)] and cache.take_copies() == []
    assert isinstance(cache, KVCache)
