"""n / best_of, prompt logprobs and top-k logprobs in the engine, against Hugging Face's own
outputs and logits for the same prompt."""

from __future__ import annotations

import random

import pytest
import torch

from slipstream import SamplingParams
from engine_support import GREEDY, make_engine
from support import hf_greedy, reference_model, tiny_model_dir

PROMPT = [random.Random(11).randrange(100, 40000) for _ in range(50)]  # 12 blocks of 4 + 2


def hf_logprobs(prompt: list) -> torch.Tensor:
    """log_softmax of Hugging Face's logits at every position of ``prompt``."""
    model = reference_model(tiny_model_dir("llama"))
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_greedy_n_gives_identical_sequences_equal_to_hf():
    engine = make_engine()
    seqs = engine.generate_sequences([PROMPT], SamplingParams(n=3, max_tokens=10, **GREEDY))[0]
    want = hf_greedy(tiny_model_dir("llama"), PROMPT, 10)
    assert [s.index for s in seqs] == [0, 1, 2]
    assert [s.token_ids for s in seqs] == [want] * 3  # the copied partial block is right
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_seeded_n_is_reproducible_and_sequence_i_samples_with_seed_plus_i():
    params = dict(max_tokens=8, temperature=1.0, seed=5, ignore_eos=True)
    engine = make_engine()
    first = engine.generate_sequences([PROMPT], SamplingParams(n=3, **params))[0]
    again = make_engine(seed=99).generate_sequences(
        [[7, 8, 9], PROMPT],
        [SamplingParams(max_tokens=5, temperature=1.0), SamplingParams(n=3, **params)],
    )[1]
    assert [s.token_ids for s in first] == [s.token_ids for s in again]
    assert len({tuple(s.token_ids) for s in first}) == 3
    alone = engine.generate([PROMPT], SamplingParams(**{**params, "seed": 6}))[0]
    assert alone.token_ids == first[1].token_ids


def test_best_of_returns_the_n_most_likely_by_cumulative_logprob():
    params = dict(max_tokens=6, temperature=1.0, seed=3, ignore_eos=True)
    engine = make_engine()
    every = engine.generate_sequences([PROMPT], SamplingParams(n=4, **params))[0]
    best = engine.generate_sequences([PROMPT], SamplingParams(n=2, best_of=4, **params))[0]
    ranked = sorted(every, key=lambda s: s.cumulative_logprob, reverse=True)[:2]
    assert [s.index for s in best] == [0, 1]
    assert [s.token_ids for s in best] == [s.token_ids for s in ranked]
    assert best[0].cumulative_logprob >= best[1].cumulative_logprob
    assert engine.block_manager.num_used_blocks == 0


def test_n8_of_a_long_prompt_holds_its_prompt_once():
    long_prompt = [random.Random(5).randrange(100, 40000) for _ in range(202)]  # 50 blocks + 2
    engine = make_engine(max_num_batched_tokens=256)
    parent = engine.add_request(long_prompt, SamplingParams(n=8, max_tokens=4, **GREEDY))
    engine.step()  # the whole prompt, then the fork
    bm = engine.block_manager
    assert bm.num_used_blocks == 50 + 8  # shared full blocks + one partial block each
    assert {bm.blocks[b].ref_count for b in parent.block_table[:50]} == {8}
    while engine.has_unfinished():
        engine.step()
    assert bm.num_used_blocks == 0


def test_abort_ends_every_sequence_and_frees_every_block():
    engine = make_engine()
    req = engine.add_request(PROMPT, SamplingParams(n=4, max_tokens=100, **GREEDY))
    outs = [o for _ in range(4) for o in engine.step()]
    assert {o.index for o in outs} == {0, 1, 2, 3} and not any(o.finished for o in outs)
    final = engine.abort(req.request_id)
    assert final.finished and final.finish_reason == "abort" and final.request_id == req.request_id
    assert engine.abort("1_" + req.request_id) is None  # a child's id: already ended
    assert not engine.has_unfinished() and not engine.requests
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_forked_sequences_survive_preemption_with_hf_outputs(mode):
    prompts = [
        [random.Random(i).randrange(100, 40000) for _ in range(n)]
        for i, n in enumerate((18, 30, 42))
    ]
    engine = make_engine(
        num_gpu_blocks_override=40,
        preemption_mode=mode,
        swap_space_bytes=64 * 1024 * 1024,
        max_num_seqs=12,
    )
    results = engine.generate_sequences(prompts, SamplingParams(n=3, max_tokens=24, **GREEDY))
    assert engine.scheduler.num_preemptions > 0
    if mode == "swap":
        assert engine.scheduler.swap.stats.swap_outs > 0
    path = tiny_model_dir("llama")
    for prompt, seqs in zip(prompts, results):
        assert [s.token_ids for s in seqs] == [hf_greedy(path, prompt, 24)] * 3
    assert all(b.ref_count == 0 for b in engine.block_manager.blocks)


def test_every_request_finishes_once_whatever_its_n():
    engine = make_engine()
    engine.add_request(PROMPT, SamplingParams(n=3, max_tokens=3, **GREEDY))
    engine.add_request(PROMPT, SamplingParams(n=2, best_of=3, max_tokens=3, **GREEDY))
    finals = []
    while engine.has_unfinished():
        finals += [o.request_id for o in engine.step() if o.finished]
    assert sorted(finals) == ["req-0", "req-1"]
    assert engine.stats.num_finished == 2


@pytest.mark.parametrize("chunk", [16, 64])
def test_prompt_logprobs_match_hf_across_prefill_chunks(chunk):
    engine = make_engine(max_num_batched_tokens=chunk)
    params = SamplingParams(max_tokens=2, prompt_logprobs=3, **GREEDY)
    out = engine.generate([PROMPT], params)[0]
    ref = hf_logprobs(PROMPT)
    got = out.prompt_logprobs
    assert len(got) == len(PROMPT) and got[0] is None
    for pos in range(1, len(PROMPT)):
        token, row = PROMPT[pos], ref[pos - 1]
        entry = got[pos]
        assert next(iter(entry)) == token  # the prompt token first, then the top 3
        assert entry[token] == pytest.approx(row[token].item(), abs=1e-4)
        assert entry[token].rank == int((row >= row[token]).sum())
        top = torch.topk(row, 3)
        for rank, (t, v) in enumerate(zip(top.indices.tolist(), top.values.tolist()), start=1):
            assert entry[t] == pytest.approx(v, abs=1e-4)
            assert entry[t].rank == rank or t == token


def test_prompt_logprobs_skip_the_prefix_cache_and_are_complete():
    engine = make_engine()
    engine.generate([PROMPT], SamplingParams(max_tokens=2, **GREEDY))  # caches the prompt
    out = engine.generate([PROMPT], SamplingParams(max_tokens=2, prompt_logprobs=0, **GREEDY))[0]
    assert out.num_cached_tokens == 0  # recomputed, as vLLM does, to score every position
    assert len(out.prompt_logprobs) == len(PROMPT)
    assert all(len(p) == 1 for p in out.prompt_logprobs[1:])


def test_sampled_top_logprobs_match_hf():
    engine = make_engine()
    out = engine.generate([PROMPT], SamplingParams(max_tokens=4, logprobs=5, **GREEDY))[0]
    full = PROMPT + out.token_ids
    ref = hf_logprobs(full)
    for i, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        row = ref[len(PROMPT) - 1 + i]
        assert lp == pytest.approx(row[token].item(), abs=1e-4) and lp.rank == 1
        top = torch.topk(row, 5)
        assert [t for t, _ in lp.top] == top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top.values.tolist(), abs=1e-4)


def test_invalid_n_and_best_of_are_refused_with_vllm_messages():
    with pytest.raises(ValueError, match=r"n must be at least 1, got 0\."):
        SamplingParams(n=0)
    with pytest.raises(
        ValueError, match="best_of must be greater than or equal to n, got n=3 and best_of=2."
    ):
        SamplingParams(n=3, best_of=2)
    engine = make_engine(max_num_seqs=4)
    with pytest.raises(ValueError, match="max_num_seqs=4"):
        engine.add_request(PROMPT, SamplingParams(n=5))


def test_engine_loop_streams_every_sequence_and_ends_once():
    from slipstream.engine.loop import EngineLoop

    engine = make_engine()
    with EngineLoop(engine) as loop:
        stream = loop.submit(PROMPT, SamplingParams(n=2, max_tokens=6, **GREEDY))
        outs = list(stream)
        with pytest.raises(ValueError, match="index"):
            loop.generate(PROMPT, SamplingParams(n=2))
    tokens = {0: [], 1: []}
    for out in outs:
        tokens[out.index] += out.token_ids
    assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
    assert tokens[0] == tokens[1] == hf_greedy(tiny_model_dir("llama"), PROMPT, 6)
