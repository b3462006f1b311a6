"""vLLM offline (``LLM.generate``) on a benchmark workload; runs INSIDE the vLLM virtualenv.

    <vllm venv>/bin/python vllm_offline.py JOB.json RESULT.json

Standard library and vLLM only (this file is executed by the peer's own interpreter, which
has neither Slipstream nor the benchmark package). JOB.json: ``engine_args`` (vLLM's
``LLM(**engine_args)``), ``prompts`` and ``max_tokens`` (one per request), ``warmup``
(prompts of a few tokens' output). RESULT.json: the makespan of the measured
``generate`` call, each request's output token count and token ids, and the load time.
"""

from __future__ import annotations

import json
import sys
import time


def _params(max_tokens: int, sampling: dict | None = None):
    from vllm import SamplingParams

    # Exact lengths as every other path (vLLM bans EOS while under min_tokens); greedy unless
    # the request carries sampling parameters.
    return SamplingParams(
        max_tokens=max_tokens,
        min_tokens=max_tokens,
        ignore_eos=True,
        **(sampling or {"temperature": 0.0}),
    )


def run(job: dict) -> dict:
    from vllm import LLM

    t0 = time.perf_counter()
    llm = LLM(**job["engine_args"])
    load_s = time.perf_counter() - t0
    if job.get("warmup"):
        llm.generate(job["warmup"], [_params(4) for _ in job["warmup"]], use_tqdm=False)
    samplings = job.get("sampling") or [None] * len(job["max_tokens"])
    params = [_params(n, s) for n, s in zip(job["max_tokens"], samplings)]
    start = time.perf_counter()
    outputs = llm.generate(job["prompts"], params, use_tqdm=False)
    makespan = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return {
        "load_s": load_s,
        "makespan_s": makespan,
        "output_tokens": [len(t) for t in token_ids],
        "token_ids": token_ids,
    }


def main(argv: list) -> int:
    job = json.loads(open(argv[1]).read())
    result = run(job)
    with open(argv[2], "w") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":  # vLLM starts its engine core with spawn: the guard is required
    sys.exit(main(sys.argv))
