"""Small random models for tests and demos: one config per attention variant the engine must
honour, saved with the embedded model's tokenizer."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoConfig

from slipstream.worker.model.gguf import DEFAULT_GGUF_FILE, default_gguf_path

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


def make_tiny_model_dir(target: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A small random model with the SmolLM2 tokenizer, for tests and demos without 30 s loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = Path(target)
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(
        str(default_gguf_path().parent), gguf_file=DEFAULT_GGUF_FILE
    )
    overrides.setdefault("bos_token_id", tokenizer.bos_token_id)
    overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
