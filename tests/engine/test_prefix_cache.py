"""Prefix caching pays off: many requests behind one long shared system prompt compute the
prompt once. Measured with the engine's counters (prefill tokens computed, steps to the
first token), never with timings, and the outputs equal those without caching."""

from __future__ import annotations

import random

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from support import hf_greedy, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)
BLOCK = 4
SYSTEM = [random.Random(11).randrange(100, 40000) for _ in range(96)]  # 24 full blocks
N = 12
MAX_TOKENS = 6


def user_turn(i: int) -> list:
    return [random.Random(100 + i).randrange(100, 40000) for _ in range(5 + i % 4)]


PROMPTS = [SYSTEM + user_turn(i) for i in range(N)]


def serve(caching: bool, prompts: list = PROMPTS) -> dict:
    """All requests arrive together; returns outputs, counters and, per request, the step
    of its first token (time to first token counted in engine steps)."""
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=BLOCK,
            max_num_batched_tokens=128,
            max_num_seqs=N,
            max_model_len=256,
            num_gpu_blocks_override=400,
            enable_prefix_caching=caching,
        )
    )
    params = SamplingParams(max_tokens=MAX_TOKENS, **GREEDY)
    reqs = [engine.add_request(p, params) for p in prompts]
    tokens = {r.request_id: [] for r in reqs}
    first_token_step = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id].extend(out.token_ids)
            first_token_step.setdefault(out.request_id, engine.stats.steps)
    return {
        "engine": engine,
        "tokens": [tokens[r.request_id] for r in reqs],
        "cached": [r.num_cached_tokens for r in reqs],
        "ttft_steps": [first_token_step[r.request_id] for r in reqs],
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    return {"on": serve(True), "off": serve(False)}


def test_outputs_identical_with_and_without_caching(runs):
    assert runs["on"]["tokens"] == runs["off"]["tokens"]
    path = tiny_model_dir("llama")
    for i in (0, 1, N - 1):
        assert runs["on"]["tokens"][i] == hf_greedy(path, PROMPTS[i], MAX_TOKENS)


def test_shared_prompt_blocks_hit_after_the_first_request(runs):
    on = runs["on"]
    shared = len(SYSTEM)
    # Admitted in the steps after the first request computed the system prompt, every later
    # request finds its blocks: the hit rate over the shared blocks is ~1.
    hits_after_first = sum(on["cached"][1:])
    assert hits_after_first / (shared * (N - 1)) > 0.8
    assert all(c % BLOCK == 0 and c <= shared for c in on["cached"])
    stats = on["engine"].get_stats()
    assert stats.prefix_cache_hits == sum(on["cached"])
    total_prompt = sum(len(p) for p in PROMPTS)
    assert stats.prefix_cache_queries == total_prompt
    assert stats.prefix_cache_hit_rate > 0.75
    assert runs["off"]["engine"].get_stats().prefix_cache_hits == 0


def test_caching_computes_far_fewer_prefill_tokens_and_steps(runs):
    on, off = runs["on"]["engine"], runs["off"]["engine"]
    total_prompt = sum(len(p) for p in PROMPTS)
    assert off.stats.prompt_tokens_total == total_prompt  # every prompt token computed
    assert on.stats.prompt_tokens_total == total_prompt - sum(runs["on"]["cached"])
    assert on.stats.prompt_tokens_total < 0.3 * off.stats.prompt_tokens_total
    # Less prefill work: fewer (budget-bound) steps overall and an earlier first token.
    assert on.stats.steps < off.stats.steps
    assert on.stats.batched_tokens_total < off.stats.batched_tokens_total
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    assert mean(runs["on"]["ttft_steps"]) < mean(runs["off"]["ttft_steps"])
    # Tokens per step of work: the same output with fewer engine steps.
    assert on.stats.generation_tokens_total == off.stats.generation_tokens_total == N * MAX_TOKENS


def test_a_later_wave_hits_blocks_of_finished_requests(runs):
    engine = runs["on"]["engine"]
    assert engine.block_manager.num_used_blocks == 0  # finished: blocks free but still cached
    before = engine.stats.prompt_tokens_total
    later = [SYSTEM + user_turn(N + i) for i in range(3)]
    outs = engine.generate(later, SamplingParams(max_tokens=MAX_TOKENS, **GREEDY))
    assert all(o.num_cached_tokens == len(SYSTEM) for o in outs)
    assert engine.stats.prompt_tokens_total - before == sum(len(p) - len(SYSTEM) for p in later)
    engine.block_manager.check_invariants()
