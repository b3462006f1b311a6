"""Greedy outputs of the batched engine equal model.generate run one request at a time (fp32;
on the tier's device: CPU, or CUDA in the cuda tier, against the same fp32 reference)."""

from __future__ import annotations

import functools

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from support import hf_greedy, random_workload, tier_settings, tiny_model_dir

N_REQUESTS = 12


@functools.lru_cache(maxsize=None)
def workload_and_reference(arch: str) -> tuple:
    prompts, outs = random_workload(N_REQUESTS, seed=1)
    path = tiny_model_dir(arch)
    return prompts, outs, [hf_greedy(path, p, o) for p, o in zip(prompts, outs)]


def run_engine(arch: str, device, **overrides) -> tuple:
    prompts, outs, reference = workload_and_reference(arch)
    settings = dict(
        **tier_settings(device),
        model=str(tiny_model_dir(arch)),
        block_size=4,
        max_num_batched_tokens=48,
        max_num_seqs=8,
        max_model_len=512,
        num_gpu_blocks_override=600,
    )
    settings.update(overrides)
    engine = LLMEngine(EngineConfig(**settings))
    params = [SamplingParams(max_tokens=o, temperature=0, ignore_eos=True) for o in outs]
    results = engine.generate(prompts, params)
    return engine, [r.token_ids for r in results], reference


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2", "mistral", "gemma2"])
def test_continuous_matches_reference(arch, tier_device):
    engine, got, reference = run_engine(arch, tier_device)
    assert got == reference
    # Several prefill chunks per long prompt and mixed prefill/decode steps really happened.
    assert engine.stats.steps > max(len(p) for p in workload_and_reference(arch)[0]) // 48
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


@pytest.mark.parametrize("mode", ["static", "dynamic"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_batch_modes_match_reference(arch, mode, tier_device):
    engine, got, reference = run_engine(
        arch, tier_device, batching=mode, max_batch_size=4, max_queue_delay_ms=0.0
    )
    assert got == reference
    assert engine.block_manager.num_used_blocks == 0


def test_chunked_prefill_interleaves_decode(tier_device):
    """A long prompt arriving while others decode is split into chunks; decodes keep going."""
    path = tiny_model_dir("llama")
    engine = LLMEngine(
        EngineConfig(
            **tier_settings(tier_device),
            model=str(path),
            block_size=4,
            max_num_batched_tokens=16,
            max_num_seqs=8,
            max_model_len=512,
            num_gpu_blocks_override=300,
        )
    )
    short = engine.add_request(
        [101, 102, 103], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    )
    engine.step()  # short request prefilled, first token out
    engine.add_request(
        list(range(200, 400)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    )
    decoded_during_prefill = 0
    for _ in range(12):
        before = short.num_output_tokens
        sched_tokens_before = engine.stats.batched_tokens_total
        engine.step()
        assert engine.stats.batched_tokens_total - sched_tokens_before <= 16  # the token budget
        decoded_during_prefill += short.num_output_tokens - before
    assert decoded_during_prefill == 12  # one decode token every step, never blocked


def test_no_chunked_prefill_still_correct(tier_device):
    engine, got, reference = run_engine(
        "llama", tier_device, enable_chunked_prefill=False, max_num_batched_tokens=512
    )
    assert got == reference
