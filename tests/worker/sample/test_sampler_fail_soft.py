"""The samplers (the CPU one, and the device one run here on CPU tensors, on CUDA in the cuda
tier) fail only the requests whose own rows cannot be sampled, and the other rows (seeded
ones included) get exactly the tokens they would have got without them."""

from __future__ import annotations

import pytest
import torch

from slipstream.core.request import Request
from slipstream.core.sampling_params import FLOAT32_NORMAL_RANGE, SamplingParams
from slipstream.worker.sample.device_sampler import DeviceSampler
from slipstream.worker.sample.sampler import PLACEHOLDER_TOKEN, PerRequestError, Sampler

VOCAB = 50


@pytest.fixture(params=["cpu", "device"])
def make_sampler(request, tier_device):
    """A factory of the sampler under test, taking CPU logits."""
    if request.param == "cpu":
        if tier_device.type != "cpu":
            pytest.skip("the CPU sampler")
        return Sampler

    def make(seed=0):
        sampler = DeviceSampler(seed, staged=True)
        return lambda logits, reqs: sampler(logits.to(tier_device), reqs)

    return make


def request(rid, **params):
    return Request(rid, [1, 2, 3, 4], SamplingParams(**params), eos_token_id=0)


def logits(rows, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_a_nan_row_fails_its_request_only_and_seeded_rows_keep_their_tokens(make_sampler):
    reqs = [
        request("greedy", temperature=0),
        request("seeded", temperature=1.0, seed=7),
        request("broken", temperature=1.0, seed=3),
        request("plain", temperature=0.8),
    ]
    batch = logits(4)
    batch[2, 5] = float("nan")
    clean = batch.clone()
    clean[2] = 0.0
    expected = make_sampler(seed=11)(clean.clone(), reqs).token_ids

    sampler = make_sampler(seed=11)
    with pytest.raises(PerRequestError) as err:
        sampler(batch, reqs)
    assert set(err.value.failures) == {"broken"}
    assert "NaN" in err.value.failures["broken"]
    got = err.value.result.token_ids
    assert got[2] == PLACEHOLDER_TOKEN
    assert [got[i] for i in (0, 1, 3)] == [expected[i] for i in (0, 1, 3)]
    # The seeded generator was rewound: the next draw continues as if nothing had failed.
    again = make_sampler(seed=11)
    again(clean.clone(), reqs)
    follow = logits(4, seed=1)
    assert sampler(follow.clone(), reqs).token_ids[1] == again(follow.clone(), reqs).token_ids[1]


def test_every_row_of_one_request_fails_together(make_sampler):
    reqs = [request("a", temperature=0), request("a", temperature=0), request("b", temperature=0)]
    batch = logits(3)
    batch[1, 0] = float("nan")
    with pytest.raises(PerRequestError) as err:
        make_sampler()(batch, reqs)
    assert set(err.value.failures) == {"a"}
    assert err.value.result.token_ids[2] == int(batch[2].argmax())


def test_extreme_penalties_and_temperatures_stay_finite(make_sampler):
    low, high = FLOAT32_NORMAL_RANGE
    reqs = [
        request("low", temperature=1.0, repetition_penalty=low),
        request("high", temperature=0.01, repetition_penalty=high),
        request("hot", temperature=1e30),
    ]
    result = make_sampler()(logits(3) * 1e3, reqs)  # no PerRequestError: every row computes
    assert all(0 <= t < VOCAB for t in result.token_ids)


def test_out_of_vocabulary_stop_ids_are_not_indexed(make_sampler):
    req = request("r", temperature=0, min_tokens=3, stop_token_ids=[VOCAB + 10])
    assert len(make_sampler()(logits(1), [req]).token_ids) == 1
