#!/usr/bin/env python3
"""Many prompts at once over ONE gRPC stream: in-flight batching at work.

    python client_examples/concurrent_clients.py --url 127.0.0.1:8001 -n 16

Every request is sent immediately; responses interleave on the stream and are routed by
request id. Prints each request's text, time to first token, total time and tokens/s.
"""

import argparse
import json
import sys
import threading
import time

import numpy as np
import tritonclient.grpc as grpcclient

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "What is 12 times 12?",
    "Name three primary colors.",
    "Give me a synonym for happy.",
    "What does a CPU do?",
    "Translate 'good morning' into Spanish.",
]


def tensor(name, value, dtype):
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="slipstream")
    ap.add_argument("-n", "--num-requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = ap.parse_args()

    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.num_requests)]
    state = {
        str(i): {"prompt": p, "parts": [], "tokens": 0, "first": None, "end": None, "error": None}
        for i, p in enumerate(prompts)
    }
    done = threading.Semaphore(0)
    start = time.monotonic()

    def callback(result, error):
        now = time.monotonic()
        if error is not None:  # errors on a stream do not always name their request
            rid = getattr(error, "request_id", None) or "?"
            print(f"error ({rid}): {error}", file=sys.stderr)
            done.release()
            return
        response = result.get_response()
        s = state[response.id]
        text = result.as_numpy("text_output")
        if text is not None:
            if s["first"] is None:
                s["first"] = now - start
            s["parts"].append(text[0].decode("utf-8"))
            s["tokens"] += int(result.as_numpy("num_output_tokens")[0])
        if response.parameters["triton_final_response"].bool_param:
            s["end"] = now - start
            done.release()

    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=callback)
    sampling = json.dumps({"max_tokens": args.max_tokens, "temperature": args.temperature})
    for rid, s in state.items():
        client.async_stream_infer(
            args.model,
            [
                tensor("text_input", np.array([s["prompt"].encode()], dtype=np.object_), "BYTES"),
                tensor("stream", np.array([True]), "BOOL"),
                tensor(
                    "sampling_parameters", np.array([sampling.encode()], dtype=np.object_), "BYTES"
                ),
                tensor("apply_chat_template", np.array([not args.raw]), "BOOL"),
                tensor("return_num_output_tokens", np.array([True]), "BOOL"),
            ],
            request_id=rid,
            enable_empty_final_response=True,
        )
    for _ in state:
        if not done.acquire(timeout=900):
            print("timed out waiting for responses", file=sys.stderr)
            break
    client.stop_stream()
    client.close()
    wall = time.monotonic() - start

    total = 0
    for rid, s in state.items():
        text = "".join(s["parts"]).replace("\n", " ")
        total += s["tokens"]
        first = f"{s['first'] * 1000:6.0f} ms" if s["first"] is not None else "   -    "
        end = f"{s['end']:6.2f} s" if s["end"] is not None else "   -   "
        print(
            f"[{rid:>3}] first {first}  done {end}  {s['tokens']:4d} tok  "
            f"{s['prompt']!r} -> {text[:100]!r}"
        )
    print(f"{len(state)} requests, {total} tokens in {wall:.2f} s = {total / wall:.1f} tokens/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
