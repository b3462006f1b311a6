"""Prefix caching, preemption, aborts, seeded sampling and input validation."""

from __future__ import annotations

import random

import pytest

from slipstream import EngineConfig, SamplingParams
from engine_support import GREEDY, make_engine
from support import hf_greedy, random_workload, tiny_model_dir


def test_prefix_cache_reuses_blocks_and_matches_reference():
    engine = make_engine()
    shared = [random.Random(3).randrange(100, 40000) for _ in range(64)]
    first, second = shared + [7, 8, 9], shared + [11, 12]
    out1 = engine.generate([first], SamplingParams(max_tokens=8, **GREEDY))[0]
    hits_before = engine.block_manager.stats.hits
    out2 = engine.generate([second], SamplingParams(max_tokens=8, **GREEDY))[0]
    assert engine.block_manager.stats.hits - hits_before == 64  # 16 full blocks of 4
    assert out2.num_cached_tokens == 64
    path = tiny_model_dir("llama")
    assert out1.token_ids == hf_greedy(path, first, 8)
    assert out2.token_ids == hf_greedy(path, second, 8)
    # Only the uncached tail was prefilled the second time.
    assert engine.stats.prompt_tokens_total == len(first) + len(second) - 64


def test_prefix_cache_concurrent_sharing_and_eviction():
    engine = make_engine(num_gpu_blocks_override=60)
    shared = list(range(1000, 1040))
    prompts = [shared + [i, i + 1] for i in range(2000, 2012)]
    params = SamplingParams(max_tokens=4, **GREEDY)
    results = engine.generate(prompts, params)
    path = tiny_model_dir("llama")
    for p, r in zip(prompts, results):
        assert r.token_ids == hf_greedy(path, p, 4)
    assert engine.block_manager.stats.hits > 0
    engine.block_manager.check_invariants()
    # Evicting cached blocks for unrelated prompts keeps everything consistent.
    other = [[random.Random(i).randrange(100, 40000) for _ in range(60)] for i in range(6)]
    engine.generate(other, params)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_preemption_recompute_completes_with_reference_outputs():
    prompts, outs = random_workload(10, seed=5, lengths=(10, 30, 50, 70), max_out=40)
    engine = make_engine(num_gpu_blocks_override=45, enable_prefix_caching=False)
    results = engine.generate(prompts, [SamplingParams(max_tokens=o, **GREEDY) for o in outs])
    assert engine.scheduler.num_preemptions > 0
    path = tiny_model_dir("llama")
    for p, o, r in zip(prompts, outs, results):
        assert r.token_ids == hf_greedy(path, p, o)
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_random_aborts_never_leak_blocks():
    engine = make_engine(num_gpu_blocks_override=120)
    rng = random.Random(7)
    live = []
    for step in range(200):
        if rng.random() < 0.4:
            n = rng.choice([1, 5, 20, 60])
            req = engine.add_request(
                [rng.randrange(100, 40000) for _ in range(n)],
                SamplingParams(max_tokens=rng.randrange(1, 40), **GREEDY),
            )
            live.append(req.request_id)
        if live and rng.random() < 0.3:
            rid = live.pop(rng.randrange(len(live)))
            out = engine.abort(rid)
            if out is not None:
                assert out.finished and out.finish_reason == "abort"
        engine.step()
        engine.block_manager.check_invariants()
    for rid in live:
        engine.abort(rid)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_abort_mid_generation_frees_blocks_at_once():
    engine = make_engine()
    req = engine.add_request(list(range(100, 150)), SamplingParams(max_tokens=100, **GREEDY))
    for _ in range(5):
        engine.step()
    assert engine.block_manager.num_used_blocks > 0 and req.num_output_tokens > 0
    out = engine.abort(req.request_id)
    assert out.finish_reason == "abort"
    assert engine.block_manager.num_used_blocks == 0


def test_seeded_sampling_is_independent_of_batch_mates():
    params = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=1234, ignore_eos=True
    )
    prompt = [101, 2020, 3030, 4040]
    alone = make_engine().generate([prompt], params)[0].token_ids
    mates = [[i, i + 1, i + 2] for i in range(500, 507)]
    crowd = make_engine(seed=99).generate(
        mates + [prompt],
        [SamplingParams(max_tokens=9, temperature=1.0, ignore_eos=True)] * 7 + [params],
    )
    assert crowd[-1].token_ids == alone
    different_seed = SamplingParams(
        max_tokens=12, temperature=0.9, top_k=50, top_p=0.95, seed=4321, ignore_eos=True
    )
    assert make_engine().generate([prompt], different_seed)[0].token_ids != alone


def test_logprobs_and_stop_conditions():
    engine = make_engine()
    ref = engine.generate([[5, 6, 7]], SamplingParams(max_tokens=10, **GREEDY))[0]
    assert len(ref.logprobs) == 10 and all(lp <= 0 for lp in ref.logprobs)
    assert ref.cumulative_logprob == pytest.approx(sum(ref.logprobs))
    stop_id = ref.token_ids[3]
    first = ref.token_ids.index(stop_id)
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[stop_id])
    )[0]
    assert out.token_ids == ref.token_ids[: first + 1] and out.finish_reason == "stop"
    assert ref.finish_reason == "length"


def test_min_tokens_blocks_eos():
    engine = make_engine()
    eos = engine.eos_token_id
    out = engine.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=6, min_tokens=6, temperature=0, stop_token_ids=[])
    )[0]
    assert len(out.token_ids) == 6 and eos not in out.token_ids


@pytest.mark.parametrize(
    "bad, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1), "temperature"),
        (dict(top_p=0), "top_p"),
        (dict(top_k=-5), "top_k"),
        (dict(repetition_penalty=0), "repetition_penalty"),
        (dict(presence_penalty=3), "presence_penalty"),
        (dict(frequency_penalty=-3), "frequency_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(seed="x"), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=-1), "logprobs"),
        (dict(temperature=float("nan")), "temperature"),
    ],
)
def test_invalid_sampling_params_name_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**bad)


def test_sampling_params_from_strings():
    p = SamplingParams.from_dict(
        {"temperature": "0", "max_tokens": "7", "ignore_eos": "true", "stop": ["x"]}
    )
    assert p.greedy and p.max_tokens == 7 and p.ignore_eos and p.stop == ["x"]
    with pytest.raises(ValueError, match="top_q"):
        SamplingParams.from_dict({"top_q": 1})
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams.from_dict({"max_tokens": "many"})


def test_invalid_prompts_are_refused_clearly():
    engine = make_engine(max_model_len=64)
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(list(range(100, 170)))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("")
    with pytest.raises(ValueError, match="token ids"):
        engine.add_request([1, 10**9])
    small = make_engine(num_gpu_blocks_override=4)
    with pytest.raises(ValueError, match="never fit"):
        small.add_request(list(range(100, 130)))
    assert not engine.has_unfinished() and not small.has_unfinished()


def test_max_model_len_caps_generation():
    engine = make_engine(max_model_len=32)
    out = engine.generate([list(range(100, 120))], SamplingParams(max_tokens=100, **GREEDY))[0]
    assert out.num_prompt_tokens + out.num_output_tokens == 32 and out.finish_reason == "length"


@pytest.mark.parametrize(
    "bad",
    [
        dict(block_size=0),
        dict(batching="nope"),
        dict(policy="x"),
        dict(max_num_seqs=-1),
        dict(dtype="int8"),
    ],
)
def test_invalid_engine_config(bad):

    with pytest.raises(ValueError):
        EngineConfig(**bad)
