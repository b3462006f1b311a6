"""Shared test helpers: cached tiny models and the Hugging Face greedy reference."""
from __future__ import annotations

import functools
import random
from pathlib import Path

import torch

from slipstream.worker.model_loader import cache_root, make_tiny_model_dir


@functools.lru_cache(maxsize=None)
def tiny_model_dir(arch: str = "llama") -> Path:
    return make_tiny_model_dir(cache_root() / "test-models" / f"tiny-{arch}", arch)


@functools.lru_cache(maxsize=None)
def reference_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                attn_implementation="eager").eval()


def hf_greedy(path: Path, prompt: list, max_tokens: int) -> list:
    """``model.generate`` for one request alone: the ground truth for greedy outputs."""
    model = reference_model(path)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens,
                             min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def random_workload(n: int, seed: int = 0, lengths=(1, 2, 5, 17, 40, 64, 130, 300),
                    max_out: int = 24) -> tuple:
    rng = random.Random(seed)
    prompts = [[rng.randrange(100, 40000) for _ in range(lengths[i % len(lengths)])] for i in range(n)]
    outs = [rng.randrange(1, max_out) for _ in range(n)]
    return prompts, outs
