"""Stall-free batching (``tpot_target_ms``): the cost model learns step times, and the
scheduler admits only the prompt tokens that keep a step with decodes within the target,
never beyond ``max_num_batched_tokens``, while prompts still get in every step."""

from __future__ import annotations

import pytest

from slipstream.core.step_budget import MIN_PREFILL_TOKENS, StepBudget, StepCostModel
from scheduler_support import make_request, make_scheduler, sample

FIXED, PER_TOKEN, PER_ROW = 0.010, 0.0005, 0.001  # a step of the fake machine, in seconds


def step_time(tokens: int, rows: int) -> float:
    return FIXED + PER_TOKEN * tokens + PER_ROW * rows


def test_the_cost_model_learns_a_linear_step_time():
    model = StepCostModel()
    for i in range(40):
        tokens, rows = 8 + (i * 37) % 300, 1 + i % 9
        model.observe(tokens, rows, step_time(tokens, rows))
    fixed, per_token, per_row = model.coefficients()
    assert fixed == pytest.approx(FIXED, rel=1e-3)
    assert per_token == pytest.approx(PER_TOKEN, rel=1e-3)
    assert per_row == pytest.approx(PER_ROW, rel=1e-3)


def test_no_limit_before_the_model_has_seen_steps_of_different_sizes():
    budget = StepBudget(target_s=0.05, hard_limit=512)
    for _ in range(20):
        budget.observe(64, 4, step_time(64, 4))  # one size only: per-token cost unknown
    assert budget.tokens(decode_tokens=4, decode_rows=4) == 512


def run(sched, arrivals: dict, steps: int) -> list:
    """(tokens, rows, decode rows, prompt tokens) of each step, timed by the fake machine;
    ``arrivals``: step -> requests added before it."""
    seen = []
    for step in range(steps):
        for req in arrivals.get(step, []):
            sched.add(req)
        out = sched.schedule()
        if out.is_empty:
            break
        decoding = sum(
            1
            for item in out.scheduled
            if item.num_computed_before >= item.request.num_prompt_tokens
        )
        prompt = sum(
            item.num_new_tokens
            for item in out.scheduled
            if item.num_computed_before < item.request.num_prompt_tokens
        )
        sched.update_from_output(out, sample(out), lambda r: None)
        sched.observe_step(out, step_time(out.num_tokens, len(out.scheduled)))
        seen.append((out.num_tokens, len(out.scheduled), decoding, prompt))
    return seen


def decodes_then_long_prompts() -> dict:
    """Six long decodes at once, then a 300-token prompt every 6 steps."""
    arrivals = {0: [make_request(f"d{i}", 4, 400) for i in range(6)]}
    for i in range(10):
        arrivals[2 + 6 * i] = [make_request(f"p{i}", 300, 4, first_token=1000 + 400 * i)]
    return arrivals


def test_steps_with_decodes_stay_within_the_target_while_prompts_still_get_in():
    target_ms = 60.0
    sched = make_scheduler(
        num_blocks=512, max_num_batched_tokens=512, tpot_target_ms=target_ms, max_num_seqs=16
    )
    steps = run(sched, decodes_then_long_prompts(), 60)
    warm = [s for s in steps[20:] if s[2] > 0]  # the model has learned; decodes running
    assert warm, "no step with decodes after warm-up"
    for tokens, rows, _, prompt in warm:
        assert step_time(tokens, rows) <= target_ms / 1e3 * 1.05 or prompt <= MIN_PREFILL_TOKENS
    assert sum(s[3] for s in warm) > 0  # prompts kept coming in
    assert all(s[0] <= 512 for s in steps)


def test_without_a_target_prompt_chunks_fill_max_num_batched_tokens():
    sched = make_scheduler(num_blocks=512, max_num_batched_tokens=512, max_num_seqs=16)
    steps = run(sched, decodes_then_long_prompts(), 60)
    # a whole prompt beside the decodes: twice what a 60 ms target allows
    assert max(step_time(t, r) for t, r, d, _ in steps if d) > 0.12


def test_max_num_batched_tokens_stays_the_hard_limit_under_a_generous_target():
    sched = make_scheduler(
        num_blocks=512, max_num_batched_tokens=128, tpot_target_ms=10_000.0, max_num_seqs=16
    )
    steps = run(sched, decodes_then_long_prompts(), 40)
    assert max(s[0] for s in steps) == 128
    assert sched.step_budget.tokens(decode_tokens=6, decode_rows=6) == 128


def test_a_target_below_the_decodes_alone_still_admits_the_minimum_prompt_chunk():
    budget = StepBudget(target_s=0.001, hard_limit=512)
    for i in range(20):
        tokens, rows = 10 + 20 * i, 1 + i % 5
        budget.observe(tokens, rows, step_time(tokens, rows))
    assert budget.tokens(decode_tokens=6, decode_rows=6) == 6 + MIN_PREFILL_TOKENS
