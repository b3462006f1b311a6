"""What an engine holds is loaded before its KV cache is sized: the draft model of speculative
decoding loads first (on a GPU its weights and cache come out of the same budget)."""

from __future__ import annotations

from slipstream import EngineConfig
from slipstream.engine import LLMEngine
from slipstream.engine.factory import ModelFactory
from support import tiny_model_dir


def test_the_draft_model_is_loaded_before_the_kv_cache_is_sized(monkeypatch):
    calls: list[str] = []
    load_draft, allocate = ModelFactory.load_draft, ModelFactory.allocate_kv_cache

    def spy_load(self, target):
        calls.append("load_draft")
        return load_draft(self, target)

    def spy_allocate(self, model, lora=None, draft=None):
        calls.append(f"allocate_kv_cache(draft={draft is not None})")
        return allocate(self, model, lora, draft)

    monkeypatch.setattr(ModelFactory, "load_draft", spy_load)
    monkeypatch.setattr(ModelFactory, "allocate_kv_cache", spy_allocate)
    engine = LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            speculative_method="draft",
            speculative_model=str(tiny_model_dir("qwen2")),
            block_size=4,
            max_model_len=128,
            num_gpu_blocks_override=50,
        )
    )
    assert calls == ["load_draft", "allocate_kv_cache(draft=True)"]
    # the proposer runs the model loaded then, on a cache of the target's blocks + drafts'
    assert engine.proposer is not None
    proposer_model = engine.proposer.model
    assert type(proposer_model).__name__.startswith("Qwen2")
    assert engine.proposer.kv.num_blocks > engine.kv_cache.num_blocks
