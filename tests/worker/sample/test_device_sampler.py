"""The device sampler's own guarantees (on CPU tensors here, on CUDA in the cuda tier): a seeded
request draws the same tokens whatever shares its steps and whatever the engine's seed; its
stream moves on only when a step's tokens came back; the step brings back the token ids and
only the logprobs that were asked for."""

from __future__ import annotations

import numpy as np
import torch

from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams
from slipstream.worker.sample.device_sampler import DeviceSampler
from slipstream.worker.sample.uniform_streams import UniformStreams, uniforms
from slipstream.worker.transfer import DeviceToHost

VOCAB = 300


def logits(rows: int, step: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(step)) * 0.7


def request(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params))


def seeded_tokens(sampler: DeviceSampler, device, others: int, steps: int = 6) -> list[int]:
    """The seeded request's token at each step, sharing it with ``others`` unseeded rows
    placed before it (its own logits are the same every time)."""
    seeded = request("seeded", temperature=1.0, top_p=0.9, seed=1234)
    crowd = [request(f"other{i}", temperature=0.8) for i in range(others)]
    tokens = []
    for step in range(steps):
        batch = torch.cat([logits(others, 100 + step), logits(1, step)])
        tokens.append(sampler(batch.to(device), crowd + [seeded]).token_ids[-1])
    return tokens


def test_a_seeded_request_draws_the_same_tokens_in_any_batch_and_under_any_engine_seed(
    tier_device,
):
    alone = seeded_tokens(DeviceSampler(0, staged=True), tier_device, others=0)
    crowded = seeded_tokens(DeviceSampler(0, staged=True), tier_device, others=5)
    other_seed = seeded_tokens(DeviceSampler(77, staged=True), tier_device, others=2)
    assert alone == crowded == other_seed
    assert len(set(alone)) > 1  # it samples, it is not stuck on one token


def test_a_streams_draws_are_a_function_of_seed_and_count_and_commit_only_when_asked():
    streams = UniformStreams(seed=5)
    req = request("r", temperature=1.0, seed=42)
    first = streams.draw([req, req])  # a request verifying a draft draws twice, in row order
    again = streams.draw([req, req])  # nothing committed: the same numbers
    assert np.array_equal(first.values, again.values)
    assert np.array_equal(first.values, uniforms(np.array([42, 42]), np.array([0, 1])))
    streams.commit(first)
    assert streams.draw([req]).values[0] == uniforms(np.array([42]), np.array([2]))[0]
    assert ((first.values >= 0) & (first.values < 1)).all()
    streams.forget("r")
    assert streams.draw([req]).values[0] == first.values[0]


def test_the_uniforms_are_uniform():
    values = uniforms(np.full(200_000, 9), np.arange(200_000))
    counts = np.histogram(values, bins=20, range=(0, 1))[0]
    assert abs(values.mean() - 0.5) < 0.005
    assert counts.min() > 0.95 * 10_000 and counts.max() < 1.05 * 10_000


def fetched_shapes(reqs: list, device) -> list[tuple]:
    sampler = DeviceSampler(0, staged=True)
    fetch = DeviceToHost(device, staged=True)
    pending = sampler.launch(logits(len(reqs), 0).to(device), reqs, fetch)
    shapes = [tuple(t.shape) for t in fetch.registered]
    fetch.fetch()
    pending.result()
    return shapes


def test_the_step_brings_back_token_ids_and_only_the_logprobs_asked_for(tier_device):
    plain = [request(f"r{i}", temperature=0.9) for i in range(4)]
    # ids, a status per row, the sampled tokens' logprobs: rows-long vectors only
    assert fetched_shapes(plain, tier_device) == [(4,), (4,), (4,)]
    ranked = plain[:3] + [request("ranked", temperature=0.9, logprobs=5)]
    # one ranked row adds its rank, its logprob and its top-5 (ids and values)
    assert fetched_shapes(ranked, tier_device) == [(4,), (4,), (4,), (1,), (1,), (1, 5), (1, 5)]
