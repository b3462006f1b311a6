"""A GPU step waits on the device once: the copy that brings back the sampled tokens and the
logprobs asked for. Proven on CPU by running the GPU engine's step protocol (staged uploads,
the device sampler, OpenAI Triton kernels in the interpreter, transformers' forward) under
``HostReads``, which reports every host read of a tensor that would live on the device."""

from __future__ import annotations

import pytest
from host_reads import HostReads, model_roots

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from support import tiny_model_dir, use_device_path

pytest.importorskip("triton")

PROMPTS = [[5, 17, 300, 42, 9, 1200, 7], [88, 3, 64], list(range(100, 130))]


def device_path_engine(**settings) -> LLMEngine:
    config = dict(
        model=str(tiny_model_dir("llama")),
        device="cpu",
        dtype="float32",
        attention_ops="triton",  # the GPU's kernels (interpreted here)
        fast_forward=False,  # transformers' forward, as on the GPU
        block_size=4,
        max_num_batched_tokens=24,  # the long prompt is chunked
        max_num_seqs=8,
        max_model_len=128,
        num_gpu_blocks_override=120,
    )
    config.update(settings)
    engine = LLMEngine(EngineConfig(**config))
    use_device_path(engine)
    return engine


def run_steps(engine: LLMEngine) -> list[tuple[HostReads, bool]]:
    """Each step's reads, and whether it made outputs (a step of prompt chunks that all stop
    short of their prompt's end samples nothing: it copies nothing back)."""
    per_step = []
    while engine.has_unfinished():
        with HostReads(model_roots(engine)) as reads:
            outputs = engine.step()
        per_step.append((reads, len(outputs) > 0))
    return per_step


def check_one_copy_per_step(per_step: list[tuple[HostReads, bool]], drafts: bool = False) -> None:
    """No read of the device but the step's copy back (and, with a draft model, the copy that
    brings its proposal's drafts back)."""
    assert any(made for _, made in per_step)
    for n, (reads, made_outputs) in enumerate(per_step):
        assert reads.reads == [], f"step {n} read the device:\n{reads.summary()}"
        expected = {1, 2} if drafts and made_outputs else {1 if made_outputs else 0}
        assert reads.transfers in expected, f"step {n} copied back {reads.transfers} times"


def test_every_step_reads_the_device_once_whatever_its_requests_ask():
    engine = device_path_engine()
    params = [
        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(max_tokens=3, temperature=1.0, top_k=5, min_p=0.05, ignore_eos=True),
        SamplingParams(
            max_tokens=3,
            temperature=0.7,
            repetition_penalty=1.3,
            frequency_penalty=0.5,
            presence_penalty=0.2,
            logit_bias={11: 5.0},
            min_tokens=2,
        ),
        SamplingParams(max_tokens=3, temperature=0, allowed_token_ids=[7, 8, 9, 300]),
        SamplingParams(max_tokens=2, temperature=0.9, n=2, prompt_logprobs=2, ignore_eos=True),
    ]
    for i, p in enumerate(params):
        engine.add_request(PROMPTS[i % len(PROMPTS)], p)
    per_step = run_steps(engine)
    check_one_copy_per_step(per_step)
    assert len(per_step) > 3  # prefill chunks, mixed and decode-only steps


def test_beam_search_and_draft_model_steps_read_the_device_once_and_drafts_once():
    """The draft model (here the target itself: every draft is accepted) keeps its drafts on
    the device across its forwards: one more copy a step, for the whole proposal."""
    engine = device_path_engine(
        speculative_method="draft",
        speculative_model=str(tiny_model_dir("llama")),
        num_speculative_tokens=3,
    )
    engine.add_request(PROMPTS[0], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.add_request(
        PROMPTS[1], SamplingParams(max_tokens=3, use_beam_search=True, n=2, ignore_eos=True)
    )
    check_one_copy_per_step(run_steps(engine), drafts=True)
    stats = engine.get_stats()
    assert stats.spec_draft_tokens > 0 and stats.spec_accepted_tokens == stats.spec_draft_tokens


def test_a_host_read_in_the_step_is_caught():
    """The detector is not vacuous: the CPU sampler reads the logits on the host."""
    engine = device_path_engine()
    from slipstream.worker.sample.sampler import Sampler

    engine.sampler = Sampler(0)
    engine.add_request(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0.8))
    per_step = run_steps(engine)
    assert any(reads.reads for reads, _ in per_step)
