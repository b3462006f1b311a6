"""Per-step cost of a decode step and of prefill at batch B, timed from outside the engine,
the same way for vLLM offline and for Slipstream's in-process engine.

    python -m slipstream_bench.decode_steps --batches 8,32,64 --context 300   # Slipstream
    <vllm venv>/bin/python decode_steps.py --engine vllm --model DIR ...      # vLLM

B requests of ``context`` random prompt tokens are generated to 1 token and to ``1 + steps``
tokens (greedy, EOS banned): the difference over ``steps`` is one decode step at batch B
(context ``context``..``context + steps``), and the 1-token run is the prefill of B x context
tokens plus one step. Standard library and the engine only: this file also runs in the vLLM
virtualenv, which has neither Slipstream nor the benchmark package.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time


def _prompts(batch: int, context: int, seed: int) -> list:
    rng = random.Random(seed + batch)
    return [[rng.randrange(100, 40000) for _ in range(context)] for _ in range(batch)]


class _Vllm:
    def __init__(self, model: str, eager: bool) -> None:
        from vllm import LLM

        self.llm = LLM(
            model=model, dtype="float32", max_model_len=2048, seed=0, enforce_eager=eager
        )

    def generate(self, prompts: list, tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0
        )
        self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False
        )


class _Slipstream:
    def __init__(self, settings: dict, batch: int) -> None:
        from slipstream.core.config import EngineConfig
        from slipstream.engine import LLMEngine

        self.engine = LLMEngine(EngineConfig.from_dict({"max_num_seqs": str(batch), **settings}))

    def generate(self, prompts: list, tokens: int) -> None:
        from slipstream.core.sampling_params import SamplingParams

        params = SamplingParams(
            max_tokens=tokens, min_tokens=tokens, ignore_eos=True, temperature=0.0
        )
        self.engine.generate(prompts, params)


def measure(engine, batch: int, context: int, steps: int, seed: int = 0) -> dict:
    def timed(tokens: int, salt: int) -> float:
        # fresh prompts each time: no prefix-cache hits on either engine
        prompts = _prompts(batch, context, seed + 1000 * salt)
        t = time.perf_counter()
        engine.generate(prompts, tokens)
        return time.perf_counter() - t

    timed(2, 0)  # warm-up at this batch size
    one = min(timed(1, 1), timed(1, 2))
    many = min(timed(1 + steps, 3), timed(1 + steps, 4))
    return {
        "batch": batch,
        "context": context,
        "prefill_and_first_s": one,
        "prefill_tokens_per_s": batch * context / one,
        "decode_step_ms": (many - one) / steps * 1e3,
        "decode_tokens_per_s": batch * steps / (many - one),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--engine", choices=("slipstream", "vllm"), default="slipstream")
    p.add_argument("--model", default="default")
    p.add_argument("--eager", action="store_true", help="vLLM: enforce_eager (no torch.compile)")
    p.add_argument("--batches", default="8,32,64")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="Slipstream engine settings"
    )
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.engine == "vllm":
        engine = _Vllm(args.model, args.eager)
    else:
        settings = dict(item.split("=", 1) for item in args.set)
        if args.model != "default":
            settings["model"] = args.model
        engine = _Slipstream(settings, max(batches))
    results = []
    for b in batches:
        r = measure(engine, b, args.context, args.steps)
        results.append(r)
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    sys.exit(main())
