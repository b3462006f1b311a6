"""What structured outputs cost the engine: decode-step time at batch B with none, half or
all of the requests constrained, and how long other streams' steps take while a huge schema
compiles.

    python -m slipstream_bench.structured_cost [--batches 8,32] [--steps 24] [--repeats 3]

Variants run interleaved in one process (free, half, all; repeated), on the default model,
greedy, EOS ignored, ``context`` random prompt tokens; a step counts when every request of
the batch decodes in it. Constrained requests alternate a JSON schema and a regex that do not
complete within the run (the mask is computed for every one of their tokens).
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 400},
    "notes": {"type": "array", "items": {"type": "string"}},
    "age": {"type": "integer"}}, "required": ["name", "notes", "age"]}
REGEX = r"[A-Za-z ,.]{1,600}"
VARIANTS = {"free": 0.0, "half": 0.5, "all": 1.0}


def _params(constrained: bool, index: int, steps: int):
    from slipstream.core.sampling_params import SamplingParams

    spec = None
    if constrained:
        spec = {"json": SCHEMA} if index % 2 == 0 else {"regex": REGEX}
    return SamplingParams(max_tokens=steps + 2, temperature=0.0, ignore_eos=True,
                          structured_outputs=spec)


def decode_step_times(engine, batch: int, share: float, context: int, steps: int,
                      seed: int) -> list:
    rng = random.Random(seed)
    n_constrained = int(batch * share)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        engine.add_request(prompt, _params(i < n_constrained, i, steps))
    times = []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outputs = engine.step()
        spent = time.perf_counter() - t0
        if len(outputs) == batch and all(len(o.token_ids) == 1 for o in outputs) \
                and not any(o.finished for o in outputs):
            times.append(spent)
    return times[1:]  # the first one follows the prefill chunk


def compile_stall(engine, batch: int, context: int, fields: int = 2000) -> dict:
    """Step times of ``batch`` free streams with and without a huge schema compiling on
    another thread (as the tokenizer thread does for a real request)."""
    props = {f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
             for i in range(fields)}
    huge = {"json": {"type": "object", "properties": props, "required": list(props)}}
    from slipstream.core.sampling_params import SamplingParams

    quiet = decode_step_times(engine, batch, 0.0, context, 16, seed=99)
    done = {}

    def compile_it() -> None:
        t0 = time.perf_counter()
        engine.make_request([1, 2, 3], SamplingParams(structured_outputs=huge))
        done["compile_s"] = time.perf_counter() - t0
    worker = threading.Thread(target=compile_it)
    rng = random.Random(7)
    for _ in range(batch):
        engine.add_request([rng.randrange(100, 40000) for _ in range(context)],
                           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
    busy, started = [], False
    while engine.has_unfinished():
        if not started and engine.stats.generation_tokens:
            worker.start()
            started = True
        t0 = time.perf_counter()
        engine.step()
        if started and worker.is_alive():
            busy.append(time.perf_counter() - t0)
    worker.join()
    return {"schema_chars": len(json.dumps(huge)), "compile_s": done.get("compile_s"),
            "quiet_step_ms": statistics.median(quiet) * 1e3,
            "steps_during_compile": len(busy),
            "max_step_during_compile_ms": max(busy) * 1e3 if busy else None,
            "median_step_during_compile_ms": statistics.median(busy) * 1e3 if busy else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default="default")
    args = parser.parse_args(argv)
    from slipstream.core.config import EngineConfig
    from slipstream.engine import LLMEngine

    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=max(batches),
                                    max_num_batched_tokens=max(batches) * args.context))
    # Warm-up: both grammars compiled and cached, the kernels touched once.
    decode_step_times(engine, 2, 1.0, args.context, 4, seed=1)
    times = {(b, v): [] for b in batches for v in VARIANTS}
    for rep in range(args.repeats):
        for b in batches:
            for name, share in VARIANTS.items():
                times[(b, name)] += decode_step_times(engine, b, share, args.context,
                                                      args.steps, seed=rep)
    print(f"{'batch':>5} {'variant':>8} {'median ms':>10} {'vs free':>8} {'steps':>6}")
    for b in batches:
        free = statistics.median(times[(b, "free")])
        for name in VARIANTS:
            med = statistics.median(times[(b, name)])
            print(f"{b:>5} {name:>8} {med * 1e3:>10.1f} {med / free:>8.3f} "
                  f"{len(times[(b, name)]):>6}")
    print(json.dumps(compile_stall(engine, batches[0], args.context)))


if __name__ == "__main__":
    main()
