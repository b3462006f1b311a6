#!/usr/bin/env python3
"""Stream one answer from the slipstream model over gRPC (tritonclient).

    python client_examples/grpc_stream.py "What is the capital of France?" --url 127.0.0.1:8001

Responses arrive one per generated piece of text; the last one carries the parameter
``triton_final_response`` (asked for with ``enable_empty_final_response=True``).
"""

import argparse
import json
import queue
import sys
import time

import numpy as np
import tritonclient.grpc as grpcclient


def tensor(name, value, dtype):
    t = grpcclient.InferInput(name, list(value.shape), dtype)
    t.set_data_from_numpy(value)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompt", nargs="?", default="What is the capital of France?")
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="slipstream")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--raw", action="store_true", help="do not apply the chat template")
    args = ap.parse_args()

    sampling = {"max_tokens": args.max_tokens, "temperature": args.temperature}
    inputs = [
        tensor("text_input", np.array([args.prompt.encode()], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor(
            "sampling_parameters",
            np.array([json.dumps(sampling).encode()], dtype=np.object_),
            "BYTES",
        ),
        tensor("apply_chat_template", np.array([not args.raw]), "BOOL"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
    ]
    responses = queue.Queue()
    client = grpcclient.InferenceServerClient(args.url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    start = time.monotonic()
    first = None
    tokens = 0
    finish_reason = None
    client.async_stream_infer(args.model, inputs, request_id="1", enable_empty_final_response=True)
    try:
        while True:
            result, error = responses.get(timeout=600)
            if error is not None:
                print(f"\nerror: {error}", file=sys.stderr)
                return 1
            text = result.as_numpy("text_output")
            if text is not None:
                if first is None:
                    first = time.monotonic() - start
                sys.stdout.write(text[0].decode("utf-8"))
                sys.stdout.flush()
                tokens += int(result.as_numpy("num_output_tokens")[0])
                reason = result.as_numpy("finish_reason")[0].decode()
                finish_reason = reason or finish_reason
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    elapsed = time.monotonic() - start
    print(
        f"\n[{tokens} tokens in {elapsed:.2f} s, first after {(first or 0) * 1000:.0f} ms, "
        f"finish_reason={finish_reason}]"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
