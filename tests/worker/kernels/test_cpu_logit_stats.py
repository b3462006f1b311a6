"""The sampler's one-pass row statistics (kernels/csrc/cpu_logit_stats.cpp): argmax as torch picks
it
(the first maximum) and log-sum-exp, and the NaN and -inf rows the sampler's guard reads."""

import pytest
import torch

from slipstream.worker import kernels

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


@pytest.mark.parametrize("vocab", [49152, 49157, 5])  # 16-wide, with a tail, tail only
def test_argmax_and_logsumexp_match_torch(vocab):
    torch.manual_seed(0)
    x = torch.randn(9, vocab) * 6
    x[1, vocab // 3] = x[1, vocab - 1] = 99.0  # a tie: the first index wins, as in torch
    x[2, :] = 1.0  # all equal: index 0
    top, lse = torch.ops.slipstream_cpu.logit_stats(x)
    assert torch.equal(top, x.argmax(dim=-1))
    torch.testing.assert_close(lse, torch.logsumexp(x, dim=-1), rtol=2e-6, atol=2e-6)


def test_a_row_is_computed_alone():
    torch.manual_seed(1)
    x = torch.randn(6, 1000)
    top, lse = torch.ops.slipstream_cpu.logit_stats(x)
    top1, lse1 = torch.ops.slipstream_cpu.logit_stats(x[4:5].clone())
    assert top[4] == top1[0] and lse[4] == lse1[0]  # bit for bit, whatever shares the batch


def test_nan_rows_give_nan_and_masked_rows_minus_infinity():
    x = torch.zeros(3, 40)
    x[0, 17] = float("nan")
    x[1, :] = float("-inf")
    x[2, :] = float("-inf")
    x[2, 39] = float("nan")
    _, lse = torch.ops.slipstream_cpu.logit_stats(x)
    assert torch.isnan(lse[0]) and lse[1] == float("-inf") and torch.isnan(lse[2])


def test_greedy_tokens_come_from_it_only_while_no_penalty_or_constraint_changed_a_row(
    monkeypatch,
):
    """The raw rows' argmax is the token only when nothing changed the rows after it was
    taken: a repetition penalty that moves the maximum still wins."""
    from slipstream.core.request import Request
    from slipstream.core.sampling_params import SamplingParams
    from slipstream.worker.sample import sampler as sampler_module

    calls = []
    stats = sampler_module._logit_stats
    monkeypatch.setattr(sampler_module, "_logit_stats", lambda x: calls.append(1) or stats(x))
    logits = torch.zeros(2, 50)
    logits[:, 7] = 5.0  # token 7 is both rows' argmax ...
    logits[:, 9] = 4.0
    plain = Request("plain", [1, 2], SamplingParams(temperature=0), eos_token_id=0)
    penalized = Request(
        "penalized", [7, 7], SamplingParams(temperature=0, repetition_penalty=2.0), eos_token_id=0
    )
    result = sampler_module.Sampler()(logits.clone(), [plain, penalized])
    assert calls and result.token_ids == [7, 9]  # ... until the penalty halves token 7's logit
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs == pytest.approx([float(raw[0, 7]), float(raw[1, 9])], abs=1e-5)
