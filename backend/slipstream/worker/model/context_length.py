"""How long a sequence the model takes: its position limit read from its config, and
``max_model_len`` fitted to it as vLLM fits it."""

from __future__ import annotations

import dataclasses
from typing import Optional

from slipstream.core.config import EngineConfig

# Config fields that bound a model's positions (vLLM derives max_model_len from the same).
POSITION_LIMIT_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE scalings that stretch the positions a model was trained on by their factor.
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")
DEFAULT_MAX_MODEL_LEN = 2048  # a model whose config names no position limit


def position_limit(hf_config) -> Optional[int]:
    """The longest sequence the model's position embeddings cover, or None if unstated."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    stated = [getattr(cfg, name, None) for name in POSITION_LIMIT_FIELDS]
    limits = [v for v in stated if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not limits:
        return None
    limit = min(limits)
    rope = getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and factor > 1:
        return int(int(rope.get("original_max_position_embeddings") or limit) * factor)
    return int(limit)


def fit_max_model_len(config: EngineConfig, hf_config) -> EngineConfig:
    """``max_model_len`` resolved against the model: the model's limit when unset, refused
    when above it (past its positions a model with learned position embeddings fails every
    request of the step, and a RoPE model degrades)."""
    limit = position_limit(hf_config)
    if config.max_model_len is None:
        return dataclasses.replace(config, max_model_len=limit or DEFAULT_MAX_MODEL_LEN)
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the model's position limit "
            f"{limit} (max_position_embeddings in its config.json): set max_model_len <= {limit}, "
            "or leave it empty to use the model's limit"
        )
    return config
