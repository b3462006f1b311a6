"""Triton vLLM backend's own CI tests, ported to ``backend: "slipstream"`` on a real tritonserver.

Each test names the upstream test it ports (triton-inference-server/vllm_backend ``ci/``):
``L0_backend_vllm`` (vllm_backend, accuracy, enabled_stream, request_cancellation, metrics),
``L0_additional_outputs_vllm``, ``L0_check_health_vllm`` and what applies of
``L0_multi_gpu_vllm/multi_lora``. Model directories have vllm_backend's layout (config.pbtxt
with the backend name and ``1/model.json``); the served model is the tiny random llama, so the
expected texts are Hugging Face greedy decoding of that model instead of upstream's OPT-125m
strings. One server per module, explicit model control (as upstream runs these): the models
the tests share load at start, in parallel; the load / unload tests load their own.
"""

import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import numpy as np
import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.scrape import matching, scrape  # noqa: E402
from support import http_generate, need_tritonserver, tiny_model_dir  # noqa: E402
from vllm_backend_support import (  # noqa: E402
    FAILING_HEALTH_MODEL_PY,
    SAMPLING_PARAMETERS,
    VLLM_DEFAULT_MAX_TOKENS,
    bool_input,
    create_vllm_request,
    hf_completion,
    hf_stream_pieces,
    parse_vllm_metrics,
    stream_requests,
    tokenizer_of,
    write_model,
)

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

PROMPTS = ["The most dangerous animal is", "The capital of France is", "The future of AI is"]
MODEL = "vllm_opt"
# Each model is a backend stub process: they are few, and shared where the features are apart
# (vllm_metrics also has the health check on: upstream's health_check_enabled configuration).
STARTUP_MODELS = [
    MODEL,
    "vllm_metrics",
    "vllm_metrics_false",
    "vllm_log_stats_off",
    "vllm_failing_unchecked",
    "vllm_failing_checked",
]
ADD_SUB_MODEL_PY = """
import numpy as np
import triton_python_backend_utils as pb_utils


class TritonPythonModel:
    def execute(self, requests):
        responses = []
        for request in requests:
            a = pb_utils.get_input_tensor_by_name(request, "INPUT0").as_numpy()
            b = pb_utils.get_input_tensor_by_name(request, "INPUT1").as_numpy()
            responses.append(pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor("OUTPUT0", a + b), pb_utils.Tensor("OUTPUT1", a - b)]))
        return responses
"""
ADD_SUB_CONFIG = """name: "add_sub"
backend: "python"
input [{ name: "INPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
       { name: "INPUT1" data_type: TYPE_FP32 dims: [ 4 ] }]
output [{ name: "OUTPUT0" data_type: TYPE_FP32 dims: [ 4 ] },
        { name: "OUTPUT1" data_type: TYPE_FP32 dims: [ 4 ] }]
instance_group [{ kind: KIND_CPU }]
"""
# vllm_backend's ci/L0_backend_vllm/vllm_backend/ensemble_config.pbtxt
ENSEMBLE_CONFIG = """name: "ensemble_model"
platform: "ensemble"
max_batch_size: 1
input [{ name: "text_input" data_type: TYPE_STRING dims: [ -1 ] }]
output [{ name: "text_output" data_type: TYPE_STRING dims: [ -1 ] }]
ensemble_scheduling { step [{ model_name: "vllm_opt" model_version: -1
  input_map { key: "text_input" value: "text_input" }
  output_map { key: "text_output" value: "text_output" } }] }
"""


# ------------------------------------------------------------------------------- fixtures
def build_repository(repo):
    on = {"REPORT_CUSTOM_METRICS": "true"}
    write_model(repo, MODEL)  # the sample as shipped: no REPORT_CUSTOM_METRICS
    # vllm_backend's multi-LoRA CI model.json carries lora_extra_vocab_size (removed from
    # vLLM): it loads, with a warning, instead of failing as an unknown key.
    write_model(repo, "vllm_load_test", model_json={"lora_extra_vocab_size": 256})
    write_model(repo, "vllm_invalid_1", model_json={"invalid_attribute": True})
    write_model(repo, "vllm_invalid_2", model_json={"model": "invalid_model"})
    write_model(repo, "vllm_metrics", parameters={**on, "ENABLE_VLLM_HEALTH_CHECK": "true"})
    write_model(repo, "vllm_metrics_false", parameters={"REPORT_CUSTOM_METRICS": "false"})
    write_model(repo, "vllm_log_stats_off", parameters=on, model_json={"disable_log_stats": True})
    for name, check in (("vllm_failing_unchecked", None), ("vllm_failing_checked", "true")):
        write_model(
            repo,
            name,
            backend="python",
            model_py=FAILING_HEALTH_MODEL_PY,
            parameters={"ENABLE_VLLM_HEALTH_CHECK": check} if check else None,
        )
    (repo / "add_sub" / "1").mkdir(parents=True)
    (repo / "add_sub" / "config.pbtxt").write_text(ADD_SUB_CONFIG)
    (repo / "add_sub" / "1" / "model.py").write_text(ADD_SUB_MODEL_PY)
    (repo / "ensemble_model" / "1").mkdir(parents=True)
    (repo / "ensemble_model" / "config.pbtxt").write_text(ENSEMBLE_CONFIG)
    return repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return build_repository(tmp_path_factory.mktemp("vllm_repo"))


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    loads = [f"--load-model={name}" for name in STARTUP_MODELS]
    # vllm_backend's own tests load and unload models over the API: opened on purpose
    with TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        models=STARTUP_MODELS,
        startup_timeout=600,
        open_model_control=True,
        extra_args=["--model-control-mode=explicit", *loads],
    ) as srv:
        yield srv


@pytest.fixture
def client(server):
    with grpcclient.InferenceServerClient(server.grpc_url) as c:
        yield c


def results_of(responses):
    for result, error in responses:
        assert error is None, str(error)
    return [result for result, _ in responses]


def vllm_texts(
    server,
    prompts,
    sampling=SAMPLING_PARAMETERS,
    stream=False,
    model=MODEL,
    as_tensor=True,
    exclude_input_in_output=None,
):
    """vllm_backend's ``_test_vllm_model``: one request per prompt on one stream."""
    requests = [
        create_vllm_request(p, i, stream, sampling, as_tensor, exclude_input_in_output)
        for i, p in enumerate(prompts)
    ]
    results = results_of(stream_requests(server.grpc_url, model, requests))
    by_id = {r.get_response().id: r.as_numpy("text_output")[0] for r in results}
    return [by_id[str(i)] for i in range(len(prompts))]


def wait_for(predicate, timeout=15.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


# ------------------------------------------------ L0_backend_vllm/vllm_backend (6 tests)
def test_vllm_triton_backend_load_unload_beside_python_and_ensemble(server, client):
    """vllm_backend_test.py::test_vllm_triton_backend."""
    client.load_model("vllm_load_test")
    assert client.is_model_ready("vllm_load_test")
    client.load_model("add_sub")
    assert client.is_model_ready("add_sub")
    client.load_model("ensemble_model")  # a slipstream model as an ensemble step
    assert client.is_model_ready("ensemble_model")
    client.unload_model("ensemble_model")
    client.unload_model("vllm_load_test")
    assert wait_for(lambda: not client.is_model_ready("vllm_load_test"))
    a, b = np.random.rand(4).astype(np.float32), np.random.rand(4).astype(np.float32)
    inputs = [
        grpcclient.InferInput("INPUT0", [4], "FP32"),
        grpcclient.InferInput("INPUT1", [4], "FP32"),
    ]
    inputs[0].set_data_from_numpy(a)
    inputs[1].set_data_from_numpy(b)
    result = client.infer("add_sub", inputs)
    assert np.allclose(result.as_numpy("OUTPUT0"), a + b)
    assert np.allclose(result.as_numpy("OUTPUT1"), a - b)
    client.load_model("vllm_load_test")
    assert client.is_model_ready("vllm_load_test")
    client.unload_model("add_sub")
    assert wait_for(lambda: not client.is_model_ready("add_sub"))
    expected = [(p + hf_completion(p)[1]).encode() for p in PROMPTS]
    for as_tensor in (True, False):  # sampling parameters as a tensor, then as parameters
        assert vllm_texts(server, PROMPTS, model="vllm_load_test", as_tensor=as_tensor) == expected
    client.unload_model("vllm_load_test")
    assert wait_for(lambda: not client.is_model_ready("vllm_load_test"))


@pytest.mark.parametrize(
    "model, message",
    [
        ("vllm_invalid_1", "invalid_attribute"),  # test_model_with_invalid_attributes
        ("vllm_invalid_2", "'invalid_model' not found"),  # test_vllm_invalid_model_name
    ],
)
def test_model_json_that_cannot_be_served_fails_the_load(client, model, message):
    with pytest.raises(InferenceServerException) as err:
        client.load_model(model)
    assert message in str(err.value)
    assert not client.is_model_ready(model)


@pytest.mark.parametrize("exclude", [None, False, True])
def test_exclude_input_in_output_non_streaming(server, exclude):
    """test_exclude_input_in_output_default / _false / _true: the prompt is prepended unless
    exclude_input_in_output is true."""
    prompt = PROMPTS[1]
    text = hf_completion(prompt)[1]
    expected = text if exclude else prompt + text
    assert vllm_texts(server, [prompt], exclude_input_in_output=exclude) == [expected.encode()]


# ------------------------------------------------ L0_backend_vllm/accuracy_test (2 tests)
def test_accuracy_greedy_matches_hugging_face(server):
    """accuracy_test.py::test_vllm_model (baseline: HF greedy instead of vLLM offline)."""
    sampling = {"temperature": 0, "top_p": 1}
    assert vllm_texts(server, PROMPTS, sampling) == [
        (p + hf_completion(p)[1]).encode() for p in PROMPTS
    ]


def test_structured_outputs_choice_answers_one_of_the_choices(server):
    """accuracy_test.py::test_structured_outputs (its request: the choice spec as a JSON
    string in sampling_parameters; the baseline: the answer is one of the choices, whatever
    the random model prefers)."""
    prompt = "Classify intent of the sentence: Harry Potter is underrated. "
    sampling = {
        **SAMPLING_PARAMETERS,
        "structured_outputs": json.dumps({"choice": ["Positive", "Negative"]}),
    }
    request = create_vllm_request(prompt, 0, False, sampling)
    [(result, error)] = stream_requests(server.grpc_url, MODEL, [request])
    assert error is None, error
    text = result.as_numpy("text_output")[0].decode()
    assert text in (prompt + "Positive", prompt + "Negative")


# ------------------------------------------------ L0_backend_vllm/enabled_stream (3 tests)
def test_enabled_stream_several_prompts(server):
    """enabled_stream_test.py::test_vllm_model_enabled_stream."""
    prompts = [PROMPTS[0], PROMPTS[2]]
    requests = [create_vllm_request(p, i, True, SAMPLING_PARAMETERS) for i, p in enumerate(prompts)]
    results = results_of(stream_requests(server.grpc_url, MODEL, requests))
    for i, prompt in enumerate(prompts):
        pieces = [
            r.as_numpy("text_output")[0].decode() for r in results if r.get_response().id == str(i)
        ]
        assert "".join(pieces) == hf_completion(prompt)[1]


def test_enabled_stream_sends_each_token_without_the_prompt(server):
    """enabled_stream_test.py::test_vllm_model_enabled_stream_exclude_input_in_output_default:
    one response per generated token, each with that token's text."""
    prompt = PROMPTS[0]
    request = create_vllm_request(prompt, 0, True, SAMPLING_PARAMETERS)
    results = results_of(stream_requests(server.grpc_url, MODEL, [request]))
    pieces = [r.as_numpy("text_output")[0].decode() for r in results]
    assert pieces == hf_stream_pieces(prompt)
    assert len(pieces) == VLLM_DEFAULT_MAX_TOKENS


def test_enabled_stream_refuses_exclude_input_in_output_false(server):
    """enabled_stream_test.py::..._exclude_input_in_output_false: vLLM's exact message."""
    request = create_vllm_request(
        PROMPTS[0], 0, True, SAMPLING_PARAMETERS, exclude_input_in_output=False
    )
    [(result, error)] = stream_requests(server.grpc_url, MODEL, [request])
    assert result is None
    assert error.message() == (
        "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
    )


# ------------------------------------------------ L0_backend_vllm/request_cancellation (1)
def test_request_cancellation(server):
    """request_cancellation_test.py::test_request_cancellation: a long non-streaming request
    cancelled after a second ends with exactly one CANCELLED, and the server logs it."""
    # The module's model is the tiny test Llama (max_model_len 1024): it writes to the context's
    # end in ~0.75 s on a quiet two-core machine, so the cancel comes at 0.3 s (upstream waits a
    # second for a 1,500-token answer on a real model), past EOS and without repeats that n-gram
    # drafts would shorten.
    sampling = {"temperature": "1", "top_p": "1", "max_tokens": "1500", "ignore_eos": "true"}
    sampling.update(frequency_penalty="1.0", presence_penalty="1.0")
    got = []
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: got.append((result, error)))
    request = create_vllm_request(
        "Write an original and creative poem of at least 200 words.", "1", False, sampling
    )
    client.async_stream_infer(
        model_name=MODEL,
        inputs=request["inputs"],
        request_id=request["request_id"],
        outputs=request["outputs"],
        parameters=sampling,
    )
    time.sleep(0.3)
    client.stop_stream(cancel_requests=True)
    time.sleep(1)
    client.close()
    assert len(got) == 1
    result, error = got[0]
    assert result is None and isinstance(error, InferenceServerException)
    assert error.status() == "StatusCode.CANCELLED"
    assert wait_for(
        lambda: re.search(r"slipstream: request \S+ cancelled", server.log_tail(10**6)), timeout=10
    )
    assert "slipstream: cancelling request" in server.log_tail(10**6)


# ------------------------------------------------ L0_backend_vllm/metrics_test (5 runs)
def vllm_infer_twice(server, model, sampling=SAMPLING_PARAMETERS):
    """vllm_metrics_test.py::vllm_infer: every prompt, non-streaming, twice."""
    for _ in range(2):
        results = stream_requests(
            server.grpc_url,
            model,
            [create_vllm_request(p, i, False, sampling) for i, p in enumerate(PROMPTS)],
        )
        for result, error in results:
            assert error is None and result.as_numpy("text_output") is not None


def test_vllm_metrics(server):
    """vllm_metrics_test.py::test_vllm_metrics with REPORT_CUSTOM_METRICS true: exact token
    counts (whole prompts, as vLLM counts them, prefix-cache hits or not) and one
    time-per-output-token observation per token after the first. Upstream reads a fresh
    server; here the model is shared, so the counts are differences."""
    url = server.metrics_url
    before = parse_vllm_metrics(url, "vllm_metrics")
    vllm_infer_twice(server, "vllm_metrics")
    tokenizer = tokenizer_of()
    prompt_tokens = 2 * sum(len(tokenizer(p)["input_ids"]) for p in PROMPTS)
    generated = 2 * sum(len(hf_completion(p)[0]) for p in PROMPTS)
    requests = 2 * len(PROMPTS)
    expected = {
        "vllm:prompt_tokens_total": prompt_tokens,
        "vllm:generation_tokens_total": generated,
        "vllm:time_to_first_token_seconds_count": requests,
        "vllm:time_to_first_token_seconds_bucket": requests,
        "vllm:time_per_output_token_seconds_count": generated - requests,
        "vllm:time_per_output_token_seconds_bucket": generated - requests,
        "vllm:e2e_request_latency_seconds_count": requests,
        "vllm:e2e_request_latency_seconds_bucket": requests,
        "vllm:request_prompt_tokens_count": requests,
        "vllm:request_prompt_tokens_sum": prompt_tokens,
        "vllm:request_prompt_tokens_bucket": requests,
        "vllm:request_generation_tokens_count": requests,
        "vllm:request_generation_tokens_sum": generated,
        "vllm:request_generation_tokens_bucket": requests,
        'vllm:request_success_total{finished_reason="length"}': requests,
        'vllm:request_success_total{finished_reason="stop"}': 0,
    }

    def delta():
        now = parse_vllm_metrics(url, "vllm_metrics")
        return {k: v - before.get(k, 0) for k, v in now.items()}

    settled = wait_for(lambda: all(delta().get(k) == v for k, v in expected.items()))
    metrics = delta()
    assert settled, {k: (metrics.get(k), v) for k, v in expected.items() if metrics.get(k) != v}
    for name in (
        "time_to_first_token",
        "time_per_output_token",
        "e2e_request_latency",
        "request_queue_time",
        "request_prefill_time",
        "request_decode_time",
        "request_inference_time",
    ):
        assert metrics[f"vllm:{name}_seconds_count"] == (
            generated - requests if name == "time_per_output_token" else requests
        )
        assert metrics[f"vllm:{name}_seconds_sum"] > 0


def test_custom_sampling_params(server):
    """vllm_metrics_test.py::test_custom_sampling_params: n=2, temperature=1 requests fill the
    request_params_n histogram (with n itself), and each returns its 2 sequences."""
    before = parse_vllm_metrics(server.metrics_url, "vllm_metrics")
    requests = [
        create_vllm_request(p, i, False, {**SAMPLING_PARAMETERS, "n": "2", "temperature": "1"})
        for i, p in enumerate(PROMPTS)
    ]
    results = stream_requests(server.grpc_url, "vllm_metrics", requests)
    assert all(error is None for _, error in results)
    assert all(result.as_numpy("text_output").shape == (2,) for result, _ in results)
    count = before.get("vllm:request_params_n_count", 0) + len(PROMPTS)
    assert wait_for(
        lambda: (
            parse_vllm_metrics(server.metrics_url, "vllm_metrics").get(
                "vllm:request_params_n_count", 0
            )
            >= count
        )
    )
    metrics = parse_vllm_metrics(server.metrics_url, "vllm_metrics")
    assert metrics["vllm:request_params_n_sum"] - before.get(
        "vllm:request_params_n_sum", 0
    ) == 2 * len(PROMPTS)
    assert "vllm:request_params_n_bucket" in metrics


@pytest.mark.parametrize("model", ["vllm_metrics_false", "vllm_log_stats_off"])
def test_vllm_metrics_disabled(server, model):
    """vllm_metrics_test.py::test_vllm_metrics_disabled, two ways: REPORT_CUSTOM_METRICS
    "false", or model.json's disable_log_stats. (Absent, upstream's third way, means on under
    backend "slipstream": test_vllm_metrics_on_by_default.)"""
    vllm_infer_twice(server, model)
    time.sleep(0.5)  # what would be recorded has been
    assert parse_vllm_metrics(server.metrics_url, model) == {}


def test_vllm_metrics_on_by_default(server):
    """Under backend "slipstream" the vLLM series are exported without REPORT_CUSTOM_METRICS,
    labelled model_name as vLLM labels them, so the inference gateway reads them."""
    vllm_infer_twice(server, MODEL)
    labels = [s.labels for s in matching(scrape(server.metrics_url), "vllm:num_requests_waiting")]
    assert {"model": MODEL, "model_name": MODEL, "version": "1"} in labels


def test_vllm_metrics_refused(tmp_path):
    """vllm_metrics_test.py::test_vllm_metrics_refused: with --allow-metrics=false there is
    no metrics endpoint, and the model still loads and serves."""
    need_tritonserver()
    write_model(tmp_path, "vllm_metrics", parameters={"REPORT_CUSTOM_METRICS": "true"})
    with TritonServer(
        tmp_path,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        models=["vllm_metrics"],
        startup_timeout=300,
        extra_args=["--allow-metrics=false"],
    ) as srv:
        vllm_infer_twice(srv, "vllm_metrics")
        with pytest.raises(urllib.error.URLError):
            parse_vllm_metrics(srv.metrics_url, "vllm_metrics")


# ------------------------------------------------ L0_additional_outputs_vllm (1 test)
ADDITIONAL = [  # stream, finish_reason, cumulative_logprob, logprobs, return_logprobs, in, out
    *[(s, True, True, lp, True, True, True) for s in (True, False) for lp in (None, 0, 2)],
    *[(s, False, False, 2, False, False, False) for s in (True, False)],
    *[(s, None, None, None, None, None, None) for s in (True, False)],
    (True, True, None, 2, False, True, None),
    (False, False, True, 0, True, None, True),
    (True, None, False, 2, True, False, True),
]


@pytest.mark.parametrize(
    "stream, finish_reason, cumulative_logprob, logprobs, return_logprobs, "
    "num_input_tokens, num_output_tokens",
    ADDITIONAL,
)
def test_additional_outputs(
    server,
    stream,
    finish_reason,
    cumulative_logprob,
    logprobs,
    return_logprobs,
    num_input_tokens,
    num_output_tokens,
):
    """additional_outputs_test.py::test_additional_outputs (upstream crosses every option, 1458
    cases; these cover each value of each option, alone and together)."""
    prompt = PROMPTS[0]
    sampling = dict(SAMPLING_PARAMETERS, **({} if logprobs is None else {"logprobs": logprobs}))
    inputs = create_vllm_request(prompt, 0, stream, sampling)["inputs"]
    flags = {
        "return_finish_reason": finish_reason,
        "return_cumulative_logprob": cumulative_logprob,
        "return_logprobs": return_logprobs,
        "return_num_input_tokens": num_input_tokens,
        "return_num_output_tokens": num_output_tokens,
    }
    inputs += [bool_input(name, value) for name, value in flags.items() if value is not None]
    responses = results_of(
        stream_requests(server.grpc_url, MODEL, [{"inputs": inputs, "parameters": sampling}])
    )
    assert responses
    text = "".join(r.as_numpy("text_output")[0].decode() for r in responses)
    assert text.count(" ") > 4, "output is not a sentence"
    previous_cumulative = 0.0
    for i, r in enumerate(responses):
        reason = r.as_numpy("finish_reason")
        if not finish_reason:
            assert reason is None
        else:
            assert reason[0].decode() == ("None" if i < len(responses) - 1 else "length")
        cumulative = r.as_numpy("cumulative_logprob")
        if not cumulative_logprob:
            assert cumulative is None
        else:
            assert float(cumulative[0]) != previous_cumulative
            previous_cumulative = float(cumulative[0])
        check_logprobs(r, prompt, stream, sampling, return_logprobs, num_output_tokens)
        count = r.as_numpy("num_input_tokens")
        if not num_input_tokens:
            assert count is None
        else:
            assert 0 < int(count) <= len(prompt)
        count = r.as_numpy("num_output_tokens")
        if not num_output_tokens:
            assert count is None
        else:
            assert int(count[0]) > 0


def check_logprobs(result, prompt, stream, sampling, return_logprobs, num_output_tokens):
    """additional_outputs_test.py::_assert_logprobs."""
    data = result.as_numpy("logprobs")
    if not return_logprobs:
        assert data is None
        return
    logprobs = json.loads(data[0].decode())
    if "logprobs" not in sampling:
        assert logprobs is None
        return
    assert isinstance(logprobs, list) and len(logprobs) >= 1
    if num_output_tokens:
        assert len(logprobs) == int(result.as_numpy("num_output_tokens")[0])
    decoded = ""
    for position in logprobs:
        assert 1 <= len(position) <= sampling["logprobs"] + 1
        ranks_one = [d for d in position.values() if d["rank"] == 1]
        for token_id, d in position.items():
            assert isinstance(token_id, str) and len(d) == 3
            assert isinstance(d["logprob"], float) and isinstance(d["rank"], int)
            assert isinstance(d["decoded_token"], str)
        assert len(ranks_one) == 1
        decoded += ranks_one[0]["decoded_token"]
    text = result.as_numpy("text_output")[0].decode()
    assert (decoded if stream else prompt + decoded) == text


# ------------------------------------------------ L0_check_health_vllm (6 runs)
def check_health_infer(server, model):
    request = create_vllm_request(PROMPTS[0], 0, True, SAMPLING_PARAMETERS)
    return stream_requests(server.grpc_url, model, [request])


def assert_text_output_valid(responses):
    text = "".join(r.as_numpy("text_output")[0].decode() for r in results_of(responses))
    assert len(text) > 0 and text.count(" ") > 4


def assert_model_ready(client, model, expected):
    assert client.is_model_ready(model) == expected
    states = [
        m.state == "READY" for m in client.get_model_repository_index().models if m.name == model
    ]
    assert states == [expected]


@pytest.mark.parametrize("model", [MODEL, "vllm_metrics", "vllm_failing_unchecked"])
def test_vllm_is_healthy(server, client, model):
    """check_health_test.py::test_vllm_is_healthy: health check unspecified / enabled on a
    sound engine; unspecified on an engine whose check would fail (it is never asked). The
    explicit "false" reads as unspecified (test_model_config)."""
    for _ in range(3):
        assert_model_ready(client, model, True)
        assert_text_output_valid(check_health_infer(server, model))
    assert_model_ready(client, model, True)


def test_vllm_not_healthy(server, client):
    """check_health_test.py::test_vllm_not_healthy: the first failed check unloads the model;
    its requests get vLLM's UNAVAILABLE text, later ones Triton's unknown-model error."""
    model = "vllm_failing_checked"
    assert_model_ready(client, model, True)
    assert_text_output_valid(check_health_infer(server, model))
    assert_model_ready(client, model, True)
    [(result, error)] = check_health_infer(server, model)
    assert result is None and str(error) == "Model is unavailable due to unhealthy vLLM engine"
    assert wait_for(lambda: not client.is_model_ready(model))
    assert_model_ready(client, model, False)
    [(result, error)] = check_health_infer(server, model)
    assert result is None
    assert str(error) == f"Request for unknown model: '{model}' has no available versions"
    assert_model_ready(client, model, False)


# ------------------------------------------------ L0_multi_gpu_vllm/multi_lora (LoRA off)
def test_lora_name_without_lora_is_refused_over_grpc_and_http(server):
    """multi_lora_test.py with SERVER_ENABLE_LORA=false, and test.sh's generate-endpoint
    checks with LoRA disabled: exactly "LoRA feature is not enabled."."""
    prompt = "Instruct: What do you think of Computer Science?\nOutput:"
    request = create_vllm_request(
        prompt, 0, False, {**SAMPLING_PARAMETERS, "lora_name": "doll"}, exclude_input_in_output=True
    )
    [(result, error)] = stream_requests(server.grpc_url, MODEL, [request])
    assert result is None and error.message() == "LoRA feature is not enabled."
    status, body = http_generate(
        server,
        MODEL,
        {
            "text_input": prompt,
            "parameters": {
                "stream": False,
                "temperature": 0,
                "top_p": 1,
                "lora_name": "doll",
                "exclude_input_in_output": True,
            },
        },
    )
    assert status == 400 and body == {"error": "LoRA feature is not enabled."}


# ------------------------------------------------ beyond upstream's CI
def test_auto_completed_config_matches_vllm_backend(server):
    """A model directory with only the backend name gets vLLM backend's inputs and outputs."""
    with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{MODEL}/config") as r:
        config = json.loads(r.read())
    inputs = {i["name"]: i["data_type"] for i in config["input"]}
    outputs = {o["name"]: (o["data_type"], o["dims"]) for o in config["output"]}
    assert {
        "text_input",
        "image",
        "stream",
        "sampling_parameters",
        "exclude_input_in_output",
        "return_finish_reason",
        "return_cumulative_logprob",
        "return_logprobs",
        "return_num_input_tokens",
        "return_num_output_tokens",
        "embedding_request",
    } <= set(inputs)
    upstream = {
        "text_output": ("TYPE_STRING", [-1]),
        "finish_reason": ("TYPE_STRING", [-1]),
        "cumulative_logprob": ("TYPE_FP32", [-1]),
        "logprobs": ("TYPE_STRING", [-1]),
        "num_input_tokens": ("TYPE_UINT32", [1]),
        "num_output_tokens": ("TYPE_UINT32", [-1]),
    }
    assert {name: outputs[name] for name in upstream} == upstream
    # The one addition: prompt_logprobs (vLLM computes them; vllm_backend has no output for them).
    assert {k: v for k, v in outputs.items() if k not in upstream} == {
        "prompt_logprobs": ("TYPE_STRING", [-1])
    }
    assert config["model_transaction_policy"]["decoupled"] and config["max_batch_size"] == 0


@pytest.mark.parametrize(
    "name, value, message",
    [
        (
            "embedding_request",
            json.dumps({"input": "hi", "pooling_params": {"dimensions": [8]}}),
            f'Error generating stream: Model "{MODEL}" does not support matryoshka',
        ),
        ("embedding_request", "{not json", "input 'embedding_request' is not valid JSON"),
        ("image", "aGk=", "input 'image' is not supported"),
    ],
)
def test_inputs_for_other_tasks_are_refused_alone(server, name, value, message):
    request = create_vllm_request(PROMPTS[0], 0, False, SAMPLING_PARAMETERS)
    extra = grpcclient.InferInput(name, [1], "BYTES")
    extra.set_data_from_numpy(np.array([value.encode()], dtype=np.object_))
    request["inputs"].append(extra)
    good = create_vllm_request(PROMPTS[1], 1, False, SAMPLING_PARAMETERS)
    responses = stream_requests(server.grpc_url, MODEL, [request, good])
    errors = [str(e) for r, e in responses if e is not None]
    texts = [r.as_numpy("text_output")[0] for r, e in responses if e is None]
    assert len(errors) == 1 and message in errors[0]
    assert texts == [(PROMPTS[1] + hf_completion(PROMPTS[1])[1]).encode()]


def embedding_inputs(body: dict) -> dict:
    """A pooling request as Triton's OpenAI frontend sends one to a vLLM model."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        grpcclient.InferInput("embedding_request", [1], "BYTES"),
        bool_input("return_num_input_tokens", True),
        bool_input("return_num_output_tokens", True),
    ]
    inputs[0].set_data_from_numpy(np.array([b""], dtype=np.object_))
    inputs[1].set_data_from_numpy(np.array([json.dumps(body).encode()], dtype=np.object_))
    return {"inputs": inputs}


@pytest.mark.parametrize("pooling", ["LAST", "MEAN"])
def test_an_embedding_request_gets_the_pooled_hidden_states_beside_generation(server, pooling):
    """Before: refused ("does not support 'embed' request"). The vector is the tiny model's
    last-layer hidden states (transformers' base model) pooled and normalised; a generation
    on the same stream is served as usual."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = str(tiny_model_dir("llama"))
    text = PROMPTS[1]
    ids = AutoTokenizer.from_pretrained(path)(text)["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    pooled = hidden[-1] if pooling == "LAST" else hidden.mean(0)
    expected = torch.nn.functional.normalize(pooled, dim=0)
    body = {"input": text, "pooling_params": {"pooling_type": pooling}}
    good = create_vllm_request(PROMPTS[0], 1, False, SAMPLING_PARAMETERS)
    responses = stream_requests(server.grpc_url, MODEL, [embedding_inputs(body), good])
    assert all(e is None for _, e in responses), responses
    vectors = [r for r, _ in responses if r.as_numpy("text_output")[0].startswith(b"[")]
    assert len(vectors) == 1
    got = torch.tensor(json.loads(vectors[0].as_numpy("text_output")[0]))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert int(vectors[0].as_numpy("num_input_tokens")) == len(ids)
    assert list(vectors[0].as_numpy("num_output_tokens")) == [0]
    texts = [r.as_numpy("text_output")[0] for r, _ in responses if r is not vectors[0]]
    assert texts == [(PROMPTS[0] + hf_completion(PROMPTS[0])[1]).encode()]


def openai_frontend_request(prompt, stream, sampling):
    """The inputs Triton's OpenAI frontend builds for a vLLM-format model
    (``_create_vllm_generate_request`` in server/python/openai/openai_frontend)."""
    inputs = [
        grpcclient.InferInput("text_input", [1], "BYTES"),
        bool_input("stream", stream),
        bool_input("exclude_input_in_output", True),
        grpcclient.InferInput("sampling_parameters", [1], "BYTES"),
        bool_input("return_logprobs", "logprobs" in sampling),
        bool_input("return_num_input_tokens", True),
        bool_input("return_num_output_tokens", True),
    ]
    inputs[0].set_data_from_numpy(np.array([prompt.encode()], dtype=np.object_))
    inputs[3].set_data_from_numpy(np.array([json.dumps(sampling).encode()], dtype=np.object_))
    return {"inputs": inputs}


@pytest.mark.parametrize("stream", [False, True])
def test_openai_frontend_request_shape_gives_usage_and_logprobs(server, stream):
    """What the frontend sends for a chat completion with logprobs and top_logprobs=2 (its
    pydantic defaults included), and what it reads back: text, usage from the UINT32 counts,
    per-token logprobs whose rank-1 entry is the chosen token."""
    prompt = PROMPTS[2]
    sampling = {
        "frequency_penalty": 0.0,
        "n": 1,
        "presence_penalty": 0.0,
        "temperature": 0.0,
        "top_p": 1.0,
        "max_tokens": 8,
        "logprobs": 2,
    }
    results = results_of(
        stream_requests(server.grpc_url, MODEL, [openai_frontend_request(prompt, stream, sampling)])
    )
    assert len(results) == (8 if stream else 1)
    tokens, text = hf_completion(prompt, 8)
    assert "".join(r.as_numpy("text_output")[0].decode() for r in results) == text
    usage = [
        (int(r.as_numpy("num_input_tokens")), int(r.as_numpy("num_output_tokens")[0]))
        for r in results
    ]
    assert {u[0] for u in usage} == {len(tokenizer_of()(prompt)["input_ids"])}
    assert sum(u[1] for u in usage) == len(tokens)
    chosen = []
    for r in results:
        for position in json.loads(r.as_numpy("logprobs")[0]):
            ranked = sorted(position.items(), key=lambda item: item[1]["rank"])
            chosen.append(int(ranked[0][0]))
            assert len(position) <= 3
    assert chosen == list(tokens)


def serve_cli(*args, timeout=600):
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        *args,
    ]
    return subprocess.run(
        cmd, capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL
    )


def test_serve_cli_serves_an_unchanged_vllm_repository_with_the_alias(tmp_path):
    """A repository written for Triton's vLLM backend, backend "vllm" left as it is:
    `slipstream serve --vllm-alias` installs the slipstream backend under that name."""
    need_tritonserver()
    write_model(tmp_path, "vllm_model", backend="vllm")
    refused = serve_cli("--model-repository", str(tmp_path), "--exit-after-prompt")
    assert refused.returncode != 0 and "--vllm-alias" in refused.stderr + refused.stdout
    proc = serve_cli(
        "--model-repository",
        str(tmp_path),
        "--vllm-alias",
        "--prompt",
        PROMPTS[1],
        "--raw-prompt",
        "--max-tokens",
        "16",
        "--exit-after-prompt",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "vllm_model" in proc.stdout
    assert hf_completion(PROMPTS[1])[1] in proc.stdout.split(PROMPTS[1], 1)[1]


def test_exported_metric_names_follow_prometheus_conventions(server):
    """What promtool checks: a counter's name ends in _total, nothing else's does (the engine's
    KV pool size was once a gauge called slipstream_kv_blocks_total)."""
    vllm_infer_twice(server, "vllm_metrics")
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    # The # TYPE lines as written: prometheus_client's parser names a counter's samples
    # <name>_total whatever the exposition said, which would hide the fault looked for here.
    kinds = dict(re.findall(r"^# TYPE ((?:slipstream_|vllm:)\S+) (\w+)$", text, re.MULTILINE))
    assert {
        "slipstream_kv_blocks_capacity",
        "vllm:kv_cache_usage_perc",
        "vllm:request_success_total",
        "vllm:time_per_output_token_seconds",
    } <= set(kinds)
    wrong = {
        name: kind
        for name, kind in kinds.items()
        if (kind == "counter") != name.endswith("_total")
        or (kind != "counter" and re.search(r"_(count|sum|bucket)$", name))
    }
    assert wrong == {}
