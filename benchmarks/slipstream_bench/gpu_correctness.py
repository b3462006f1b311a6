"""The GPU check's correctness part: the engine's greedy tokens scored by teacher forcing.

A random model's logits are nearly flat, so two correct implementations part ways at the first
near-tie and exact greedy equality means little. Instead the engine generates freely, then
transformers in fp32, on the same weights, scores every position of the engine's own sequence
(prompt + generated tokens, one forward): a position agrees when the engine's token is the
reference's argmax, or within ``margin`` of its logit (a tie at that precision). The workload
exercises what serving does: prompts longer than the step's token budget (chunked prefill),
prompts sharing a prefix sent after the first wave finished (prefix-cache hits), and the CUDA
graphs on or off.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from slipstream_bench.gpu_models import ModelSet

# logit margins within which a different token is a tie, not an error
MARGINS = {torch.float32: 1e-3, torch.bfloat16: 0.25}


@dataclass(frozen=True)
class Workload:
    prompts: list  # token id lists
    max_tokens: int
    first_wave: int  # prompts sent first; the rest share their prefixes (cache hits)


def make_workload(
    n: int, lengths: tuple, shared: int, max_tokens: int, vocab: int, seed: int = 0
) -> Workload:
    """``n`` prompts of the given lengths (cycled) with random ids below ``vocab``; the second
    half repeats the first half's first ``shared`` tokens."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(3, vocab) for _ in range(lengths[i % len(lengths)])] for i in range(n)
    ]
    half = n // 2
    for i in range(half, n):
        source = prompts[i - half]
        keep = min(shared, len(source) - 1, len(prompts[i]) - 1)
        prompts[i] = source[:keep] + prompts[i][keep:]
    return Workload(prompts, max_tokens, half)


@dataclass
class Agreement:
    model: str
    dtype: str
    cuda_graphs: bool
    positions: int
    exact: float  # share of positions where the engine's token is the reference argmax
    within_margin: float  # ... or within the margin
    margin: float
    prefix_cache_hit_tokens: int
    steps: int
    max_step_tokens: int

    def row(self) -> dict:
        return asdict(self)


def run_engine(
    models: ModelSet,
    tokenizer,
    dtype: torch.dtype,
    graphs: bool,
    device,
    work: Workload,
    settings: dict,
):
    """The engine's greedy outputs (per prompt), and its stats."""
    from slipstream import EngineConfig, SamplingParams
    from slipstream.engine import LLMEngine

    config = EngineConfig(
        device=str(device),
        dtype="float32" if dtype == torch.float32 else "bfloat16",
        enable_cuda_graphs=graphs,
        **settings,
    )
    engine = LLMEngine(config, model=models.engine_model(dtype), tokenizer=tokenizer)
    params = SamplingParams(
        max_tokens=work.max_tokens, temperature=0, ignore_eos=True, detokenize=False
    )
    first = engine.generate(work.prompts[: work.first_wave], params)
    second = engine.generate(work.prompts[work.first_wave :], params)
    outputs = [r.token_ids for r in first + second]
    stats = engine.get_stats()
    max_step = config.max_num_batched_tokens
    del engine
    return outputs, stats, max_step


@torch.inference_mode()
def teacher_forced(reference, prompts: list, outputs: list, margin: float) -> tuple[int, int, int]:
    """(positions, exact, within margin) of ``outputs`` under ``reference``'s fp32 logits."""
    device = next(reference.parameters()).device
    positions = exact = within = 0
    for prompt, out in zip(prompts, outputs):
        if not out:
            continue
        ids = torch.tensor([prompt + out], device=device)
        logits = reference(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        chosen = logits.gather(1, torch.tensor(out, device=device)[:, None])[:, 0]
        top = logits.max(dim=-1).values
        positions += len(out)
        exact += int((chosen >= top).sum())
        within += int((chosen >= top - margin).sum())
    return positions, exact, within


def check(
    models: ModelSet,
    tokenizer,
    dtype: torch.dtype,
    graphs: bool,
    device,
    work: Workload,
    settings: dict,
    margin: Optional[float] = None,
) -> Agreement:
    outputs, stats, max_step = run_engine(models, tokenizer, dtype, graphs, device, work, settings)
    margin = MARGINS[dtype] if margin is None else margin
    positions, exact, within = teacher_forced(models.reference, work.prompts, outputs, margin)
    return Agreement(
        models.geometry.name,
        str(dtype).replace("torch.", ""),
        graphs,
        positions,
        exact / max(positions, 1),
        within / max(positions, 1),
        margin,
        stats.prefix_cache_hits,
        stats.steps,
        max_step,
    )
