"""What parallel sampling (n) saves and what prompt logprobs cost, on the in-process engine.

    PYTHONPATH=backend:benchmarks python benchmarks/parallel_sampling_measures.py [--rounds 3]

1. KV blocks: one request of n=8 over a long prompt vs 8 separate requests of that prompt
   (prefix caching off and on), the block manager's peak of used blocks and the prompt
   tokens computed.
2. Step time at batch 8 and 32 sequences: B/8 requests of n=8 vs B requests of n=1 over the
   same prompts (prefix caching off, so the n=1 requests compute their prompts): the prefill
   (time until every sequence has its first token) and the mean decode step.
3. prompt_logprobs: the prefill step of B requests with and without ``prompt_logprobs=1``.

Variants are interleaved round by round in one process; medians and ratios are printed as
JSON. The machine is shared: compare ratios, not absolute times.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import subprocess
import time

from slipstream.core.config import EngineConfig
from slipstream.core.sampling_params import SamplingParams
from slipstream.engine import LLMEngine

BLOCK = 16


def cpu_name() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(
            line.split(":", 1)[1].strip()
            for line in out.splitlines()
            if line.startswith("Model name")
        )
    except Exception:  # noqa: BLE001 - best effort
        return platform.processor()


def prompt(length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(length)]


def run(engine: LLMEngine, prompts: list, params: SamplingParams) -> dict:
    """Steps to completion: peak blocks, prefill time (until every sequence has sampled) and
    decode step times (steps where every sequence decodes)."""
    for p in prompts:
        engine.add_request(p, params)
    want = len(prompts) * params.n
    prompt_tokens = engine.stats.prompt_tokens_total
    sampled: set = set()  # (request, index) that have their first token
    peak, prefill, decode, started = 0, None, [], time.perf_counter()
    while engine.has_unfinished():
        running = engine.scheduler.running
        decoding = (
            len(running) == want
            and not engine.scheduler.waiting
            and all(r.num_output_tokens > 0 for r in running)
        )
        t0 = time.perf_counter()
        outputs = engine.step()
        t1 = time.perf_counter()
        peak = max(peak, engine.block_manager.num_used_blocks)
        if decoding:
            decode.append(t1 - t0)
        sampled.update((o.request_id, o.index) for o in outputs if o.token_ids)
        if prefill is None and len(sampled) == want:
            prefill = t1 - started
    return {
        "peak_blocks": peak,
        "prefill_s": prefill,
        "decode_step_s": statistics.mean(decode) if decode else None,
        "prompt_tokens": engine.stats.prompt_tokens_total - prompt_tokens,
    }


def kv_blocks(engine: LLMEngine, length: int) -> dict:
    long_prompt = prompt(length, 1)
    params = dict(max_tokens=4, temperature=1.0, seed=0, ignore_eos=True)
    result = {}
    for caching in (False, True):
        engine.block_manager.enable_prefix_caching = caching
        result[f"8 requests, prefix caching {'on' if caching else 'off'}"] = run(
            engine, [long_prompt] * 8, SamplingParams(**params)
        )
        result[f"n=8, prefix caching {'on' if caching else 'off'}"] = run(
            engine, [long_prompt], SamplingParams(n=8, **params)
        )
    engine.block_manager.enable_prefix_caching = False
    return {
        k: {"peak_blocks": v["peak_blocks"], "prompt_tokens": v["prompt_tokens"]}
        for k, v in result.items()
    }


def step_times(engine: LLMEngine, batch: int, context: int, rounds: int) -> dict:
    params = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    prompts = [prompt(context, 100 + i) for i in range(batch // 8)]
    samples: dict = {"n=1": [], "n=8": []}
    for _ in range(rounds):
        samples["n=1"].append(
            run(engine, [p for p in prompts for _ in range(8)], SamplingParams(**params))
        )
        samples["n=8"].append(run(engine, prompts, SamplingParams(n=8, **params)))
    return _summary(samples, ("prefill_s", "decode_step_s"), "n=1", "n=8")


def prompt_logprob_times(engine: LLMEngine, batch: int, context: int, rounds: int) -> dict:
    samples: dict = {"off": [], "prompt_logprobs=1": []}
    for r in range(rounds):
        prompts = [prompt(context, 1000 * r + i) for i in range(batch)]
        for name, extra in (("off", {}), ("prompt_logprobs=1", {"prompt_logprobs": 1})):
            samples[name].append(run(engine, prompts, SamplingParams(max_tokens=1, **extra)))
    return _summary(samples, ("prefill_s",), "off", "prompt_logprobs=1")


def _summary(samples: dict, keys: tuple, base: str, other: str) -> dict:
    out = {
        name: {k: statistics.median(s[k] for s in runs) for k in keys}
        for name, runs in samples.items()
    }
    out["ratio"] = {k: out[other][k] / out[base][k] for k in keys}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="default")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--long-prompt", type=int, default=1000)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--logprob-context", type=int, default=64)
    ap.add_argument(
        "--sections", default="kv,n,prompt_logprobs", help="which measures to run, comma-separated"
    )
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            block_size=BLOCK,
            max_num_seqs=64,
            max_num_batched_tokens=8192,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=1 << 30,
            max_model_len=2048,
        )
    )
    show({"cpu": cpu_name(), "model": args.model, "rounds": args.rounds})
    if "kv" in sections:
        show({"kv_blocks": kv_blocks(engine, args.long_prompt)})
    for batch in (8, 32):
        if "n" in sections:
            show(
                {f"n_sampling_batch_{batch}": step_times(engine, batch, args.context, args.rounds)}
            )
        if "prompt_logprobs" in sections:
            show(
                {
                    f"prompt_logprobs_batch_{batch}": prompt_logprob_times(
                        engine, batch, args.logprob_context, args.rounds
                    )
                }
            )


def show(part: dict) -> None:
    print(json.dumps(part, indent=1), flush=True)


if __name__ == "__main__":
    main()
