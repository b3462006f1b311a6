"""The batched samplers: every sampled row at once -- on the compiled CPU kernel, on its torch
path and on the device sampler's path (``device_draw``, run here on CPU tensors, on CUDA in
the cuda tier) alike -- draws from exactly the distribution ``Sampler.probabilities``
describes; a row's token depends only on its own logits and its own uniform number; logprobs
are the raw model's, ranked only for the requests that asked; penalties as one scatter match
them row by row."""

from __future__ import annotations

import pytest
import torch

from slipstream.core.request import Request, TokenLogprob
from slipstream.core.sampling_params import SamplingParams
from slipstream.worker.sample import device_draw, token_draw
from slipstream.worker.sample.device_sampler import DeviceSampler, penalized_logits
from slipstream.worker.sample.sampler import Sampler

VOCAB = 400
PARAMS = [
    dict(temperature=0.8, top_p=0.95),
    dict(temperature=1.0, top_k=20),
    dict(temperature=0.7, top_k=50, top_p=0.8),
    dict(temperature=1.0, min_p=0.1),
    dict(temperature=1.3),
    dict(temperature=0.9, min_p=0.05, top_p=0.7),
    dict(temperature=0.5, top_p=0.3),
]


class Path:
    """One sampling path: its batched draw, its sampler and the device its logits live on."""

    def __init__(self, name: str, device: torch.device) -> None:
        self.name, self.device = name, device

    def draw(self, logits, params, uniforms) -> torch.Tensor:
        if self.name == "device":
            return device_draw.sample_rows(logits.to(self.device), params, uniforms).cpu()
        return token_draw.sample_rows(logits, params, uniforms)

    def sampler(self, seed: int = 0):
        return DeviceSampler(seed, staged=True) if self.name == "device" else Sampler(seed)

    def sample(self, sampler, logits, reqs):
        return sampler(logits.to(self.device), reqs)

    def penalized(self, logits, reqs) -> torch.Tensor:
        if self.name == "device":
            return penalized_logits(logits.to(self.device), reqs, staged=True).cpu()
        return Sampler()._apply_penalties(logits.clone(), reqs)


@pytest.fixture(params=["kernel", "torch", "device"])
def path(request, monkeypatch, tier_device):
    if request.param == "kernel":
        if not token_draw.compiled(torch.zeros(1, 2)):
            pytest.skip("the compiled CPU kernels are unavailable here")
    elif request.param == "torch":
        monkeypatch.setattr(token_draw, "compiled", lambda logits: False)
    if request.param != "device" and tier_device.type != "cpu":
        pytest.skip("a CPU sampling path")
    return Path(request.param, tier_device if request.param == "device" else torch.device("cpu"))


def flat_logits(rows: int, seed: int = 0) -> torch.Tensor:
    # flat enough that top-p keeps hundreds of tokens, as a small model's do
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 0.8


@pytest.mark.parametrize("kw", PARAMS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_cover_exactly_the_reference_distribution(path, kw):
    logits = flat_logits(1)
    params = SamplingParams(**kw)
    reference = Sampler.probabilities(logits[0].clone(), Request("r", [1], params)).double()
    n = 20_000
    uniforms = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # the inverse CDF on a grid
    tokens = path.draw(logits.expand(n, VOCAB).contiguous(), [params] * n, uniforms)
    drawn = torch.bincount(tokens, minlength=VOCAB).double() / n
    assert set(tokens.tolist()) == set(reference.nonzero()[:, 0].tolist())
    assert 0.5 * (drawn - reference).abs().sum() < 0.02


def test_a_rows_token_is_the_same_alone_and_in_any_batch(path):
    logits = flat_logits(len(PARAMS), seed=3)
    params = [SamplingParams(**kw) for kw in PARAMS]
    uniforms = torch.rand(
        len(PARAMS), generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    batch = path.draw(logits.clone(), params, uniforms)
    alone = [
        int(path.draw(logits[i : i + 1].clone(), [p], uniforms[i : i + 1])[0])
        for i, p in enumerate(params)
    ]
    reversed_batch = path.draw(logits.flip(0).contiguous(), params[::-1], uniforms.flip(0))
    assert batch.tolist() == alone == reversed_batch.flip(0).tolist()


def request(rid: str, **params) -> Request:
    return Request(rid, [5, 6, 7, 5], SamplingParams(**params), eos_token_id=0)


def test_logprobs_are_the_raw_models_and_ranked_only_where_asked(path):
    logits = flat_logits(4, seed=7) * 4
    reqs = [
        request("greedy", temperature=0),
        request("sampled", temperature=0.9, top_p=0.9),
        request("ranked", temperature=0.9, logprobs=3),
        request("allowed", temperature=1.0, allowed_token_ids=[10, 11, 12]),
    ]
    raw = torch.log_softmax(logits, dim=-1)
    result = path.sample(path.sampler(seed=1), logits.clone(), reqs)
    assert result.token_ids[0] == int(logits[0].argmax())
    assert result.token_ids[3] in (10, 11, 12)
    for i, token in enumerate(result.token_ids):
        assert result.logprobs[i] == pytest.approx(float(raw[i, token]), abs=1e-4)
    assert [isinstance(lp, TokenLogprob) for lp in result.logprobs] == [False, False, True, False]
    ranked = result.logprobs[2]
    assert ranked.rank == int((raw[2] >= raw[2, result.token_ids[2]]).sum())
    assert [t for t, _ in ranked.top] == raw[2].topk(3).indices.tolist()


def test_penalties_on_the_whole_batch_match_them_row_by_row(path):
    logits = flat_logits(3, seed=9) * 3
    reqs = [
        request("rep", temperature=1.0, repetition_penalty=1.3),
        request("freq", temperature=1.0, frequency_penalty=0.7, presence_penalty=0.4),
        request("none", temperature=1.0),
    ]
    for req, out in zip(reqs, ([8, 8, 9], [8, 8, 9, 11], [1])):
        for t in out:
            req.append_token(t)
    got = path.penalized(logits, reqs)
    want = logits.clone()
    seen = sorted(set(reqs[0].all_token_ids))
    want[0, seen] = torch.where(want[0, seen] > 0, want[0, seen] / 1.3, want[0, seen] * 1.3)
    ids, counts = torch.tensor(reqs[1].output_token_ids).unique(return_counts=True)
    want[1, ids] -= 0.7 * counts.float() + 0.4
    assert torch.allclose(got, want)
    assert torch.equal(got[2], logits[2])
