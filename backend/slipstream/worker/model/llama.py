"""A Llama decoder stack as plain modules, loaded from its safetensors without transformers'
model code: what the CPU engine's lean forward (``fast_forward``) runs.

Importing transformers' model classes costs a serving process ~150 MB resident before a
weight is loaded: ``modeling_llama`` imports ``torch._dynamo`` (through its mask utilities,
~70 MB), and any transformers config class imports its distributed-sharding helpers and with
them sympy (~60 MB). For a 135M model in bf16 that is more than half of everything else the
process holds. The lean forward reads only the modules' weights and a few shape fields, so a
checkpoint it covers (plain Llama: SiLU MLP, RMSNorm, default RoPE) is built here from its
``config.json`` and weights, with the attribute names of the Hugging Face model
(``model.layers[i].self_attn.q_proj``...): every other part of the engine (the CPU layer
preparation, the KV geometry, LoRA's module names) finds what it looks for. The arithmetic
of each module is ``modeling_llama``'s, so logits are the Hugging Face model's bit for bit
(``tests/worker/model/test_llama_model.py``). Anything else loads through transformers as before.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from types import SimpleNamespace
from typing import Optional, Union

import torch
import torch.nn.functional as F
from torch import nn

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
WEIGHTS_INDEX_FILE = "model.safetensors.index.json"
GENERATION_FILE = "generation_config.json"
# Checkpoint tensors some exporters wrote that the model computes itself.
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class LlamaShape:
    """The fields of a Llama ``config.json`` the engine reads (named as transformers names
    them: the engine's config readers take either)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: Optional[int]
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    hidden_act: str = "silu"
    pretraining_tp: int = 1
    model_type: str = "llama"

    def get_text_config(self) -> "LlamaShape":
        return self

    @classmethod
    def parse(cls, raw: dict, quantized: bool = False) -> Optional["LlamaShape"]:
        """The shape of a checkpoint this module builds exactly, else None; ``quantized``:
        one whose linear weights a quantized loader places (``int4_checkpoint``)."""
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        plain = (
            raw.get("model_type") == "llama"
            and raw.get("hidden_act", "silu") == "silu"
            and raw.get("pretraining_tp", 1) in (1, None)
            and rope_type == "default"
            and (quantized or raw.get("quantization_config") is None)
        )
        if not plain:
            return None
        heads = int(raw["num_attention_heads"])
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=int(raw["hidden_size"]),
            intermediate_size=int(raw["intermediate_size"]),
            num_hidden_layers=int(raw["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", raw.get("rope_theta", 10000.0))),
            max_position_embeddings=raw.get("max_position_embeddings"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", False)),
            mlp_bias=bool(raw.get("mlp_bias", False)),
        )


@dataclass(frozen=True)
class GenerationDefaults:
    """What the engine reads of ``generation_config.json``: the ids that end a sequence."""

    eos_token_id: Union[int, list[int], None] = None

    @classmethod
    def read(cls, path: Path) -> "GenerationDefaults":
        """From ``generation_config.json``; without one, from ``config.json``, as
        transformers derives a model's generation config."""
        file = path / GENERATION_FILE
        if not file.exists():
            file = path / CONFIG_FILE
        raw = json.loads(file.read_text()) if file.exists() else {}
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


class Linear(nn.Linear):
    """An ``nn.Linear`` whose weight the checkpoint supplies: no random initialisation (its
    storage stays untouched until replaced, so never resident)."""

    def reset_parameters(self) -> None:
        pass


class Embedding(nn.Embedding):
    """An ``nn.Embedding`` whose table the checkpoint supplies (as ``Linear``)."""

    def reset_parameters(self) -> None:
        pass


class LlamaRMSNorm(nn.Module):  # named as cpu_norm and the lean forward know it
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(width))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        return self.weight * wide.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos / sin of each position's angles, ``[1, T, head_dim]``: the angle of frequency
    ``i`` is ``position * theta ** (-2i / head_dim)``, each half of the head rotated alike."""

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", 1.0 / (theta**exponents), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple:
        angles = position_ids[..., None].float() * self.inv_freq.float()
        both = torch.cat((angles, angles), dim=-1)
        return both.cos().to(x.dtype), both.sin().to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, layer_idx: int) -> None:
        super().__init__()
        s, bias = shape, shape.attention_bias
        self.layer_idx = layer_idx
        self.head_dim = s.head_dim
        self.scaling = s.head_dim**-0.5
        self.q_proj = Linear(s.hidden_size, s.num_attention_heads * s.head_dim, bias=bias)
        self.k_proj = Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=bias)
        self.v_proj = Linear(s.hidden_size, s.num_key_value_heads * s.head_dim, bias=bias)
        self.o_proj = Linear(s.num_attention_heads * s.head_dim, s.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal self-attention over ``x`` ``[B, T, hidden]`` alone (no cache)."""
        b, t, _ = x.shape

        def heads(y: torch.Tensor) -> torch.Tensor:
            return y.view(b, t, -1, self.head_dim).transpose(1, 2)

        cos, sin = cos[:, None], sin[:, None]
        q = _rotate(heads(self.q_proj(x)), cos, sin)
        k = _rotate(heads(self.k_proj(x)), cos, sin)
        out = F.scaled_dot_product_attention(
            q, k, heads(self.v_proj(x)), is_causal=True, scale=self.scaling, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class Mlp(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        s, bias = shape, shape.mlp_bias
        self.gate_proj = Linear(s.hidden_size, s.intermediate_size, bias=bias)
        self.up_proj = Linear(s.hidden_size, s.intermediate_size, bias=bias)
        self.down_proj = Linear(s.intermediate_size, s.hidden_size, bias=bias)
        self.act_fn = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(shape, index)
        self.mlp = Mlp(shape)
        self.input_layernorm = LlamaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape, i) for i in range(shape.num_hidden_layers))
        self.norm = LlamaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(shape.head_dim, shape.rope_theta)


class LlamaForCausalLM(nn.Module):
    """The served model. Its ``forward`` is a plain one over whole sequences (no KV cache),
    for the one calibration pass int8 makes at load; serving runs the lean forward."""

    def __init__(self, shape: LlamaShape, generation: GenerationDefaults) -> None:
        super().__init__()
        self.config = shape
        self.generation_config = generation
        self.model = Decoder(shape)
        self.lm_head = Linear(shape.hidden_size, shape.vocab_size, bias=False)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, **_ignored) -> SimpleNamespace:
        hidden = self.model.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        cos, sin = self.model.rotary_emb(hidden, positions)
        for layer in self.model.layers:
            hidden = layer(hidden, cos, sin)
        return SimpleNamespace(logits=self.lm_head(self.model.norm(hidden)))


def read_shape(path: Path) -> Optional[LlamaShape]:
    """The checkpoint's shape where this module can build it (a plain Llama with safetensors
    weights), else None."""
    config = path / CONFIG_FILE
    if not config.exists() or not weight_files(path):
        return None
    return LlamaShape.parse(json.loads(config.read_text()))


def weight_files(path: Path) -> list[Path]:
    index = path / WEIGHTS_INDEX_FILE
    if index.exists():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / shard for shard in shards]
    single = path / WEIGHTS_FILE
    return [single] if single.exists() else []


def load(path: Path, shape: LlamaShape, dtype: torch.dtype) -> LlamaForCausalLM:
    """The checkpoint at ``path`` (``read_shape`` gave ``shape``) in ``dtype``, on CPU."""
    from safetensors import safe_open

    # (not built on the meta device: torch's meta initialisers import torch._dynamo)
    model = LlamaForCausalLM(shape, GenerationDefaults.read(path))
    state: dict[str, torch.Tensor] = {}
    for file in weight_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if not name.endswith(_DERIVED_SUFFIXES):
                    state[name] = f.get_tensor(name).to(dtype)
    # Tied where the config says so, unless the checkpoint holds a head of its own that
    # differs from the embedding (transformers then keeps the two apart, and so does this).
    head, table = state.get("lm_head.weight"), state.get("model.embed_tokens.weight")
    tied = shape.tie_word_embeddings and (
        head is None or (table is not None and torch.equal(head, table))
    )
    if tied:
        state.pop("lm_head.weight", None)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if tied:
        missing = [name for name in missing if name != "lm_head.weight"]
    if missing or unexpected:
        raise ValueError(
            f"{path} does not hold a Llama checkpoint's weights: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}"
        )
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()
