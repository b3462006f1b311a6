"""The tiny engines the engine tests share: greedy settings, an ``LLMEngine`` and the
``EngineConfig`` of the loop tests (small blocks and steps, so that a few short prompts chunk,
batch and preempt)."""

from __future__ import annotations

from slipstream import EngineConfig
from slipstream.engine import LLMEngine
from support import tiny_engine_config, tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


def config(**overrides) -> EngineConfig:
    return tiny_engine_config(**overrides)


def make_engine(arch="llama", **overrides) -> LLMEngine:
    settings = dict(
        model=str(tiny_model_dir(arch)),
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=512,
        num_gpu_blocks_override=400,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))
