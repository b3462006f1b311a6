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
from typing import Optional

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 400},
        "notes": {"type": "array", "items": {"type": "string"}},
        "age": {"type": "integer"},
    },
    "required": ["name", "notes", "age"],
}
REGEX = r"[A-Za-z ,.]{1,600}"
VARIANTS = {"free": 0.0, "half": 0.5, "all": 1.0}


def _params(constrained: bool, index: int, steps: int):
    from slipstream.core.sampling_params import SamplingParams

    spec = None
    if constrained:
        spec = {"json": SCHEMA} if index % 2 == 0 else {"regex": REGEX}
    return SamplingParams(
        max_tokens=steps + 2, temperature=0.0, ignore_eos=True, structured_outputs=spec
    )


class MaskTimer:
    """Time spent in the sampler's grammar-mask call (the only code a constrained request
    adds to a step): measured inside each step, so it does not depend on the machine's load
    the way a difference of two step times does."""

    def __init__(self) -> None:
        from slipstream.worker.sample import sampler

        self.spent = 0.0
        original = sampler.apply_grammar_masks

        def timed(logits, reqs) -> None:
            t0 = time.perf_counter()
            original(logits, reqs)
            self.spent += time.perf_counter() - t0

        sampler.apply_grammar_masks = timed

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


MASKS = None


def decode_step_times(
    engine,
    batch: int,
    share: float,
    context: int,
    steps: int,
    seed: int,
    masks: Optional[list] = None,
) -> list:
    rng = random.Random(seed)
    n_constrained = int(batch * share)
    for i in range(batch):
        prompt = [rng.randrange(100, 40000) for _ in range(context)]
        engine.add_request(prompt, _params(i < n_constrained, i, steps))
    times, mask_times = [], []
    while engine.has_unfinished():
        if MASKS is not None:
            MASKS.take()
        t0 = time.perf_counter()
        outputs = engine.step()
        spent = time.perf_counter() - t0
        if (
            len(outputs) == batch
            and all(len(o.token_ids) == 1 for o in outputs)
            and not any(o.finished for o in outputs)
        ):
            times.append(spent)
            mask_times.append(MASKS.take() if MASKS is not None else 0.0)
    if masks is not None:
        masks += mask_times[1:]
    return times[1:]  # the first one follows the prefill chunk


def compile_stall(engine, batch: int, context: int, fields: int = 2000) -> dict:
    """Step times of ``batch`` free streams with and without a huge schema compiling on
    another thread (as the tokenizer thread does for a real request)."""
    props = {
        f"field_{i}": {"type": "string", "pattern": f"^[a-z]{{{i % 7 + 1}}}[0-9]+$"}
        for i in range(fields)
    }
    huge = {"json": {"type": "object", "properties": props, "required": list(props)}}
    from slipstream.core.sampling_params import SamplingParams

    quiet = decode_step_times(engine, batch, 0.0, context, 16, seed=99)
    span = {}

    def compile_it() -> None:
        span["start"] = time.perf_counter()
        engine.make_request([1, 2, 3], SamplingParams(structured_outputs=huge))
        span["end"] = time.perf_counter()

    worker = threading.Thread(target=compile_it)
    rng = random.Random(7)
    for _ in range(batch):
        engine.add_request(
            [rng.randrange(100, 40000) for _ in range(context)],
            SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
        )
    steps = []  # (start, end) of each step where the whole batch decoded
    while engine.has_unfinished():
        if steps and not worker.is_alive() and "start" not in span:
            worker.start()  # after the prefill: only decode steps can overlap the compile
        t0 = time.perf_counter()
        outputs = engine.step()
        if len(outputs) == batch and all(len(o.token_ids) == 1 for o in outputs):
            steps.append((t0, time.perf_counter()))
    worker.join()
    during = [b - a for a, b in steps if a < span["end"] and b > span["start"]]
    return {
        "schema_chars": len(json.dumps(huge)),
        "compile_s": span["end"] - span["start"],
        "quiet_step_ms": statistics.median(quiet) * 1e3,
        "steps_overlapping_compile": len(during),
        "max_step_during_compile_ms": max(during) * 1e3,
        "median_step_during_compile_ms": statistics.median(during) * 1e3,
    }


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

    global MASKS
    MASKS = MaskTimer()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(
        EngineConfig(
            model=args.model,
            max_num_seqs=max(batches),
            max_num_batched_tokens=max(batches) * args.context,
        )
    )
    # Warm-up: both grammars compiled and cached, the kernels touched once.
    decode_step_times(engine, 2, 1.0, args.context, 4, seed=1)
    times = {(b, v): [] for b in batches for v in VARIANTS}
    masks = {(b, v): [] for b in batches for v in VARIANTS}
    for rep in range(args.repeats):
        for b in batches:
            for name, share in VARIANTS.items():
                times[(b, name)] += decode_step_times(
                    engine, b, share, args.context, args.steps, seed=rep, masks=masks[(b, name)]
                )
    print(
        f"{'batch':>5} {'variant':>8} {'step ms':>8} {'vs free':>8} {'mask ms':>8} "
        f"{'mask/step':>9} {'steps':>6}"
    )
    for b in batches:
        free = statistics.median(times[(b, "free")])
        for name in VARIANTS:
            med = statistics.median(times[(b, name)])
            mask = statistics.median(masks[(b, name)])
            print(
                f"{b:>5} {name:>8} {med * 1e3:>8.1f} {med / free:>8.3f} {mask * 1e3:>8.2f} "
                f"{mask / med:>9.3f} {len(times[(b, name)]):>6}"
            )
    print(json.dumps(compile_stall(engine, batches[0], args.context)))


if __name__ == "__main__":
    main()
