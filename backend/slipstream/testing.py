"""Small random-model configs for tests: one per attention variant the engine must honour."""

from __future__ import annotations

from transformers import AutoConfig

_COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=1024,
)

_ARCHS = {
    "llama": dict(model_type="llama", num_key_value_heads=2, **_COMMON),
    "qwen2": dict(model_type="qwen2", num_key_value_heads=2, **_COMMON),
    "mistral": dict(model_type="mistral", num_key_value_heads=1, sliding_window=24, **_COMMON),
    "gemma2": dict(
        model_type="gemma2",
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=24,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        **_COMMON,
    ),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=1024),
}


def tiny_config(arch: str, vocab_size: int, **overrides):
    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {sorted(_ARCHS)}")
    values = dict(_ARCHS[arch])
    model_type = values.pop("model_type")
    values.update(overrides)
    return AutoConfig.for_model(str(model_type), vocab_size=vocab_size, **values)
