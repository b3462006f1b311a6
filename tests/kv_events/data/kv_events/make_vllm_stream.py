#!/usr/bin/env python3
"""Write vllm_kv_stream.json: the KV event stream vLLM's own engine publishes for a known
sequence of requests, for tests/kv_events/test_kv_event_stream.py (CI has no vLLM; this runs
once, in the peers' venv, on a model directory such as ~/.cache/slipstream/smollm2-135m-instruct):

    cd tests/kv_events/data/kv_events
    ~/.cache/slipstream/peers/venv/bin/python make_vllm_stream.py MODEL_DIR

vLLM's offline ``LLM`` with prefix caching (``sha256_cbor``), KV events on a ZMQ PUB socket and
one core; a subscriber records every batch after each ``generate`` call:

* ``sequential``: A, then B, then C, one at a time; all three share a 10-block prefix.
* ``co_queued``: after ``reset_prefix_cache``, X (another prefix) and A2, B2 (sharing a new
  prefix) in one ``generate`` call with a 512-token step budget: X and the start of A2 fill the
  first step; the second computes the rest of A2 while B2 is admitted. vLLM caches a block
  when it schedules it, so B2 reuses A2's prefix blocks in that same step: the prefix-cache
  hits say so.

Token ids are consecutive runs (the events carry only ids; any model with the vocabulary
computes the same blocks). Each prompt ends mid-block and asks for one token, so no decode
block fills and the stream depends on the prompts alone.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

BLOCK_SIZE = 32
BUDGET = 512
PREFIX = list(range(2000, 2000 + 10 * BLOCK_SIZE))  # 10 blocks
PREFIX2 = list(range(3000, 3000 + 10 * BLOCK_SIZE))
OTHER = list(range(5000, 5000 + 400))
PROMPTS = {
    "A": PREFIX + list(range(9000, 9040)),
    "B": PREFIX + list(range(9100, 9140)),
    "C": PREFIX + list(range(9200, 9240)),
    "X": OTHER + list(range(9300, 9310)),
    "A2": PREFIX2 + list(range(9400, 9440)),
    "B2": PREFIX2 + list(range(9500, 9540)),
}
PORT = 5591
OUT = Path(__file__).with_name("vllm_kv_stream.json")


def event_json(event) -> dict:
    import msgspec

    return json.loads(msgspec.json.encode(event))


def drain(sub, settle_s: float = 1.0) -> list:
    """Every batch received until none arrives for ``settle_s``: a list of event lists."""
    import msgspec
    from vllm.distributed.kv_events import KVEventBatch

    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    batches = []
    deadline = time.monotonic() + settle_s
    while time.monotonic() < deadline:
        if sub.poll(50):
            _topic, _seq, payload = sub.recv_multipart()
            batch = decoder.decode(payload)
            batches.append([{"type": type(e).__name__, **event_json(e)} for e in batch.events])
            deadline = time.monotonic() + settle_s
    return batches


def hits(llm) -> int:
    """Prompt tokens served from vLLM's prefix cache so far."""
    for metric in llm.get_metrics():
        if metric.name == "vllm:prefix_cache_hits":
            return int(metric.value)
    raise RuntimeError("vLLM reports no vllm:prefix_cache_hits")


def main(model_dir: str) -> None:
    os.environ.pop("PYTHONHASHSEED", None)  # NONE_HASH from vLLM's fixed seed
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0")
    import vllm
    import zmq
    from vllm import LLM, SamplingParams
    from vllm.config import KVEventsConfig
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model_dir,
        dtype="float32",
        block_size=BLOCK_SIZE,
        max_num_batched_tokens=BUDGET,
        max_model_len=1024,
        enable_prefix_caching=True,
        prefix_caching_hash_algo="sha256_cbor",
        enforce_eager=True,
        kv_cache_memory_bytes=64 << 20,
        disable_log_stats=False,
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{PORT}"
        ),
    )
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{PORT}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    time.sleep(1.0)
    params = SamplingParams(max_tokens=1, temperature=0.0)

    def run(names: list) -> dict:
        before = hits(llm)
        llm.generate([TokensPrompt(prompt_token_ids=PROMPTS[n]) for n in names], params)
        return {"requests": names, "batches": drain(sub), "hit_tokens": hits(llm) - before}

    drain(sub)
    sequential = [run([name]) for name in ("A", "B", "C")]
    assert llm.reset_prefix_cache()
    cleared = drain(sub)
    co_queued = run(["X", "A2", "B2"])
    OUT.write_text(
        json.dumps(
            {
                "made_by": f"vLLM {vllm.__version__} (LLM, CPU, one core), "
                f"Python {sys.version.split()[0]}: {Path(__file__).name}",
                "block_size": BLOCK_SIZE,
                "max_num_batched_tokens": BUDGET,
                "prompts": PROMPTS,
                "sequential": sequential,
                "reset": cleared,
                "co_queued": co_queued,
            },
            indent=1,
        )
        + "\n"
    )
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main(sys.argv[1])
