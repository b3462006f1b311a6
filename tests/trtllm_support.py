"""What the TensorRT-LLM client tests share: the sample repositories and
``end_to_end_grpc_client.py``'s way of building a request (every tensor ``[1, 1]``)."""

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import np_to_triton_dtype

from support import ROOT

SAMPLES = {
    "ensemble": ROOT / "samples" / "trtllm_model_repository",
    "tensorrt_llm": ROOT / "samples" / "trtllm_llmapi_model_repository",
    "tensorrt_llm_stream": ROOT / "samples" / "trtllm_llmapi_streaming_model_repository",
    "ensemble_stream": ROOT / "samples" / "trtllm_streaming_model_repository",
    "ensemble_queue": ROOT / "samples" / "trtllm_streaming_model_repository",
    "unbatched": ROOT / "model_repository",
}


def prepare_tensor(name, value, client=grpcclient):
    """end_to_end_grpc_client.py's prepare_tensor (the type from the numpy dtype)."""
    t = client.InferInput(name, list(value.shape), np_to_triton_dtype(value.dtype))
    t.set_data_from_numpy(value)
    return t


def prepare_inputs(
    prompt,
    output_len,
    *,
    streaming=False,
    beam_width=1,
    temperature=1.0,
    stop_words=None,
    bad_words=None,
    end_id=None,
    pad_id=None,
    return_log_probs=None,
    num_return_sequences=None,
    exclude_input_in_output=False,
    **extra,
):
    """end_to_end_grpc_client.py's prepare_inputs: every tensor [1, 1] (batch of one)."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.ones((1, 1), np.int32) * output_len,
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
        "temperature": np.array([[temperature]], dtype=np.float32),
    }
    if num_return_sequences is not None:
        inputs["num_return_sequences"] = np.array([[num_return_sequences]], dtype=np.int32)
    if bad_words:
        inputs["bad_words"] = np.array([bad_words], dtype=object)
    if stop_words:
        inputs["stop_words"] = np.array([stop_words], dtype=object)
    if return_log_probs is not None:
        inputs["return_log_probs"] = np.array([[return_log_probs]], dtype=bool)
    if end_id is not None:
        inputs["end_id"] = np.array([[end_id]], dtype=np.int32)
    if pad_id is not None:
        inputs["pad_id"] = np.array([[pad_id]], dtype=np.int32)
    if exclude_input_in_output is not None:
        inputs["exclude_input_in_output"] = np.array([[exclude_input_in_output]], dtype=bool)
    inputs.update(extra)
    return inputs
