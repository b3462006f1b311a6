"""The GPU check's engine part: decode speed against the roofline and against transformers.

* ``decode_speed``: ``batch`` requests decode together; once every prompt is in, ``steps``
  engine steps are timed (each ends with the step's copy back, so wall time is device time
  plus whatever the host adds). Batch 1 gives the inter-token latency, larger batches the
  tokens per second.
* The roofline of a decode step: the bytes it must read -- every weight once, and each
  sequence's KV cache -- over the device's measured copy bandwidth.
* ``generate_speed``: transformers' ``generate`` (greedy, its default cache) on the same bf16
  weights and batch, for the same number of new tokens.
"""

from __future__ import annotations

import random
import time
from dataclasses import asdict, dataclass
from typing import Optional

import torch

from slipstream_bench.gpu_models import ModelSet, _sharing


@dataclass
class SpeedRow:
    model: str
    batch: int
    context: int  # mean context of the timed steps
    step_ms: float
    tokens_per_s: float
    roofline_ms: float  # (weight bytes + KV bytes) / copy bandwidth
    share_of_roofline: float  # roofline_ms / step_ms
    transformers_tokens_per_s: Optional[float] = None
    transformers_ms_per_token: Optional[float] = None

    def row(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_engine(models: ModelSet, tokenizer, device, batch: int, settings: dict):
    from slipstream import EngineConfig
    from slipstream.engine import LLMEngine

    config = EngineConfig(
        device=str(device),
        dtype="bfloat16",
        max_num_seqs=max(batch, 1),
        enable_prefix_caching=False,
        **settings,
    )
    return LLMEngine(config, model=models.engine_model(torch.bfloat16), tokenizer=tokenizer)


def decode_speed(
    engine,
    models: ModelSet,
    device: torch.device,
    batch: int,
    prompt_len: int,
    steps: int,
    copy_bw: float,
    seed: int = 0,
) -> SpeedRow:
    from slipstream import SamplingParams

    rng = random.Random(seed)
    vocab = min(models.geometry.vocab, 49152)
    params = SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True, detokenize=False)
    reqs = [
        engine.add_request([rng.randrange(3, vocab) for _ in range(prompt_len)], params)
        for _ in range(batch)
    ]
    while any(r.num_output_tokens < 2 for r in reqs):  # prompts in, one decode step warm
        engine.step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    _sync(device)
    elapsed = time.perf_counter() - start
    while engine.has_unfinished():
        engine.step()
    g = models.geometry
    context = prompt_len + 2 + steps // 2
    nbytes = g.weight_bytes(2) + batch * context * g.kv_bytes_per_token(2)
    step_ms = elapsed / steps * 1e3
    roofline_ms = nbytes / copy_bw * 1e3
    return SpeedRow(
        g.name,
        batch,
        context,
        step_ms,
        batch * steps / elapsed,
        roofline_ms,
        roofline_ms / step_ms,
    )


@torch.inference_mode()
def generate_speed(
    models: ModelSet, device: torch.device, batch: int, prompt_len: int, new_tokens: int
) -> tuple[float, float]:
    """(tokens per second, ms per generated token of one sequence) of ``generate``."""
    model = _sharing(models.engine_model(torch.bfloat16), torch.bfloat16)
    model.set_attn_implementation("sdpa" if device.type == "cuda" else "eager")
    vocab = min(models.geometry.vocab, 49152)
    ids = torch.randint(3, vocab, (batch, prompt_len), device=device)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )

    run(2)  # warm-up
    _sync(device)
    start = time.perf_counter()
    run(new_tokens)
    _sync(device)
    elapsed = time.perf_counter() - start
    return batch * new_tokens / elapsed, elapsed / new_tokens * 1e3
