"""The embedded SmolLM2-135M-Instruct: the engine matches model.generate and answers sensibly."""

from __future__ import annotations

import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.engine import LLMEngine
from slipstream.worker.model.gguf import default_model_dir
from support import hf_greedy

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model="default",
            block_size=8,
            max_num_batched_tokens=32,
            max_num_seqs=4,
            max_model_len=512,
            kv_cache_memory_bytes=64 * 2**20,
        )
    )


def test_default_model_is_gqa(engine):
    g = engine.kv_cache.geometry
    assert (g.num_layers, g.num_kv_heads, g.head_dim) == (30, 3, 64)
    assert engine.model.config.num_attention_heads == 9
    # 30 layers x 3 KV heads x 64 x 2 (K,V) x 4 bytes: a third of what 9 heads would need.
    assert g.bytes_per_token == 30 * 3 * 64 * 2 * 4
    assert engine.kv_cache.num_blocks == 64 * 2**20 // g.bytes_per_block


def test_greedy_matches_generate_for_several_requests(engine):
    prompts = [
        "The capital of France is",
        "def fibonacci(n):",
        "List three colors:",
        "Water boils at",
    ]
    ids = [engine.tokenize(p) for p in prompts]
    results = engine.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    for p, r in zip(ids, results):
        assert r.token_ids == hf_greedy(default_model_dir(), p, 12)


def test_chat_template_answer(engine):
    out = engine.generate(
        ["What is the capital of France?"],
        SamplingParams(max_tokens=24, temperature=0),
        apply_chat_template=True,
    )[0]
    assert "Paris" in out.text


def test_chat_messages_use_the_template(engine):
    question = "What is the capital of France?"
    templated = engine.tokenize([{"role": "user", "content": question}])
    assert templated == engine.tokenize(question, apply_chat_template=True)
    assert len(templated) > len(engine.tokenize(question))
    with pytest.raises(ValueError, match="role"):
        engine.tokenize([{"content": question}])
