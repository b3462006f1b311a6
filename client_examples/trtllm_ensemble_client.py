#!/usr/bin/env python3
"""Ask Slipstream's TensorRT-LLM-compatible `ensemble` as TRT-LLM's own clients do: tensors
with a batch dimension, unary `infer` (samples/trtllm_model_repository) or a gRPC stream
(samples/trtllm_streaming_model_repository with --streaming).

    slipstream serve --model-repository samples/trtllm_model_repository
    python client_examples/trtllm_ensemble_client.py "What is machine learning?" \
        "Why is the sky blue?"

Several prompts go in ONE request of batch size B; each answer comes back with its
``batch_index``. ``--return-log-probs`` adds ``cum_log_probs`` and ``output_log_probs``.
"""

import argparse
import queue

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype


def tensor(name, value):
    t = grpcclient.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("prompts", nargs="*", default=["What is machine learning?"])
    ap.add_argument("--url", default="127.0.0.1:8001")
    ap.add_argument("--model", default="ensemble")
    ap.add_argument("-o", "--output-len", type=int, default=32)
    ap.add_argument("-S", "--streaming", action="store_true")
    ap.add_argument("--return-log-probs", action="store_true")
    args = ap.parse_args()

    b = len(args.prompts)
    inputs = [
        tensor("text_input", np.array([[p] for p in args.prompts], dtype=object)),
        tensor("max_tokens", np.full((b, 1), args.output_len, np.int32)),
        tensor("bad_words", np.array([[""]] * b, dtype=object)),  # empty: none
        tensor("stop_words", np.array([[""]] * b, dtype=object)),
        tensor("beam_width", np.ones((b, 1), np.int32)),
        tensor("stream", np.full((b, 1), args.streaming)),
        tensor("return_log_probs", np.full((b, 1), args.return_log_probs)),
    ]
    wanted = ["text_output", "batch_index"] + (
        ["cum_log_probs", "output_log_probs"] if args.return_log_probs else []
    )
    outputs = [grpcclient.InferRequestedOutput(n) for n in wanted]
    client = grpcclient.InferenceServerClient(args.url)
    texts = [""] * b
    if args.streaming:  # decoupled model: one response per piece, per row
        results = queue.Queue()
        client.start_stream(callback=lambda result, error: results.put(error or result))
        client.async_stream_infer(args.model, inputs, outputs=outputs)
        client.stop_stream()  # returns once the server has ended the request
        responses = [results.get() for _ in range(results.qsize())]
    else:
        responses = [client.infer(args.model, inputs, outputs=outputs)]
    for result in responses:
        if isinstance(result, Exception):
            raise result
        for text, index in zip(
            result.as_numpy("text_output"), result.as_numpy("batch_index")[:, 0]
        ):
            texts[index] += text.decode()
        if args.return_log_probs and not args.streaming:
            print("cum_log_probs:", result.as_numpy("cum_log_probs")[:, 0])
    for i, text in enumerate(texts):
        print(f"[{i}] {text}")


if __name__ == "__main__":
    main()
