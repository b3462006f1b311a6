"""Speculative decoding: ngram and draft-model proposals never change what is generated."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from slipstream import SamplingParams
from slipstream.engine import LLMEngine
from slipstream.engine.spec_decode import NgramProposer, max_drafts, ngram_lookup
from engine_support import make_engine
from support import reference_model, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


def workload(n=8, seed=0):
    """Prompts that repeat a short pattern (so prompt lookup finds matches), plus random ones."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        if i % 4 == 3:
            prompts.append([rng.randrange(100, 40000) for _ in range(rng.randrange(3, 30))])
        else:
            pattern = [rng.randrange(100, 40000) for _ in range(rng.randrange(2, 7))]
            prompts.append((pattern * 10)[: rng.randrange(8, 40)])
    params = [SamplingParams(max_tokens=rng.randrange(6, 30), **GREEDY) for _ in prompts]
    return prompts, params


def assert_no_leaks(engine: LLMEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    draft_bm = getattr(engine.proposer, "bm", None)
    if draft_bm is not None:
        assert draft_bm.num_used_blocks == 0 and not engine.proposer.shadows
        draft_bm.check_invariants()


@pytest.fixture(scope="module")
def plain_outputs():
    """Non-speculative greedy outputs per architecture (the reference)."""
    cache = {}

    def get(arch):
        if arch not in cache:
            prompts, params = workload()
            cache[arch] = [r.token_ids for r in make_engine(arch).generate(prompts, params)]
        return cache[arch]

    return get


# -- ngram ----------------------------------------------------------------------------------


def test_ngram_lookup_proposes_the_continuation_of_the_latest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3], 2, 1, 3) == [7, 8]
    assert ngram_lookup([5, 1, 2, 6, 1, 2], 3, 1, 2) == [6, 1, 2]  # runs into the end: repeats
    assert ngram_lookup([4, 4], 3, 1, 3) == [4, 4, 4]
    assert ngram_lookup([1, 2, 3], 3, 1, 3) == []  # nothing repeats
    assert ngram_lookup([1, 2, 3, 2], 2, 2, 3) == []  # only a 1-gram matches, min is 2
    assert ngram_lookup([1, 2, 3, 2], 2, 1, 3) == [3, 2]


def test_draft_count_respects_max_tokens_and_max_model_len():
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=4, max_model_len=24)
    req = engine.make_request([7, 8, 7, 8, 7, 8], SamplingParams(max_tokens=3, **GREEDY))
    assert max_drafts(req, engine.config) == 2  # 3 tokens left = 2 drafts + 1 bonus
    req.params.max_tokens = 100
    assert max_drafts(req, engine.config) == 4
    req.all_token_ids.extend([7] * 15)  # 21 of 24 tokens
    assert max_drafts(req, engine.config) == 2
    assert NgramProposer(engine.config).propose(req) == [7, 7]


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_ngram_greedy_outputs_identical(plain_outputs, arch):
    prompts, params = workload()
    engine = make_engine(arch, speculative_method="ngram", num_speculative_tokens=3)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == plain_outputs(arch)
    stats = engine.get_stats()
    assert stats.spec_draft_tokens > 0
    if arch == "gpt2":  # the tiny gpt2 falls into loops: prompt lookup predicts them
        assert stats.spec_accepted_tokens > 0 and stats.spec_acceptance_rate > 0.3
        assert engine.stats.steps < sum(p.max_tokens for p in params) / len(params) * 8
    assert_no_leaks(engine)


def test_ngram_with_preemption_prefix_cache_and_max_model_len(plain_outputs):
    """Drafts survive recompute preemption, and are cut where max_model_len ends."""
    prompts, params = workload()
    engine = make_engine("gpt2", speculative_method="ngram", num_gpu_blocks_override=40)
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == plain_outputs("gpt2")
    assert engine.scheduler.num_preemptions > 0 and engine.get_stats().spec_accepted_tokens > 0
    assert_no_leaks(engine)
    short = make_engine("gpt2", speculative_method="ngram", max_model_len=20)
    plain = make_engine("gpt2", max_model_len=20)
    p = SamplingParams(max_tokens=50, **GREEDY)
    heads = [q[:10] for q in prompts[:3]]
    got = short.generate(heads, p)
    assert [r.token_ids for r in got] == [r.token_ids for r in plain.generate(heads, p)]
    assert all(r.num_output_tokens == 10 and r.finish_reason == "length" for r in got)
    assert short.get_stats().spec_accepted_tokens > 0
    assert_no_leaks(short)


def test_requests_with_penalties_or_min_tokens_do_not_speculate():
    engine = make_engine("gpt2", speculative_method="ngram")
    prompt = [500, 600] * 6
    for params in (
        SamplingParams(max_tokens=12, repetition_penalty=1.3, **GREEDY),
        SamplingParams(max_tokens=12, frequency_penalty=0.5, **GREEDY),
        SamplingParams(max_tokens=12, use_speculation=False, **GREEDY),
    ):
        out = engine.generate([prompt], params)[0]
        assert out.num_output_tokens == 12
        assert engine.get_stats().spec_draft_tokens == 0, params
    # min_tokens: no drafts until min_tokens outputs exist, then speculation resumes.
    plain = make_engine("gpt2").generate(
        [prompt], SamplingParams(max_tokens=20, min_tokens=10, temperature=0)
    )[0]
    out = engine.generate([prompt], SamplingParams(max_tokens=20, min_tokens=10, temperature=0))[0]
    assert out.token_ids == plain.token_ids
    assert engine.get_stats().spec_draft_tokens > 0
    assert_no_leaks(engine)


def test_min_tokens_with_ignore_eos_and_no_stop_tokens_still_speculates(plain_outputs):
    """Then min_tokens blocks nothing (EOS is not blocked under ignore_eos), so drafts are
    exact: the benchmark's exact-length requests (min_tokens = max_tokens) speculate."""
    prompts, params = workload()
    exact = [
        SamplingParams(max_tokens=p.max_tokens, min_tokens=p.max_tokens, **GREEDY) for p in params
    ]
    engine = make_engine("gpt2", speculative_method="ngram", num_speculative_tokens=3)
    assert [r.token_ids for r in engine.generate(prompts, exact)] == plain_outputs("gpt2")
    assert engine.get_stats().spec_accepted_tokens > 0
    assert_no_leaks(engine)


def _drafts_per_step(engine: LLMEngine, prompts: list, params) -> list:
    """(running requests, most drafts any request carries) after each step."""
    seen = []
    for prompt in prompts:
        engine.add_request(prompt, params)
    while engine.has_unfinished():
        engine.step()
        running = engine.scheduler.running
        seen.append((len(running), max((len(r.spec_token_ids) for r in running), default=0)))
    return seen


@pytest.mark.parametrize("budget", [6, 12])
def test_row_budget_caps_each_requests_drafts_by_the_running_batch(plain_outputs, budget):
    """One row per running request plus its drafts stays within ``speculative_row_budget``:
    no drafts at all once the batch alone fills it; outputs stay exact."""
    prompts, params = workload()
    engine = make_engine(
        "gpt2", speculative_method="ngram", num_speculative_tokens=4, speculative_row_budget=budget
    )
    p = SamplingParams(max_tokens=24, **GREEDY)
    seen = _drafts_per_step(engine, prompts, p)
    assert all(n + n * drafts <= budget for n, drafts in seen if drafts), seen
    assert any(drafts for _, drafts in seen)  # the tail, with few requests left, speculates
    assert any(n >= budget // 2 for n, _ in seen)  # and the full batch did not
    plain = make_engine("gpt2").generate(prompts, p)
    capped = make_engine("gpt2", speculative_method="ngram", speculative_row_budget=budget)
    assert [r.token_ids for r in capped.generate(prompts, p)] == [r.token_ids for r in plain]
    assert_no_leaks(engine)


def test_seeded_sampled_requests_keep_their_text_whatever_the_batch_under_a_row_budget():
    """With drafts capped by the batch, a seeded sampled request would draw a different number
    of random values per step depending on its neighbours: it does not draft, and its text is
    the same alone and beside others."""
    prompt = [500, 600] * 6
    seeded = SamplingParams(max_tokens=16, temperature=1.5, seed=11, ignore_eos=True)

    def run(neighbours: int) -> list:
        # A draft model drafts every step (prompt lookup finds nothing in random text).
        engine = make_engine(
            "gpt2",
            speculative_method="draft",
            speculative_row_budget=12,
            speculative_model=str(tiny_model_dir("gpt2")),
        )
        for _ in range(neighbours):
            engine.add_request(prompt, SamplingParams(max_tokens=16, **GREEDY))
        mine = engine.add_request(prompt, seeded).request_id
        tokens = []
        while engine.has_unfinished():
            tokens += [t for out in engine.step() if out.request_id == mine for t in out.token_ids]
        assert engine.get_stats().spec_draft_tokens > 0 or neighbours == 0
        return tokens

    assert run(0) == run(5)


def test_disable_by_batch_size_stops_drafting_above_that_many_running_requests():
    prompts, _ = workload()
    engine = make_engine(
        "gpt2",
        speculative_method="ngram",
        num_speculative_tokens=4,
        speculative_disable_by_batch_size=3,
    )
    seen = _drafts_per_step(engine, prompts, SamplingParams(max_tokens=24, **GREEDY))
    assert all(n <= 3 for n, drafts in seen if drafts), seen
    assert any(drafts for _, drafts in seen) and any(n > 3 for n, _ in seen)
    assert_no_leaks(engine)


def test_stop_string_inside_accepted_drafts_stops_at_the_same_token():
    prompt = [500, 600] * 6
    plain = make_engine("gpt2")
    ref = plain.generate([prompt], SamplingParams(max_tokens=24, **GREEDY))[0]
    stop = plain.tokenizer.decode(ref.token_ids[4:6])
    params = SamplingParams(max_tokens=24, stop=[stop], **GREEDY)
    expected = plain.generate([prompt], params)[0]
    engine = make_engine("gpt2", speculative_method="ngram")
    got = engine.generate([prompt], params)[0]
    assert got.finish_reason == "stop" == expected.finish_reason
    assert got.token_ids == expected.token_ids and got.text == expected.text


# -- draft model ------------------------------------------------------------------------------


def test_draft_equal_to_target_accepts_nearly_everything(plain_outputs):
    prompts, params = workload()
    path = str(tiny_model_dir("llama"))
    engine = make_engine(
        speculative_method="draft", speculative_model=path, num_speculative_tokens=4
    )
    assert engine.proposer.model is engine.model  # shared weights, separate KV cache
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == plain_outputs("llama")
    stats = engine.get_stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_acceptance_rate > 0.9
    # Far fewer target steps than tokens: ~5 tokens per step per request.
    assert engine.stats.steps < max(p.max_tokens for p in params)
    # Batched: the draft runs ~k forwards per engine step, not k per request.
    assert engine.proposer.num_forwards <= 5 * engine.stats.steps
    assert_no_leaks(engine)


def test_unrelated_draft_model_is_rejected_but_outputs_stay_exact(plain_outputs):
    prompts, params = workload()
    engine = make_engine(
        speculative_method="draft",
        speculative_model=str(tiny_model_dir("qwen2")),
        num_speculative_tokens=2,
        num_gpu_blocks_override=60,
    )
    got = [r.token_ids for r in engine.generate(prompts, params)]
    assert got == plain_outputs("llama")
    stats = engine.get_stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_acceptance_rate < 0.5
    assert_no_leaks(engine)


def test_draft_cache_resyncs_after_aborts_and_preemption(plain_outputs):
    prompts, params = workload()
    path = str(tiny_model_dir("llama"))
    engine = make_engine(
        speculative_method="draft", speculative_model=path, num_gpu_blocks_override=40
    )
    victim = engine.add_request([300, 301, 302] * 5, SamplingParams(max_tokens=200, **GREEDY))
    got = {}
    reqs = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.token_ids)
        steps += 1
        if steps == 4:
            assert victim.request_id in engine.proposer.shadows
            engine.abort(victim.request_id)
            assert victim.request_id not in engine.proposer.shadows
    assert [got[r.request_id] for r in reqs] == plain_outputs("llama")
    assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


# -- sampling ---------------------------------------------------------------------------------


def test_seeded_sampling_with_speculation_is_reproducible():
    prompt = [500, 600] * 6
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=3, seed=7, ignore_eos=True)
    mates = [[i, i + 1, i + 2] for i in range(900, 905)]
    mate_params = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    alone = make_engine("gpt2", speculative_method="ngram").generate([prompt], params)[0]
    crowd = make_engine("gpt2", speculative_method="ngram", seed=3).generate(
        mates + [prompt], [mate_params] * 5 + [params]
    )[-1]
    assert crowd.token_ids == alone.token_ids and len(alone.token_ids) == 16
    other = SamplingParams(max_tokens=16, temperature=0.8, top_k=3, seed=8, ignore_eos=True)
    assert (
        make_engine("gpt2", speculative_method="ngram").generate([prompt], other)[0].token_ids
        != alone.token_ids
    )


def test_speculative_sampling_preserves_the_target_distribution():
    """Top-2 sampling of three tokens: the empirical joint distribution with draft==target
    speculation matches the exact one computed from the model (a wrong acceptance rule,
    e.g. always keeping the greedy draft, would put far more mass on the argmax paths)."""
    arch, prompt, n = "llama", [1000, 2000, 3000], 600
    path = tiny_model_dir(arch)
    model = reference_model(path)

    def top2(ctx):
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ctx])).logits[0, -1]
        vals, ids = logits.topk(2)
        return dict(zip(ids.tolist(), torch.softmax(vals, 0).tolist()))

    exact = {}
    for t1, p1 in top2([]).items():
        for t2, p2 in top2([t1]).items():
            for t3, p3 in top2([t1, t2]).items():
                exact[(t1, t2, t3)] = p1 * p2 * p3
    engine = make_engine(
        arch,
        speculative_method="draft",
        speculative_model=str(path),
        num_speculative_tokens=2,
        max_num_seqs=64,
        max_num_batched_tokens=256,
        num_gpu_blocks_override=300,
    )
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=2, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    outs = engine.generate([prompt] * n, params)
    counts = Counter(tuple(o.token_ids) for o in outs)
    assert set(counts) <= set(exact)
    tv = 0.5 * sum(abs(counts[k] / n - p) for k, p in exact.items())
    assert engine.get_stats().spec_draft_tokens > 0
    assert 0 < engine.get_stats().spec_acceptance_rate < 1
    assert tv < 0.08, (tv, exact, counts)
    assert_no_leaks(engine)


def test_verification_chunks_and_prompt_chunks_are_flagged_to_the_attention(monkeypatch):
    """The CPU attention runs a chunk as decode-kernel rows when it is a verification (the
    model runner's ``verify_host``) and on the prefill kernel when it is a prompt chunk
    (``prompt_host``), whatever its length: a prompt row's path must not depend on the batch."""
    from slipstream.worker import kernels
    from slipstream.worker.attention import cpu_backend

    if not kernels.load():
        pytest.skip(f"no CPU kernel: {kernels.unavailable_reason()}")
    seen = []
    build = cpu_backend.plan

    def record(meta, *args):
        seen.append((list(meta.query_lens_host), list(meta.verify_host), list(meta.prompt_host)))
        return build(meta, *args)

    monkeypatch.setattr(cpu_backend, "plan", record)
    engine = make_engine(speculative_method="ngram", num_speculative_tokens=3, attention_ops="cpu")
    prompts, params = workload()
    engine.generate(prompts, params)
    flagged = [
        (n, v, p) for q_lens, verify, prompt in seen for n, v, p in zip(q_lens, verify, prompt)
    ]
    assert any(v and n > 1 for n, v, _ in flagged), "no verification chunk reached the attention"
    assert all(n > 1 and not p for n, v, p in flagged if v)  # drafts, after the prompt
    assert all(n == 1 for n, v, p in flagged if not v and not p)  # the rest: decode rows
    # prompt chunks (the first step's, 8-40 tokens, no drafts yet) are flagged as prompts
    first_q_lens, first_verify, first_prompt = seen[0]
    assert not any(first_verify) and all(first_prompt) and max(first_q_lens) > 1
