"""Multi-LoRA through a real tritonserver, configured as vllm_backend users do it: ``1/model.json``
with ``enable_lora``, ``max_loras``, ``max_lora_rank`` and ``1/multi_lora.json`` naming PEFT
adapter directories (relative paths). Ports ``L0_multi_gpu_vllm/multi_lora`` (its error texts
and the generate-endpoint checks of its test.sh); the expected texts are the PEFT-merged tiny
model's greedy decoding, each request run alone, while the server batches them together."""

import json
import os
import shutil
import time

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.scrape import matching, scrape  # noqa: E402
from lora_support import adapter_dir, merged_greedy  # noqa: E402
from support import http_generate, need_tritonserver  # noqa: E402
from vllm_backend_support import (  # noqa: E402
    SAMPLING_PARAMETERS,
    create_vllm_request,
    stream_requests,
    tokenizer_of,
    write_model,
)

pytestmark = [
    pytest.mark.server,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

MODEL = "vllm_llama_multi_lora"
PROMPTS = [
    "Instruct: What do you think of Computer Science?\nOutput:",
    "Instruct: Tell me more about soccer\nOutput:",
]
NAMES = [None, "doll", "sheep"]
MAX_TOKENS = 8
UNKNOWN = "LoRA {} is not supported, we currently support ['doll', 'sheep']"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    need_tritonserver()
    repo = tmp_path_factory.mktemp("lora_repo")
    model_dir = write_model(
        repo,
        MODEL,
        parameters={"REPORT_CUSTOM_METRICS": "true"},
        model_json={"enable_lora": True, "max_loras": 2, "max_lora_rank": 16, "block_size": 16},
    )
    for name in ("doll", "sheep"):
        shutil.copytree(adapter_dir(name), model_dir / "1" / "loras" / name)
    (model_dir / "1" / "multi_lora.json").write_text(
        json.dumps({"doll": "./loras/doll", "sheep": "./loras/sheep"})
    )
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=[MODEL], startup_timeout=600
    ) as srv:
        yield srv


def expected_text(name, prompt: str) -> str:
    tokenizer = tokenizer_of()
    tokens = merged_greedy(name, tokenizer(prompt)["input_ids"], MAX_TOKENS)
    return tokenizer.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def lora_request(prompt: str, request_id, name, **extra) -> dict:
    sampling = {**SAMPLING_PARAMETERS, "max_tokens": MAX_TOKENS, "ignore_eos": True, **extra}
    request = create_vllm_request(
        prompt,
        request_id,
        False,
        {**sampling, **({"lora_name": name} if name else {})},
        exclude_input_in_output=True,
    )
    request["parameters"] = sampling  # as multi_lora_test.py sends them: without lora_name
    return request


def test_requests_on_two_adapters_and_the_base_model_batched_together_match_merged_models(server):
    """multi_lora_test.py::test_multi_lora_requests, with every request on one stream at once
    (so the engine runs them in the same steps) and the base model beside the adapters."""
    jobs = [(name, prompt) for prompt in PROMPTS for name in NAMES]
    requests = [lora_request(prompt, i, name) for i, (name, prompt) in enumerate(jobs)]
    responses = stream_requests(server.grpc_url, MODEL, requests)
    assert all(error is None for _, error in responses), [str(e) for _, e in responses]
    texts = {r.get_response().id: r.as_numpy("text_output")[0].decode() for r, _ in responses}
    expected = [expected_text(name, prompt) for name, prompt in jobs]
    assert [texts[str(i)] for i in range(len(jobs))] == expected
    assert len(set(expected[:3])) == 3  # the adapters really change the answer


def test_unknown_lora_gets_vllm_backends_error_over_grpc_and_http(server):
    """multi_lora_test.py::test_none_exist_lora and test.sh's generate-endpoint checks."""
    prompt = "Instruct: What is the capital city of France?\nOutput:"
    [(result, error)] = stream_requests(
        server.grpc_url, MODEL, [lora_request(prompt, 0, "bactrian")]
    )
    assert result is None and error.message() == UNKNOWN.format("bactrian")
    status, body = http_generate(
        server,
        MODEL,
        {
            "text_input": PROMPTS[1],
            "parameters": {
                "stream": False,
                "temperature": 0,
                "top_p": 1,
                "lora_name": "unavailable",
                "exclude_input_in_output": True,
            },
        },
    )
    assert status == 400 and body == {"error": UNKNOWN.format("unavailable")}
    status, body = http_generate(
        server,
        MODEL,
        {
            "text_input": PROMPTS[1],
            "parameters": {
                "stream": False,
                "temperature": 0,
                "top_p": 1,
                "lora_name": "sheep",
                "max_tokens": 8,
                "ignore_eos": True,
                "exclude_input_in_output": True,
            },
        },
    )
    assert status == 200 and body["text_output"] == expected_text("sheep", PROMPTS[1])


def current_lora_info(server) -> str:
    """The labels of the newest vllm:lora_requests_info series (its value is when it was
    current, which is how vLLM's readers pick it)."""
    series = matching(scrape(server.metrics_url), "vllm:lora_requests_info")
    newest = max(series, key=lambda s: s.value)
    return ",".join(f'{k}="{v}"' for k, v in sorted(newest.labels.items()))


def test_lora_requests_info_reports_max_lora_and_the_running_adapter(server):
    assert 'max_lora="2"' in current_lora_info(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: None)
    request = lora_request(PROMPTS[0], "long", "doll", max_tokens=900)
    client.async_stream_infer(
        model_name=MODEL,
        inputs=request["inputs"],
        request_id="long",
        parameters=request["parameters"],
    )
    seen, deadline = "", time.monotonic() + 60
    while time.monotonic() < deadline and 'running_lora_adapters="doll"' not in seen:
        seen = current_lora_info(server)
        time.sleep(0.05)
    client.stop_stream()  # waits for the request to finish
    client.close()
    assert 'running_lora_adapters="doll"' in seen and 'max_lora="2"' in seen, seen
    deadline = time.monotonic() + 10
    while 'running_lora_adapters=""' not in seen and time.monotonic() < deadline:
        seen = current_lora_info(server)
        time.sleep(0.05)
    assert 'running_lora_adapters=""' in seen, seen
