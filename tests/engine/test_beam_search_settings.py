"""Beam search states what it does with each sampling setting: the temperature, the
repetition / presence / frequency penalties, logit bias and allowed token ids shape the
distribution beams are ranked on (as TensorRT-LLM applies them to beams), checked token by
token against the tiny model scored by Hugging Face with the same rules; top-k, top-p and
min-p (truncations beam search does not do) are refused, each by name."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream import SamplingParams
from slipstream.engine import LLMEngine
from support import reference_model, tiny_engine_config, tiny_model_dir

# A prompt on which the tiny model's plain beams repeat their own tokens (so that every
# penalty changes the scores of the tokens the beams hold).
PROMPT = [random.Random(5).randrange(100, 40000) for _ in range(30)]
BEAM = dict(beam_width=3, n=3, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(tiny_engine_config(max_model_len=512, num_gpu_blocks_override=400))


@pytest.fixture(scope="module")
def hf():
    return reference_model(tiny_model_dir("llama"))


def reference_logprobs(hf, beam: list[int], p: SamplingParams) -> list[float]:
    """Each beam token's log-probability under the model's distribution at its position,
    with the rules applied to logits: allowed ids, logit bias, repetition penalty on the
    prompt and the tokens so far, presence / frequency penalties on the tokens so far, then
    the temperature."""
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + beam])).logits[0].float()
    out = []
    for t, token in enumerate(beam):
        row = logits[len(PROMPT) - 1 + t].clone()
        if p.allowed_token_ids:
            masked = torch.full_like(row, float("-inf"))
            masked[p.allowed_token_ids] = row[p.allowed_token_ids]
            row = masked
        for tid, bias in (p.logit_bias or {}).items():
            row[tid] += bias
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(PROMPT + beam[:t])))
            vals = row[seen]
            row[seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        for tid in set(beam[:t]):
            row[tid] -= p.frequency_penalty * beam[:t].count(tid) + p.presence_penalty
        scaled = row / (p.temperature or 1.0)
        out.append(float(torch.log_softmax(scaled, dim=-1)[token]))
    return out


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 0.5},
        {"temperature": 1.7},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5, "frequency_penalty": 0.7},
        {"logit_bias": {1234: 6.0, 4321: -3.0}},
        {"allowed_token_ids": [1234, 4321, 999, 5555, 31000]},
    ],
    ids=[
        "temperature-0.5",
        "temperature-1.7",
        "repetition",
        "presence-frequency",
        "bias",
        "allowed",
    ],
)
def test_beams_are_ranked_on_the_distribution_with_the_setting_applied(engine, hf, settings):
    """Before: beams were ranked on the raw distribution whatever these said."""
    plain = engine.generate_sequences([PROMPT], SamplingParams(**BEAM))[0]
    assert len(set(plain[0].token_ids)) < len(plain[0].token_ids)  # the penalties have work
    params = SamplingParams(**BEAM, **settings)
    beams = engine.generate_sequences([PROMPT], params)[0]
    assert len(beams) == 3
    for beam in beams:
        expected = reference_logprobs(hf, beam.token_ids, params)
        assert beam.logprobs == pytest.approx(expected, abs=2e-3)
        assert beam.cumulative_logprob == pytest.approx(sum(expected), abs=5e-3)
    if "allowed_token_ids" in settings:
        allowed = set(settings["allowed_token_ids"])
        assert all(set(beam.token_ids) <= allowed for beam in beams)


def test_a_strong_bias_decides_the_best_beam(engine):
    favoured = 1234
    plain = engine.generate_sequences([PROMPT], SamplingParams(**BEAM))[0]
    assert set(plain[0].token_ids) != {favoured}
    biased = engine.generate_sequences(
        [PROMPT], SamplingParams(**BEAM, logit_bias={favoured: 100.0})
    )[0]
    assert biased[0].token_ids == [favoured] * BEAM["max_tokens"]


@pytest.mark.parametrize(
    "setting, value",
    [("top_k", 5), ("top_p", 0.9), ("min_p", 0.1)],
)
def test_truncations_beam_search_does_not_apply_are_refused_by_name(setting, value):
    with pytest.raises(ValueError, match=f"beam search does not apply {setting}"):
        SamplingParams(**BEAM, **{setting: value})
    with pytest.raises(ValueError, match=f"beam search does not apply {setting}"):
        SamplingParams(use_beam_search=True, n=2, **{setting: value})
    SamplingParams(**{setting: value})  # sampling applies it


def test_settings_that_mean_off_are_accepted_with_beams():
    for off in ({"top_k": 0}, {"top_k": -1}, {"top_p": 1.0}, {"min_p": 0.0}, {"temperature": 0}):
        assert SamplingParams(**BEAM, **off).beam_width == 3
