"""Tiny PEFT LoRA adapters for the tiny random model, and their merged-weight references."""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from slipstream.cache_dir import cache_root
from support import tiny_model_dir

ATTENTION = ["q_proj", "v_proj"]
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig settings, seed): two adapters that differ in targets, rank and scaling
ADAPTERS = {
    "doll": (dict(r=8, lora_alpha=16, target_modules=ATTENTION), 1),
    "sheep": (dict(r=4, lora_alpha=8, target_modules=ALL_TARGETS, use_rslora=True), 2),
}


def _base(arch: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir(arch)), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def make_adapter(target: Path, arch: str = "llama", seed: int = 0, **lora_config) -> Path:
    """A PEFT adapter saved by PEFT itself, with random (non-zero) A and B, so that it really
    changes the model's outputs."""
    from peft import LoraConfig, get_peft_model

    target = Path(target)
    if (target / "adapter_model.safetensors").exists():
        return target
    torch.manual_seed(seed)
    model = get_peft_model(_base(arch), LoraConfig(init_lora_weights=False, **lora_config))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.mul_(0.5)  # keep activations in a sane range
    model.save_pretrained(str(target))
    return target


@functools.lru_cache(maxsize=None)
def adapter_dir(name: str, arch: str = "llama") -> Path:
    config, seed = ADAPTERS[name]
    return make_adapter(cache_root() / "test-models" / f"lora-{arch}-{name}", arch, seed, **config)


@functools.lru_cache(maxsize=None)
def merged_model(name: str, arch: str = "llama"):
    """The base model with the adapter merged into its weights by PEFT: the reference."""
    if name is None:
        return _base(arch)
    from peft import PeftModel

    return PeftModel.from_pretrained(_base(arch), str(adapter_dir(name, arch))).merge_and_unload()


def merged_greedy(name, prompt: list, max_tokens: int, arch: str = "llama") -> list:
    """``generate`` on the merged model for one request alone (``name`` None: the base)."""
    model = merged_model(name, arch)
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        )
    return out[0, len(prompt) :].tolist()
