"""Helpers for the tests ported from Triton's vLLM backend CI (``ci/`` of triton-inference-server/
vllm_backend): model directories in its layout (``config.pbtxt`` + ``1/model.json``), its
request builder and callback, and Hugging Face greedy references on the served tiny model."""

from __future__ import annotations

import functools
import json
import queue
from pathlib import Path
from typing import Optional

import numpy as np
import torch
import tritonclient.grpc as grpcclient

from slipstream.server.launch.scrape import scrape
from support import reference_model, tiny_model_dir

# The sample model.json's settings (its model swapped for the tiny llama), plus a small KV pool.
MODEL_JSON = {
    "gpu_memory_utilization": 0.5,
    "enforce_eager": True,
    "max_model_len": 1024,
    "kv_cache_memory_bytes": 16 * 2**20,
}
SAMPLING_PARAMETERS = {"temperature": "0", "top_p": "1"}
VLLM_DEFAULT_MAX_TOKENS = 16


# The engine fails its health check from the second check on: vllm_backend's CI mocks vLLM's
# check_health() the same way (L0_check_health_vllm/test.sh).
FAILING_HEALTH_MODEL_PY = """
import os, sys
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
from slipstream.server.triton_model import TritonPythonModel as _Adapter


class TritonPythonModel(_Adapter):
    checks = 0

    def engine_problem(self):
        type(self).checks += 1
        return "Simulated engine check_health() failure" if self.checks > 1 else None
"""


def write_model(
    repo: Path,
    name: str,
    *,
    model_json: Optional[dict] = None,
    parameters: Optional[dict] = None,
    backend: str = "slipstream",
    model_py: Optional[str] = None,
) -> Path:
    """One model directory as vllm_backend's samples have it: backend, KIND_MODEL, model.json."""
    directory = repo / name
    (directory / "1").mkdir(parents=True)
    lines = [f'backend: "{backend}"', "instance_group [{ count: 1 kind: KIND_MODEL }]"]
    for key, value in (parameters or {}).items():
        lines.append(f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}')
    (directory / "config.pbtxt").write_text("\n".join(lines) + "\n")
    args = {"model": str(tiny_model_dir("llama")), **MODEL_JSON, **(model_json or {})}
    (directory / "1" / "model.json").write_text(json.dumps(args, indent=2))
    if model_py is not None:
        (directory / "1" / "model.py").write_text(model_py)
    return directory


def create_vllm_request(
    prompt: str,
    request_id,
    stream: bool,
    sampling_parameters: dict,
    send_parameters_as_tensor: bool = True,
    exclude_input_in_output: Optional[bool] = None,
) -> dict:
    """vllm_backend's ``ci/common/test_util.py`` request, field for field."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("stream", [1], "BOOL"),
    ]
    inputs[0].set_data_from_numpy(np.array([prompt.encode("utf-8")], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([stream], dtype=bool))
    if send_parameters_as_tensor:
        inputs.append(grpcclient.InferInput("sampling_parameters", [1], "BYTES"))
        inputs[-1].set_data_from_numpy(
            np.array([json.dumps(sampling_parameters).encode("utf-8")], dtype=np.object_)
        )
    if exclude_input_in_output is not None:
        inputs.append(grpcclient.InferInput("exclude_input_in_output", [1], "BOOL"))
        inputs[-1].set_data_from_numpy(np.array([exclude_input_in_output], dtype=bool))
    return {
        "inputs": inputs,
        "outputs": [grpcclient.InferRequestedOutput("text_output")],
        "request_id": str(request_id),
        "parameters": sampling_parameters,
    }


def bool_input(name: str, value: bool):
    tensor = grpcclient.InferInput(name, [1], "BOOL")
    tensor.set_data_from_numpy(np.array([value], dtype=bool))
    return tensor


def stream_requests(url: str, model: str, requests: list, timeout: float = 120) -> list:
    """Send requests on one stream and stop it (which waits for every response), as the
    upstream tests do; returns [(result, error)] in arrival order."""
    got: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    client.start_stream(
        callback=lambda result, error: got.put((result, error)), stream_timeout=timeout
    )
    for r in requests:
        client.async_stream_infer(
            model_name=model,
            inputs=r["inputs"],
            outputs=r.get("outputs"),
            request_id=r.get("request_id", ""),
            parameters=r.get("parameters"),
        )
    client.stop_stream()
    client.close()
    return [got.get_nowait() for _ in range(got.qsize())]


@functools.lru_cache(maxsize=None)
def hf_completion(prompt: str, max_tokens: int = VLLM_DEFAULT_MAX_TOKENS) -> tuple:
    """(token ids, text) Hugging Face greedy decoding gives on the served tiny model, stopping
    at EOS as the server does; the text as one decode of the tokens."""
    path = tiny_model_dir("llama")
    model = reference_model(path)
    tokenizer = tokenizer_of()
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        )
    tokens = out[0, len(ids) :].tolist()
    if tokenizer.eos_token_id in tokens:
        tokens = tokens[: tokens.index(tokenizer.eos_token_id) + 1]
    text = tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)
    return tuple(tokens), text


def hf_stream_pieces(prompt: str, max_tokens: int = VLLM_DEFAULT_MAX_TOKENS) -> list:
    """The text each streamed response carries: what each greedy token adds to the text."""
    tokenizer = tokenizer_of()
    tokens, _ = hf_completion(prompt, max_tokens)
    decode = functools.partial(
        tokenizer.decode, skip_special_tokens=True, clean_up_tokenization_spaces=False
    )
    return [
        decode(list(tokens[: i + 1]))[len(decode(list(tokens[:i]))) :] for i in range(len(tokens))
    ]


@functools.lru_cache(maxsize=None)
def tokenizer_of():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def parse_vllm_metrics(metrics_url: str, model: str) -> dict:
    """vllm_backend's ``parse_vllm_metrics`` for one model's series: the last value seen per
    name (so ``<histogram>_bucket`` is its +Inf bucket), labels dropped but ``finished_reason``
    (``vllm:request_success_total{finished_reason="length"}``)."""
    values = {}
    for s in scrape(metrics_url):
        if s.name.startswith("vllm:") and s.labels.get("model") == model:
            reason = s.labels.get("finished_reason")
            values[s.name + (f'{{finished_reason="{reason}"}}' if reason else "")] = float(s.value)
    return values
