"""Models for the GPU check (``benchmarks/gpu_check.py``): real geometries with random weights
drawn on the device, and the embedded model's tokenizer (committed under ``benchmarks/data``).

A GPU machine without network access cannot download weights and too little travels with the
repository to carry them, so the check builds each geometry's ``LlamaForCausalLM`` directly on
the device from its config (transformers' own initialisation: normal weights, unit norms --
never zeros). Every engine and reference of one geometry shares those weights: the fp32 model
is the reference and the fp32 engine's model (one set of tensors, two module trees, since the
engine changes its model's attention implementation), the bf16 engine gets a bf16 copy.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "data" / "smollm2-tokenizer"

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@dataclass(frozen=True)
class Geometry:
    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    tied: bool
    rope: dict = field(default_factory=dict)
    max_positions: int = 8192

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def config(self):
        from transformers import LlamaConfig

        return LlamaConfig(
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            head_dim=self.head_dim,
            vocab_size=self.vocab,
            tie_word_embeddings=self.tied,
            rope_parameters=dict(self.rope),
            max_position_embeddings=self.max_positions,
            rms_norm_eps=1e-5,
            bos_token_id=1,
            eos_token_id=2,
        )

    def weight_bytes(self, itemsize: int) -> int:
        """Bytes a decode step reads in weights (the embedding row lookups aside)."""
        d, f, kv = self.hidden, self.intermediate, self.kv_heads * self.head_dim
        per_layer = d * d * 2 + d * kv * 2 + 3 * d * f + 2 * d
        return (self.layers * per_layer + self.vocab * d + d) * itemsize

    def kv_bytes_per_token(self, itemsize: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * itemsize


GEOMETRIES = {
    g.name: g
    for g in (
        Geometry("smollm2-135m", 576, 1536, 30, 9, 3, 49152, True, {"rope_theta": 100000.0}, 8192),
        Geometry(
            "llama-3.2-1b", 2048, 8192, 16, 32, 8, 128256, True, {**LLAMA3_ROPE, "factor": 32.0}
        ),
        Geometry(
            "llama-3.1-8b", 4096, 14336, 32, 32, 8, 128256, False, {**LLAMA3_ROPE, "factor": 8.0}
        ),
        # --smoke: the same code on CPU in seconds
        Geometry("tiny", 64, 128, 2, 4, 2, 512, True, {"rope_theta": 10000.0}, 2048),
    )
}


def load_tokenizer(directory: Path = TOKENIZER_DIR):
    """The embedded model's tokenizer, built from its files alone (any transformers 5)."""
    from transformers import PreTrainedTokenizerFast

    special = json.loads((directory / "tokenizer_config.json").read_text())
    names = ("bos_token", "eos_token", "pad_token", "unk_token")
    return PreTrainedTokenizerFast(
        tokenizer_file=str(directory / "tokenizer.json"),
        **{k: special[k] for k in names if k in special},
    )


@dataclass
class ModelSet:
    """One geometry's random weights on the device, as the check uses them."""

    geometry: Geometry
    reference: Any  # fp32 LlamaForCausalLM, eager attention (teacher forcing)
    fp32: Any  # the fp32 engine's model: the reference's tensors, its own module tree
    bf16: Optional[Any] = None  # a bf16 copy, made on demand

    def engine_model(self, dtype: torch.dtype):
        """The model an engine of ``dtype`` runs. A CPU engine repacks its model's linears
        (no other engine can run them then): it gets a copy of its own every time."""
        if next(self.reference.parameters()).device.type == "cpu":
            return _sharing(self.reference, dtype, copy_tensors=True)
        if dtype == torch.float32:
            return self.fp32
        if self.bf16 is None:
            self.bf16 = _sharing(self.reference, torch.bfloat16)
        return self.bf16

    def release(self) -> None:
        self.reference = self.fp32 = self.bf16 = None


def build_models(geometry: Geometry, device: torch.device, seed: int = 0) -> ModelSet:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        reference = LlamaForCausalLM(geometry.config()).to(torch.float32).eval()
    reference.set_attn_implementation("sdpa" if device.type == "cuda" else "eager")
    for p in reference.parameters():
        if not p.detach().abs().sum().item():
            raise RuntimeError("a weight came out all zeros")
    return ModelSet(geometry, reference, _sharing(reference, torch.float32))


def _sharing(model, dtype: torch.dtype, copy_tensors: bool = False):
    """A module tree of its own over ``model``'s tensors (converted to ``dtype``, or
    ``copy_tensors``: copies)."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    with torch.device("meta"):
        twin = LlamaForCausalLM(config)
    state = {k: v.to(dtype, copy=copy_tensors) for k, v in model.state_dict().items()}
    twin.load_state_dict(state, assign=True, strict=False)
    if config.tie_word_embeddings:
        twin.tie_weights()
    # buffers that are not in the state dict (rotary inverse frequencies) are rebuilt
    for name, module in twin.named_modules():
        if hasattr(module, "inv_freq") and module.inv_freq.device.type == "meta":
            source = dict(model.named_modules())[name]
            module.inv_freq = source.inv_freq.clone()
            if hasattr(source, "original_inv_freq"):
                module.original_inv_freq = source.original_inv_freq.clone()
    left = [n for n, t in [*twin.named_parameters(), *twin.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"tensors left unset in the copy: {left[:5]}")
    return twin.to(dtype).eval()
