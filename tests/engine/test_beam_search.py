"""Beam search in the engine (beams as a sequence group sharing KV copy-on-write) against
Hugging Face's ``generate(num_beams=..., do_sample=False)`` on the same model."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream import SamplingParams
from engine_support import make_engine
from support import reference_model, tiny_model_dir

PROMPT = [random.Random(11).randrange(100, 40000) for _ in range(50)]
EOS = 2  # the tiny model's


def hf_beams(width: int, n: int, max_tokens: int, stops: list, **kwargs) -> list:
    """Hugging Face's n best beams, each cut after its stop token (the rest is padding)."""
    model = reference_model(tiny_model_dir("llama"))
    with torch.no_grad():
        out = model.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=max_tokens,
            num_beams=width,
            num_return_sequences=n,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=[EOS] + stops,
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            **kwargs,
        )
    beams = []
    for row in out[:, len(PROMPT) :].tolist():
        ends = [i for i, t in enumerate(row) if t in [EOS] + stops]
        beams.append(row[: ends[0] + 1] if ends else row)
    return beams


# Stop tokens taken from the beams' own paths (the tiny model never says EOS), so that some
# beams finish early and length_penalty / early_stopping decide the ranking.
@pytest.mark.parametrize(
    "width,stops,length_penalty,early_stopping",
    [
        (4, [], 1.0, False),
        (2, [22415], 2.0, True),
        (4, [43813, 19467], 0.0, "never"),
        (4, [29793], -1.0, False),
        (3, [22415], 1.0, True),
    ],
)
def test_beams_equal_hf_generate_num_beams(width, stops, length_penalty, early_stopping):
    engine = make_engine()
    params = SamplingParams(
        beam_width=width,
        n=width,
        max_tokens=10,
        stop_token_ids=stops,
        length_penalty=length_penalty,
        early_stopping=early_stopping,
    )
    beams = engine.generate_sequences([PROMPT], params)[0]
    assert [b.token_ids for b in beams] == hf_beams(
        width, width, 10, stops, length_penalty=length_penalty, early_stopping=early_stopping
    )
    assert [b.index for b in beams] == list(range(width))
    for b in beams:  # per-beam logprobs add up to the beam's cumulative logprob
        assert len(b.logprobs) == len(b.token_ids)
        assert sum(b.logprobs) == pytest.approx(b.cumulative_logprob, abs=1e-3)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_beams_run_in_one_forward_per_round():
    engine = make_engine(max_num_batched_tokens=64)
    engine.generate_sequences([PROMPT], SamplingParams(beam_width=4, n=4, max_tokens=10))
    # One step prefills the 50-token prompt and makes the first choice; then one step per
    # token with the 4 beams' rows batched together.
    assert engine.stats.steps == 10
    assert engine.stats.prompt_tokens_total == len(PROMPT)


def test_each_round_reports_every_live_beam_then_the_finished_beams():
    engine = make_engine()
    engine.add_request(PROMPT, SamplingParams(beam_width=3, n=3, max_tokens=6))
    outputs = []
    while engine.has_unfinished():
        outputs += engine.step()
    snapshots = [o for o in outputs if o.beams is not None]
    finals = [o for o in outputs if o.beams is None]
    # rounds 1..5 report the beams they leave (1..5 tokens each); round 6 ends the search
    assert [len(s.beams) for s in snapshots] == [3] * 5
    assert [len(s.beams[0].token_ids) for s in snapshots] == [1, 2, 3, 4, 5]
    for s in snapshots:  # best first; each beam's logprobs add up to its score
        scores = [b.cumulative_logprob for b in s.beams]
        assert scores == sorted(scores, reverse=True)
        assert all(
            sum(b.logprobs) == pytest.approx(b.cumulative_logprob, abs=1e-3) for b in s.beams
        )
    assert [o.index for o in finals] == [0, 1, 2] and finals[-1].finished
    assert [o.token_ids for o in finals] == hf_beams(3, 3, 6, [])


def test_use_beam_search_takes_width_from_best_of_and_returns_n():
    engine = make_engine()
    params = SamplingParams(use_beam_search=True, best_of=3, n=2, max_tokens=8)
    assert params.beam_width == 3
    beams = engine.generate_sequences([PROMPT], params)[0]
    assert [b.token_ids for b in beams] == hf_beams(3, 2, 8, [])
    best = engine.generate([PROMPT], SamplingParams(beam_width=3, max_tokens=8))[0]
    assert best.token_ids == beams[0].token_ids


def test_beams_beside_other_requests_under_preemption_equal_beams_alone():
    alone = make_engine().generate_sequences(
        [PROMPT], SamplingParams(beam_width=4, n=4, max_tokens=12, stop_token_ids=[22415])
    )[0]
    # 40 blocks of 4 tokens: the beams (13 blocks of prompt + their own) and three other
    # requests do not fit at once, so sequences are preempted and recomputed.
    engine = make_engine(num_gpu_blocks_override=40, max_num_batched_tokens=32)
    others = [[random.Random(i).randrange(100, 40000) for _ in range(30)] for i in range(3)]
    params = [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)] * 3
    params.insert(1, SamplingParams(beam_width=4, n=4, max_tokens=12, stop_token_ids=[22415]))
    results = engine.generate_sequences([others[0], PROMPT] + others[1:], params)
    assert engine.scheduler.num_preemptions > 0
    assert [b.token_ids for b in results[1]] == [b.token_ids for b in alone]
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_beams_that_outgrow_the_cache_take_turns_instead_of_waiting_forever():
    """14 blocks of 4 tokens hold the 40-token prompt and the 4 beams' partial blocks, not
    their next ones: a slot preempted while its siblings wait for its offer takes their blocks
    (they hold KV they do not need before the round), so the search ends, with the beams an
    unconstrained engine finds."""
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(40)]
    params = SamplingParams(beam_width=4, n=4, max_tokens=12)
    want = make_engine().generate_sequences([prompt], params)[0]
    engine = make_engine(num_gpu_blocks_override=14, max_num_batched_tokens=32)
    engine.add_request(prompt, SamplingParams(beam_width=4, n=4, max_tokens=12))
    finals = []
    for _ in range(200):
        if not engine.has_unfinished():
            break
        finals += [o for o in engine.step() if o.beams is None]
    assert not engine.has_unfinished() and engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in finals] == [o.token_ids for o in want]
    assert engine.block_manager.num_used_blocks == 0


def test_aborted_beam_search_frees_every_slot():
    engine = make_engine()
    req = engine.add_request(PROMPT, SamplingParams(beam_width=4, n=2, max_tokens=50))
    for _ in range(3):  # nothing is final before the search ends: snapshots of the beams
        assert all(o.beams is not None and not o.finished for o in engine.step())
    final = engine.abort(req.request_id)
    assert final.finished and final.finish_reason == "abort"
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(beam_width=2, n=3), "n must be <= beam_width"),
        (dict(beam_width=2, stop=["x"]), "beam search does not support stop strings"),
        (dict(beam_width=2, early_stopping="sometimes"), "early_stopping must be"),
        (dict(beam_width=2, length_penalty=float("nan")), "length_penalty must be a finite"),
        (dict(beam_width=0), "beam_width must be an integer in [1, 64]"),
    ],
)
def test_beam_search_refuses_what_it_cannot_honour(kwargs, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        SamplingParams(**kwargs)
