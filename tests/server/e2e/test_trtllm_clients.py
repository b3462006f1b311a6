"""TensorRT-LLM clients against a real tritonserver, unchanged: requests and assertions ported
from tensorrtllm_backend (``inflight_batcher_llm/client/end_to_end_grpc_client.py``,
``tools/inflight_batcher_llm/end_to_end_test.py``, ``test_max_queue_size.py``, the README's
``generate`` curl, ``ci/L0_backend_trtllm`` metrics tests) and genai-perf's ``tensorrtllm``
request shape.

One server for the module, on one repository holding the sample configs
(``samples/trtllm_model_repository`` and ``samples/trtllm_streaming_model_repository``) with the
tiny random llama: ``ensemble`` (non-decoupled, max_batch_size 64), ``ensemble_stream``
(decoupled), ``ensemble_queue`` (decoupled, one running request and a queue of one) and
``unbatched`` (the Python-backend layout, ``max_batch_size: 0``). Expected texts come from an
in-process engine on the same model and settings, greedy (TRT-LLM's default sampling).
"""

import json
import queue
import re
import shutil
import time
import urllib.request
from functools import partial

import numpy as np
import pytest
import torch

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")

from tritonclient.utils import InferenceServerException  # noqa: E402

from slipstream import EngineConfig, SamplingParams  # noqa: E402
from slipstream.engine.loop import EngineLoop  # noqa: E402
from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.server.launch.scrape import parse_samples, sample_value  # noqa: E402
from server_support import http_post  # noqa: E402
from support import ROOT, need_tritonserver, reference_model, tiny_model_dir  # noqa: E402
from trtllm_support import SAMPLES, prepare_inputs, prepare_tensor  # noqa: E402

pytestmark = pytest.mark.server

ENGINE = {"kv_cache_memory_bytes": 8 * 1024 * 1024, "max_model_len": 1024, "max_num_seqs": 32}
SERVER = {"metrics_interval_ms": 50}
PER_MODEL = {"ensemble_queue": {"max_num_seqs": 1, "max_queue_size": 1}}
PROMPTS = ["This is a test", "What is machine learning?", "The quick brown fox", "Once upon a time"]
OUTPUT_LEN = 10


# ------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    base = tmp_path_factory.mktemp("trtllm")
    repo = base / "repo"
    repo.mkdir()
    for name, sample in SAMPLES.items():
        rendered = render_model_repository(
            sample,
            base / f"render-{name}",
            {"model": str(tiny_model_dir("llama")), **ENGINE, **SERVER, **PER_MODEL.get(name, {})},
        )
        source = next(p for p in rendered.iterdir() if (p / "config.pbtxt").is_file())
        shutil.copytree(source, repo / name)
        config = repo / name / "config.pbtxt"  # the model is named by its directory
        config.write_text(re.sub(r'(?m)^name: ".*"$', "", config.read_text()))
    return repo


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, models=list(SAMPLES), startup_timeout=300
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def engine():
    loop = EngineLoop(
        EngineConfig.from_dict({"model": str(tiny_model_dir("llama")), **ENGINE})
    ).start()
    yield loop
    loop.shutdown()


@pytest.fixture(scope="module")
def reference(engine):
    """prompt, max_tokens -> the greedy continuation (text) the engine gives it alone."""
    cache = {}

    def get(prompt, max_tokens=OUTPUT_LEN, **extra):
        key = (prompt, max_tokens, tuple(sorted(extra.items())))
        if key not in cache:
            params = SamplingParams.from_dict({"temperature": 0, "max_tokens": max_tokens, **extra})
            cache[key] = engine.generate(prompt, params)
        return cache[key]

    return get


# ------------------------------------------------------------------------------- helpers
def stream_request(server, model, inputs, outputs=None, timeout=120):
    """end_to_end_grpc_client.py's run_inference: one request on a stream, stop_stream waits
    for the server to close it; every result or error the callback got."""
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer(
        model,
        [prepare_tensor(k, v) for k, v in inputs.items()],
        outputs=[grpcclient.InferRequestedOutput(n) for n in outputs or []] or None,
        request_id="1",
    )
    client.stop_stream()
    client.close()
    out = []
    while not results.empty():
        out.append(results.get())
    return out


def batch(inputs_list):
    """--batch-inputs: each tensor stacked on the batch dimension."""
    return {k: np.concatenate([i[k] for i in inputs_list], axis=0) for k in inputs_list[0]}


def greedy_text(reference, prompt, n=OUTPUT_LEN, **extra):
    return reference(prompt, n, **extra).text


def metrics_text(server):
    return urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()


def metric(text, name, **labels):
    return sample_value(parse_samples(text), name, **labels)


# ------------------------------------------------------------------- end_to_end_grpc_client.py
def test_grpc_client_single_prompt_returns_prompt_and_greedy_text(server, reference):
    """`end_to_end_grpc_client.py -p "This is a test" -o 10` (beam_width 1, temperature 1.0:
    greedy, TRT-LLM's default without top_k/top_p): the prompt followed by the output."""
    results = stream_request(
        server, "ensemble", prepare_inputs(PROMPTS[0], OUTPUT_LEN), outputs=["text_output"]
    )
    assert len(results) == 1 and not isinstance(results[0], Exception), results
    assert results[0].as_numpy("text_output")[0].decode() == PROMPTS[0] + greedy_text(
        reference, PROMPTS[0]
    )


@pytest.mark.parametrize("model", ["ensemble", "ensemble_stream"])
def test_grpc_client_batch_inputs_answer_each_row_with_batch_index(server, reference, model):
    """`--batch-inputs` with a JSON list of prompts: one request [4, 1]; every row answered
    with its own text; decoupled: one response per row carrying ``batch_index``; not
    decoupled: one response with the rows stacked."""
    inputs = batch([prepare_inputs(p, OUTPUT_LEN) for p in PROMPTS])
    results = stream_request(server, model, inputs, outputs=["text_output", "batch_index"])
    assert not any(isinstance(r, Exception) for r in results), results
    got = {}
    for result in results:
        texts = result.as_numpy("text_output")
        indices = result.as_numpy("batch_index")
        assert indices.shape == (len(texts), 1)
        for text, index in zip(texts, indices[:, 0]):
            got[int(index)] = text.decode()
    assert len(results) == (len(PROMPTS) if model == "ensemble_stream" else 1)
    assert got == {i: p + greedy_text(reference, p) for i, p in enumerate(PROMPTS)}


def test_grpc_client_streaming_with_log_probs_end_and_pad_ids(server, reference, engine):
    """`-S --return-log-probs --end-id N --pad-id N` on the
    decoupled model: the streamed pieces add up to the output, ``output_log_probs`` has one
    value per token and their sum is ``cum_log_probs``; the end_id token's text is not
    emitted."""
    prompt = PROMPTS[1]
    tokens = reference(prompt, 12).token_ids
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    inputs = prepare_inputs(
        prompt, 12, streaming=True, return_log_probs=True, end_id=tokens[stop_at], pad_id=0
    )  # exclude_input_in_output False
    results = stream_request(
        server,
        "ensemble_stream",
        inputs,
        outputs=["text_output", "cum_log_probs", "output_log_probs"],
    )
    assert not any(isinstance(r, Exception) for r in results), results
    text = "".join(
        r.as_numpy("text_output")[0].decode()
        for r in results
        if r.as_numpy("text_output") is not None
    )
    assert text == greedy_text(reference, prompt, stop_at)  # the tokens before end_id
    log_probs = np.concatenate(
        [
            r.as_numpy("output_log_probs").reshape(-1)
            for r in results
            if r.as_numpy("output_log_probs") is not None
        ]
    )
    assert len(log_probs) == stop_at + 1  # end_id is generated, only its text is dropped
    final_cum = results[-1].as_numpy("cum_log_probs")
    assert final_cum.shape == (1, 1)
    assert final_cum[0, 0] == pytest.approx(float(log_probs.sum()), rel=1e-4, abs=1e-4)
    assert (log_probs <= 0).all()


def test_grpc_client_stop_and_bad_words(server, reference):
    """`--stop-words W --bad-words W`: generation stops before the stop word, and the banned
    word never appears."""
    prompt = PROMPTS[2]
    full = greedy_text(reference, prompt, 12)
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    results = stream_request(
        server,
        "ensemble",
        prepare_inputs(prompt, 12, stop_words=[stop], exclude_input_in_output=True),
        outputs=["text_output"],
    )
    text = results[0].as_numpy("text_output")[0].decode()
    assert stop not in text and full.startswith(text)
    first = _tokenizer().decode(reference(prompt, 12).token_ids[:1])  # the first token's text
    results = stream_request(
        server,
        "ensemble",
        prepare_inputs(prompt, 12, bad_words=[first], exclude_input_in_output=True),
        outputs=["text_output"],
    )
    assert not isinstance(results[0], Exception), results
    assert results[0].as_numpy("text_output")[0].decode() != full


def test_num_return_sequences_one_sets_sequence_index(server, reference):
    """`-n 1`: one sequence, ``sequence_index`` 0 (more need the engine's n > 1)."""
    results = stream_request(
        server,
        "ensemble_stream",
        prepare_inputs(PROMPTS[3], OUTPUT_LEN, num_return_sequences=1),
        outputs=["text_output", "sequence_index", "batch_index"],
    )
    assert len(results) == 1 and not isinstance(results[0], Exception), results
    assert results[0].as_numpy("sequence_index")[0][0] == 0
    assert results[0].as_numpy("batch_index")[0][0] == 0


def test_num_return_sequences_streams_each_sequence_with_its_sequence_index(server, reference):
    """`-n 3 --streaming`: every response carries one sequence (one ``text_output``) and its
    ``sequence_index``; greedy (TRT-LLM's default without top_k/top_p), so each of the three
    adds up to the greedy text. Without streaming it is a clear error."""
    results = stream_request(
        server,
        "ensemble_stream",
        prepare_inputs(PROMPTS[2], OUTPUT_LEN, streaming=True, num_return_sequences=3),
        outputs=["text_output", "sequence_index", "batch_index"],
    )
    assert not any(isinstance(r, Exception) for r in results), results
    texts = {}
    for r in results:
        out = r.as_numpy("text_output")
        assert out.shape == (1,)  # this sequence's piece alone, not all three
        index = int(r.as_numpy("sequence_index")[0][0])
        texts[index] = texts.get(index, "") + out[0].decode()
    assert sorted(texts) == [0, 1, 2]
    assert set(texts.values()) == {greedy_text(reference, PROMPTS[2])}


def test_num_return_sequences_without_streaming_answers_one_response_per_sequence(
    server, reference
):
    """`-n 3` without `--streaming` on the decoupled ensemble: TRT-LLM answers each sequence
    with its own complete response (prompt + text) and ``sequence_index``. The non-decoupled
    model, which has one response per request, refuses it by name."""
    results = stream_request(
        server,
        "ensemble_stream",
        prepare_inputs(PROMPTS[2], OUTPUT_LEN, num_return_sequences=3, return_log_probs=True),
        outputs=["text_output", "sequence_index", "batch_index", "cum_log_probs"],
    )
    assert not any(isinstance(r, Exception) for r in results), results
    assert sorted(int(r.as_numpy("sequence_index")[0][0]) for r in results) == [0, 1, 2]
    for r in results:
        assert r.as_numpy("text_output").shape == (1,)
        assert r.as_numpy("text_output")[0].decode() == PROMPTS[2] + greedy_text(
            reference, PROMPTS[2]
        )
        assert r.as_numpy("cum_log_probs").shape == (1, 1)
    [error] = stream_request(
        server, "ensemble", prepare_inputs(PROMPTS[2], OUTPUT_LEN, num_return_sequences=3)
    )
    assert isinstance(error, InferenceServerException) and "num_return_sequences" in str(error)


# ------------------------------------------------------------------------------- beam search
def hf_beam_texts(prompt, width, max_tokens):
    """Hugging Face's generate(num_beams=width, do_sample=False) on the same tiny model: the
    beams' texts, best first."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))
    model = reference_model(tiny_model_dir("llama"))
    ids = tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=max_tokens,
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            pad_token_id=0,
            attention_mask=torch.ones_like(ids),
        )
    return [tokenizer.decode(row[ids.shape[1] :], skip_special_tokens=True) for row in out]


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_beam_width_2_returns_every_beam_with_trtllm_shapes(server, protocol):
    """`end_to_end_grpc_client.py -b 2 --return-log-probs` as unary `infer`: one response with
    both beams (best first, each the prompt + the beam Hugging Face's beam search finds),
    ``cum_log_probs`` [1, 2] and ``output_log_probs`` [1, 2, T] per beam, sequence 0."""
    client_mod = httpclient if protocol == "http" else grpcclient
    client = client_mod.InferenceServerClient(
        server.http_url if protocol == "http" else server.grpc_url
    )
    inputs = prepare_inputs(
        PROMPTS[1], OUTPUT_LEN, beam_width=2, return_log_probs=True, exclude_input_in_output=None
    )
    del inputs["stream"]
    names = ["text_output", "cum_log_probs", "output_log_probs"]
    result = client.infer(
        "ensemble",
        [prepare_tensor(k, v, client_mod) for k, v in inputs.items()],
        outputs=[client_mod.InferRequestedOutput(n) for n in names],
    )
    texts = [t.decode() for t in result.as_numpy("text_output").reshape(-1)]
    assert texts == [PROMPTS[1] + t for t in hf_beam_texts(PROMPTS[1], 2, OUTPUT_LEN)]
    cum, per_token = result.as_numpy("cum_log_probs"), result.as_numpy("output_log_probs")
    assert cum.shape == (1, 2) and per_token.shape == (1, 2, OUTPUT_LEN)
    assert cum[0, 0] >= cum[0, 1]
    assert cum[0] == pytest.approx(per_token[0].sum(axis=-1), abs=1e-3)


def test_streamed_beam_search_sends_every_beam_after_each_round(server):
    """`-b 2 --streaming --return-log-probs` on the decoupled ensemble, as TRT-LLM streams
    beams: after each round a response with both beams' whole texts so far (no prompt) and
    their log probs, which the client's beam path overwrites; the last one holds the beams
    Hugging Face's beam search finds."""
    results = stream_request(
        server,
        "ensemble_stream",
        prepare_inputs(PROMPTS[1], OUTPUT_LEN, streaming=True, beam_width=2, return_log_probs=True),
        outputs=["text_output", "sequence_index", "cum_log_probs", "output_log_probs"],
    )
    assert not any(isinstance(r, Exception) for r in results), results
    assert len(results) == OUTPUT_LEN  # 9 rounds that leave beams running, then the end
    for step, r in enumerate(results, start=1):
        assert r.as_numpy("text_output").shape == (2,)
        assert r.as_numpy("cum_log_probs").shape == (1, 2)
        assert r.as_numpy("output_log_probs").shape == (1, 2, step)
        assert r.as_numpy("sequence_index")[0][0] == 0
    texts = [t.decode() for t in results[-1].as_numpy("text_output")]
    assert texts == hf_beam_texts(PROMPTS[1], 2, OUTPUT_LEN)


# ------------------------------------------------------------------------------- perf metrics
PERF_METRICS = {
    "kv_cache_alloc_new_blocks": np.int32,
    "kv_cache_reused_blocks": np.int32,
    "kv_cache_alloc_total_blocks": np.int32,
    "arrival_time_ns": np.int64,
    "first_scheduled_time_ns": np.int64,
    "first_token_time_ns": np.int64,
    "last_token_time_ns": np.int64,
    "acceptance_rate": np.float32,
    "total_accepted_draft_tokens": np.int32,
    "total_draft_tokens": np.int32,
}


def test_return_perf_metrics_over_grpc(server):
    """`end_to_end_grpc_client.py --return-perf-metrics`: every metric [1, 1] with TRT-LLM's
    type; times in ns since the epoch, in order; the second request for the same prompt
    reuses its prompt's blocks from the prefix cache."""
    prompt = "Perf metrics: " + " ".join(["tokens"] * 40)
    got = []
    for _ in range(2):
        before = time.time_ns()
        [result] = stream_request(
            server,
            "ensemble",
            prepare_inputs(prompt, OUTPUT_LEN, return_perf_metrics=np.array([[True]])),
            outputs=["text_output", *PERF_METRICS],
        )
        assert not isinstance(result, Exception), result
        values = {}
        for name, dtype in PERF_METRICS.items():
            value = result.as_numpy(name)
            assert value.shape == (1, 1) and value.dtype == dtype, (name, value)
            values[name] = value[0][0]
        times = [
            values[n]
            for n in (
                "arrival_time_ns",
                "first_scheduled_time_ns",
                "first_token_time_ns",
                "last_token_time_ns",
            )
        ]
        assert before - 10**9 < times[0] <= times[1] <= times[2] <= times[3] <= time.time_ns()
        assert (
            values["kv_cache_alloc_total_blocks"]
            == values["kv_cache_alloc_new_blocks"] + values["kv_cache_reused_blocks"]
        )
        assert values["total_draft_tokens"] == 0 and values["acceptance_rate"] == 0
        got.append(values)
    assert got[0]["kv_cache_reused_blocks"] == 0 < got[1]["kv_cache_reused_blocks"]


def test_return_perf_metrics_over_generate(server):
    """The same through HTTP /generate (the LLM-API docs' curl): the metrics are JSON fields."""
    status, body = http_post(
        server,
        "/v2/models/ensemble/generate",
        {"text_input": "What is machine learning?", "max_tokens": 5, "return_perf_metrics": True},
    )
    assert status == 200, body
    answer = json.loads(body)
    assert set(PERF_METRICS) <= set(answer)
    assert answer["first_token_time_ns"] <= answer["last_token_time_ns"]
    assert answer["kv_cache_alloc_total_blocks"] >= 1


# ------------------------------------------------------------------------------- end_to_end_test.py
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_ensemble_unary_infer(server, reference, protocol):
    """end_to_end_test.py's ensemble request (text_input, max_tokens, bad_words [[""]],
    stop_words [[""]], return_log_probs) as unary `infer` over HTTP and gRPC: one complete
    response with the prompt and output, and log probs that add up."""
    client_mod = httpclient if protocol == "http" else grpcclient
    url = server.http_url if protocol == "http" else server.grpc_url
    client = client_mod.InferenceServerClient(url)
    prompt = PROMPTS[1]
    inputs = [
        prepare_tensor("text_input", np.array([[prompt]]).astype(object), client_mod),
        prepare_tensor("max_tokens", np.ones((1, 1), np.int32) * OUTPUT_LEN, client_mod),
        prepare_tensor("bad_words", np.array([[""]], dtype=object), client_mod),
        prepare_tensor("stop_words", np.array([[""]], dtype=object), client_mod),
        prepare_tensor("return_log_probs", np.array([[True]], dtype=bool), client_mod),
    ]
    outputs = [
        client_mod.InferRequestedOutput(n)
        for n in ("text_output", "cum_log_probs", "output_log_probs")
    ]
    result = client.infer("ensemble", inputs, outputs=outputs, request_id="0")
    assert result.as_numpy("text_output")[0].decode() == prompt + greedy_text(reference, prompt)
    log_probs = result.as_numpy("output_log_probs")
    assert log_probs.shape == (1, 1, OUTPUT_LEN)
    assert result.as_numpy("cum_log_probs")[0, 0] == pytest.approx(
        float(log_probs.sum()), rel=1e-4, abs=1e-4
    )
    client.close()


def test_concurrent_unary_requests_share_engine_steps(server):
    """end_to_end_test.py's performance part (async_infer of many prompts at once) and
    perf_analyzer's non-streaming mode: concurrent unary requests run in one engine, in the
    same steps; the engine's counters show more tokens than steps."""
    before = _settled_metrics(server, metrics_text(server), 0)
    n, length = 8, 24
    client = grpcclient.InferenceServerClient(server.grpc_url)
    done = queue.Queue()
    for i in range(n):
        inputs = prepare_inputs(
            f"{PROMPTS[i % 4]} {i}", length, min_length=np.array([[length]], np.int32)
        )
        client.async_infer(
            "ensemble",
            [prepare_tensor(k, v) for k, v in inputs.items()],
            callback=lambda result, error: done.put(error or result),
        )
    results = [done.get(timeout=120) for _ in range(n)]
    assert not any(isinstance(r, Exception) for r in results), results
    client.close()
    after = _settled_metrics(server, before, n)
    tokens = metric(after, "slipstream_generation_tokens_total", model="ensemble") - metric(
        before, "slipstream_generation_tokens_total", model="ensemble"
    )
    steps = metric(
        after, "nv_trt_llm_general_metrics", model="ensemble", general_type="iteration_counter"
    ) - metric(
        before, "nv_trt_llm_general_metrics", model="ensemble", general_type="iteration_counter"
    )
    print(f"{n} concurrent unary requests: {tokens:.0f} tokens in {steps:.0f} engine steps")
    assert tokens == n * length
    assert tokens / steps > 2, (tokens, steps)  # one request per step would give 1


def _settled_metrics(server, before, finished, timeout=15):
    import time

    start = metric(before, "slipstream_requests_finished_total", model="ensemble") or 0
    deadline = time.monotonic() + timeout
    while True:
        text = metrics_text(server)
        done = (metric(text, "slipstream_requests_finished_total", model="ensemble") or 0) - start
        if done >= finished or time.monotonic() > deadline:
            time.sleep(0.2)  # one more refresh for the step counter
            return metrics_text(server)
        time.sleep(0.05)


# ------------------------------------------------------------------- generate, genai-perf
def test_readme_generate_curl_with_empty_bad_and_stop_words(server):
    """The TRT-LLM README: POST /v2/models/ensemble/generate with "bad_words": "" and
    "stop_words": "" (empty means none)."""
    status, body = http_post(
        server,
        "/v2/models/ensemble/generate",
        {
            "text_input": "What is machine learning?",
            "max_tokens": 20,
            "bad_words": "",
            "stop_words": "",
        },
    )
    assert status == 200, body
    answer = json.loads(body)
    assert answer["model_name"] == "ensemble"
    assert answer["text_output"].startswith("What is machine learning?")
    assert len(answer["text_output"]) > len("What is machine learning?")


def test_guided_decoding_regex_through_the_ensemble(server):
    """TRT-LLM's guided decoding inputs on the unary ensemble: the random tiny model's text
    matches the regex because the grammar forces it."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = {
        "text_input": np.array([["Give me a code"]], dtype=object),
        "max_tokens": np.array([[24]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
        "guided_decoding_guide_type": np.array([[b"regex"]], dtype=object),
        "guided_decoding_guide": np.array([[rb"[0-9]{3}-[a-z]{2}"]], dtype=object),
    }
    result = client.infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()])
    client.close()
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", result.as_numpy("text_output")[0].decode())


def test_genai_perf_tensorrtllm_payload_with_min_length(server):
    """genai-perf --backend tensorrtllm --output-tokens-mean 12
    --output-tokens-mean-deterministic: text_input, max_tokens and min_length (= max_tokens)
    with a batch of one; exactly that many tokens come back."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    inputs = {
        "text_input": np.array([["Tell me about Triton"]], dtype=object),
        "max_tokens": np.array([[12]], np.int32),
        "min_length": np.array([[12]], np.int32),
        "exclude_input_in_output": np.array([[True]]),
    }
    result = client.infer("ensemble", [prepare_tensor(k, v) for k, v in inputs.items()])
    text = result.as_numpy("text_output")[0].decode()
    client.close()
    tokens = _tokenizer().encode(text, add_special_tokens=False)
    assert 10 <= len(tokens) <= 14  # 12 generated tokens, re-tokenized


def _tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model_dir("llama")))


def test_genai_perf_streaming_over_generate_stream(server, reference):
    """genai-perf --backend tensorrtllm --streaming posts {"text_input", "max_tokens",
    "stream": true} to generate_stream: SSE pieces that add up to the output."""
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/ensemble_stream/generate_stream",
        data=json.dumps(
            {"text_input": PROMPTS[0], "max_tokens": OUTPUT_LEN, "stream": True}
        ).encode(),
        headers={"Content-Type": "application/json"},
    )
    pieces = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.decode().strip()
            if line.startswith("data:"):
                pieces.append(json.loads(line[5:])["text_output"])
    assert "".join(pieces) == greedy_text(reference, PROMPTS[0])


# ------------------------------------------------------------------------------- LLM-API model
@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_end_to_end_test_llmapi_unary_infer(server, reference, protocol):
    """`end_to_end_test.py --test-llmapi`: `text_input` [1] and `sampling_param_max_tokens` to
    the `tensorrt_llm` model (samples/trtllm_llmapi_model_repository): the prompt and its
    greedy continuation (the LLM API's default sampling)."""
    client_mod = httpclient if protocol == "http" else grpcclient
    client = client_mod.InferenceServerClient(
        server.http_url if protocol == "http" else server.grpc_url
    )
    inputs = {
        "text_input": np.array([PROMPTS[1]], dtype=object),
        "sampling_param_max_tokens": np.array([OUTPUT_LEN], np.int32),
    }
    result = client.infer(
        "tensorrt_llm", [prepare_tensor(k, v, client_mod) for k, v in inputs.items()]
    )
    assert result.as_numpy("text_output")[0].decode() == PROMPTS[1] + greedy_text(
        reference, PROMPTS[1]
    )


def test_llmapi_generate_with_reasons_and_perf_metrics(server, reference):
    """The LLM-API docs' curl with `sampling_param_return_perf_metrics` (every metric a string,
    under its names), plus the finish/stop reasons and cumulative logprob as strings, and
    `sampling_param_exclude_input_from_output`."""
    status, body = http_post(
        server,
        "/v2/models/tensorrt_llm/generate",
        {
            "text_input": PROMPTS[0],
            "sampling_param_max_tokens": OUTPUT_LEN,
            "sampling_param_return_perf_metrics": True,
            "sampling_param_exclude_input_from_output": True,
            "return_finish_reason": True,
            "return_stop_reason": True,
            "return_cumulative_logprob": True,
        },
    )
    assert status == 200, body
    answer = json.loads(body)
    assert answer["text_output"] == greedy_text(reference, PROMPTS[0])
    assert answer["finish_reason"] == "length" and answer["stop_reason"] == "None"
    assert float(answer["cumulative_logprob"]) < 0
    names = (
        "acceptance_rate",
        "arrival_time_ns",
        "first_scheduled_time_ns",
        "first_token_time_ns",
        "kv_cache_alloc_new_blocks",
        "kv_cache_alloc_total_blocks",
        "kv_cache_hit_rate",
        "kv_cache_missed_block",
        "kv_cache_reused_block",
        "last_token_time_ns",
        "total_accepted_draft_tokens",
        "total_draft_tokens",
    )
    assert all(isinstance(answer[n], str) for n in names), answer
    assert int(answer["arrival_time_ns"]) <= int(answer["last_token_time_ns"])
    assert int(answer["kv_cache_alloc_total_blocks"]) >= 1


def test_llmapi_streaming_on_the_unary_model_is_refused(server):
    status, body = http_post(
        server, "/v2/models/tensorrt_llm/generate", {"text_input": PROMPTS[0], "streaming": True}
    )
    assert status == 400 and "decoupled mode" in body


def test_llmapi_streaming_model_takes_the_unary_models_sampling_params(server, reference):
    """`end_to_end_test.py --test-llmapi --streaming` with `--sampling-params` against the
    decoupled LLM-API sample (samples/trtllm_llmapi_streaming_model_repository): the same
    `sampling_param_*` inputs as the unary model, each response the whole text so far, the
    last one the greedy continuation. Before: no streaming LLM-API model was shipped; the
    streaming ensemble answered "unexpected inference input 'sampling_param_temperature'"."""
    inputs = {
        "text_input": np.array([PROMPTS[2]], dtype=object),
        "streaming": np.array([True]),
        "sampling_param_max_tokens": np.array([OUTPUT_LEN], np.int32),
        "sampling_param_temperature": np.array([0.7], np.float32),
        "sampling_param_top_k": np.array([1], np.int32),
        "sampling_param_top_p": np.array([0.9], np.float32),
        "sampling_param_seed": np.array([3], np.uint64),
        "sampling_param_frequency_penalty": np.array([0.0], np.float32),
        "sampling_param_presence_penalty": np.array([0.0], np.float32),
        "return_finish_reason": np.array([True]),
    }
    results = stream_request(
        server, "tensorrt_llm_stream", inputs, outputs=["text_output", "finish_reason"]
    )
    assert not any(isinstance(r, Exception) for r in results), results
    texts = [r.as_numpy("text_output")[0].decode() for r in results]
    assert texts[-1] == greedy_text(reference, PROMPTS[2])
    assert all(texts[-1].startswith(t) for t in texts)  # the whole text so far, each time
    assert results[-1].as_numpy("finish_reason")[0].decode() == "length"


# ------------------------------------------------------------------------------- sequence_length
def test_sequence_length_counts_the_tokens_of_each_text(server, reference):
    """`sequence_length` (INT32 [1, beams]) as TensorRT-LLM's model reports it: the tokens of
    the returned text, the prompt's included when the prompt is prepended; streamed, the
    tokens of each response; beams, each beam's. Before: "unexpected inference output
    'sequence_length' for model 'ensemble'"."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    prompt_tokens = reference(PROMPTS[1]).num_prompt_tokens
    names = [grpcclient.InferRequestedOutput(n) for n in ("text_output", "sequence_length")]
    for exclude, expected in ((False, prompt_tokens + OUTPUT_LEN), (True, OUTPUT_LEN)):
        inputs = prepare_inputs(PROMPTS[1], OUTPUT_LEN, exclude_input_in_output=exclude)
        del inputs["stream"]
        result = client.infer(
            "ensemble", [prepare_tensor(k, v) for k, v in inputs.items()], outputs=names
        )
        assert result.as_numpy("sequence_length").tolist() == [[expected]]
    inputs = prepare_inputs(PROMPTS[1], OUTPUT_LEN, beam_width=2)
    del inputs["stream"]
    result = client.infer(
        "ensemble", [prepare_tensor(k, v) for k, v in inputs.items()], outputs=names
    )
    assert result.as_numpy("sequence_length").tolist() == [[prompt_tokens + OUTPUT_LEN] * 2]
    streamed = stream_request(
        server,
        "ensemble_stream",
        prepare_inputs(PROMPTS[1], OUTPUT_LEN, streaming=True),
        outputs=["text_output", "sequence_length"],
    )
    assert not any(isinstance(r, Exception) for r in streamed), streamed
    lengths = [int(r.as_numpy("sequence_length")[0][0]) for r in streamed]
    assert sum(lengths) == OUTPUT_LEN and all(n >= 0 for n in lengths)


def test_inflight_batcher_client_stop_request_is_refused_naming_the_interface(server):
    """`inflight_batcher_llm_client.py --stop-after-ms ... --requested-outputs output_ids
    sequence_length --model-name ensemble`: the request and its in-band stop (token ids) are
    refused naming input_ids, not with Triton's "unexpected inference output
    'sequence_length'"."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    request = {
        "input_ids": np.array([[1, 2, 3]], np.int32),
        "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[4]], np.int32),
    }
    stop = {**request, "stop": np.array([[True]], dtype=bool)}
    outputs = [grpcclient.InferRequestedOutput(n) for n in ("output_ids", "sequence_length")]
    for inputs in (request, stop):
        with pytest.raises(InferenceServerException, match="input 'input_ids' is not supported"):
            client.infer(
                "ensemble", [prepare_tensor(k, v) for k, v in inputs.items()], outputs=outputs
            )


# ------------------------------------------------------------------------------- beam settings
def test_beam_search_applies_or_refuses_each_sampling_setting_through_every_front_door(
    server,
):
    """The rule lives in the engine's validation: through the ensemble's inputs a truncation
    (top_k) is refused by name and the temperature is applied to the beams' scores; through
    `generate`'s `sampling_parameters` the same. Before: both were ignored silently."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    names = [grpcclient.InferRequestedOutput(n) for n in ("text_output", "cum_log_probs")]

    def beams(**extra):
        inputs = prepare_inputs(PROMPTS[1], OUTPUT_LEN, beam_width=2, return_log_probs=True)
        del inputs["stream"]
        inputs.update(extra)
        return client.infer(
            "ensemble", [prepare_tensor(k, v) for k, v in inputs.items()], outputs=names
        )

    with pytest.raises(InferenceServerException, match="beam search does not apply top_k"):
        beams(top_k=np.array([[5]], np.int32))
    plain = beams(temperature=np.array([[1.0]], np.float32)).as_numpy("cum_log_probs")
    sharp = beams(temperature=np.array([[0.5]], np.float32)).as_numpy("cum_log_probs")
    assert plain.shape == sharp.shape == (1, 2) and not np.allclose(plain, sharp)
    status, body = http_post(
        server,
        "/v2/models/unbatched/generate",
        {
            "text_input": PROMPTS[1],
            "sampling_parameters": json.dumps({"beam_width": 2, "top_p": 0.5, "max_tokens": 4}),
        },
    )
    assert status == 400 and "beam search does not apply top_p" in body, body


# ------------------------------------------------------------------------------- refusals
REFUSALS = {
    "beam_width 0": ({"beam_width": np.array([[0]], np.int32)}, "beam_width"),
    "prompt_embedding_table": (
        {"prompt_embedding_table": np.zeros((1, 2, 4), np.float16)},
        "input 'prompt_embedding_table' is not supported: prompt tuning",
    ),
    "prompt_vocab_size": (
        {"prompt_vocab_size": np.array([[4]], np.int32)},
        "input 'prompt_vocab_size'",
    ),
    "prompt_table_extra_id": (
        {"prompt_table_extra_id": np.array([[1]], np.uint64)},
        "input 'prompt_table_extra_id'",
    ),
    "lora_weights": (
        {
            "lora_weights": np.zeros((1, 2, 4), np.float16),
            "lora_config": np.zeros((1, 2, 3), np.int32),
        },
        "input 'lora_weights'",
    ),
    "lora_config": ({"lora_config": np.zeros((1, 2, 3), np.int32)}, "input 'lora_config'"),
    "in-band stop": ({"stop": np.array([[True]])}, "input 'stop' is not supported"),
    "length_penalty NaN": ({"length_penalty": np.array([[np.nan]], np.float32)}, "length_penalty"),
    "return_context_logits": (
        {"return_context_logits": np.array([[True]])},
        "return_context_logits",
    ),
    "return_generation_logits": (
        {"return_generation_logits": np.array([[True]])},
        "return_generation_logits",
    ),
    "embedding bias lengths differ": (
        {
            "embedding_bias_words": np.array([[b"a", b"b"]], object),
            "embedding_bias_weights": np.array([[1.0]], np.float32),
        },
        "embedding_bias_weights",
    ),
    "guide without its type": (
        {"guided_decoding_guide": np.array([[b"[0-9]+"]], object)},
        "guided_decoding_guide_type",
    ),
    "lora_task_id": ({"lora_task_id": np.array([[3]], np.uint64)}, "lora_task_id"),
    "stream on the non-decoupled model": ({"stream": np.array([[True]])}, "decoupled mode"),
}


@pytest.mark.parametrize("kind", list(REFUSALS))
def test_unsupported_trtllm_input_is_refused_alone(server, reference, kind):
    """What the engine cannot honour is an error naming it, for that request only: the good
    request sent beside it on the same stream is answered."""
    extra, named = REFUSALS[kind]
    good = prepare_inputs(PROMPTS[0], OUTPUT_LEN)
    bad = prepare_inputs(PROMPTS[0], OUTPUT_LEN)
    bad.update(extra)
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    client.async_stream_infer(
        "ensemble", [prepare_tensor(k, v) for k, v in bad.items()], request_id="bad"
    )
    client.async_stream_infer(
        "ensemble", [prepare_tensor(k, v) for k, v in good.items()], request_id="good"
    )
    client.stop_stream()
    client.close()
    got = [results.get() for _ in range(results.qsize())]
    errors = [e for r, e in got if e is not None]
    answers = [r for r, e in got if e is None]
    assert len(errors) == 1 and named in str(errors[0]), errors
    assert [a.as_numpy("text_output")[0].decode() for a in answers] == [
        PROMPTS[0] + greedy_text(reference, PROMPTS[0])
    ]


def test_core_model_token_id_request_is_refused_naming_the_interface(server):
    """inflight_batcher_llm_client.py's request to the core model (input_ids, input_lengths,
    request_output_len, output ids back) sent to the ensemble: an error naming input_ids and
    why, not Triton's "unexpected input"; asking for output_ids alone is refused the same."""
    client = grpcclient.InferenceServerClient(server.grpc_url)
    token_ids = {
        "input_ids": np.array([[1, 2, 3]], np.int32),
        "input_lengths": np.array([[3]], np.int32),
        "request_output_len": np.array([[4]], np.int32),
    }
    with pytest.raises(
        InferenceServerException, match="input 'input_ids' is not supported: this model takes text"
    ):
        client.infer(
            "ensemble",
            [prepare_tensor(k, v) for k, v in token_ids.items()],
            outputs=[grpcclient.InferRequestedOutput("output_ids")],
        )
    text = prepare_inputs(PROMPTS[0], OUTPUT_LEN)
    with pytest.raises(InferenceServerException, match="output 'output_ids' is not supported"):
        client.infer(
            "ensemble",
            [prepare_tensor(k, v) for k, v in text.items()],
            outputs=[grpcclient.InferRequestedOutput("output_ids")],
        )


def test_bad_row_of_a_batched_request_fails_alone(server, reference):
    """Decoupled, batched [2, 1] with beam_width [[1], [0]]: row 1 gets its error, row 0 its
    text, and the request ends once."""
    inputs = batch([prepare_inputs(p, OUTPUT_LEN) for p in PROMPTS[:2]])
    inputs["beam_width"] = np.array([[1], [0]], np.int32)
    results = stream_request(
        server, "ensemble_stream", inputs, outputs=["text_output", "batch_index"]
    )
    errors = [r for r in results if isinstance(r, InferenceServerException)]
    answers = [r for r in results if not isinstance(r, Exception)]
    assert len(errors) == 1 and "beam_width" in str(errors[0])
    assert len(answers) == 1 and answers[0].as_numpy("batch_index")[0][0] == 0
    assert answers[0].as_numpy("text_output")[0].decode() == PROMPTS[0] + greedy_text(
        reference, PROMPTS[0]
    )


# ------------------------------------------------------------------------------- queue, metrics
def test_queue_full_gets_trtllm_message(server):
    """test_max_queue_size.py: beyond the queue's size, requests fail with TRT-LLM's text
    ("Exceeds maximum queue size"); the others finish."""
    results = queue.Queue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    long = prepare_inputs("first", 200, streaming=True, min_length=np.array([[200]], np.int32))
    client.async_stream_infer(
        "ensemble_queue",
        [prepare_tensor(k, v) for k, v in long.items()],
        request_id="running",
        enable_empty_final_response=True,
    )
    first = results.get(timeout=60)  # it is running: the queue is empty
    assert first[1] is None, first
    for i in range(3):
        short = prepare_inputs(f"next {i}", 4)
        client.async_stream_infer(
            "ensemble_queue",
            [prepare_tensor(k, v) for k, v in short.items()],
            request_id=f"r{i}",
            enable_empty_final_response=True,
        )
    client.stop_stream(cancel_requests=False)
    client.close()
    errors = [e for _, e in (results.get() for _ in range(results.qsize())) if e is not None]
    assert errors and all(
        "Exceeds maximum queue size" in str(e)
        and "Maximum queue size of 1 has been reached, please try again later" in str(e)
        for e in errors
    ), errors


def test_trtllm_metric_families(server, reference):
    """ci/L0_backend_trtllm: the nv_trt_llm_* families with its label keys and values
    (custom_metrics_verification_tests.py's table) and the token-length histograms with its
    buckets (base_metrics_verification_tests.py), from the engine's counters."""
    before = metrics_text(server)
    prompt_tokens = reference(PROMPTS[3], 6, min_tokens=6).num_prompt_tokens
    results = stream_request(
        server,
        "ensemble",
        prepare_inputs(PROMPTS[3], 6, min_length=np.array([[6]], np.int32)),
        outputs=["text_output"],
    )
    assert not isinstance(results[0], Exception), results
    after = _settled_metrics(server, before, 1)
    keys = set()
    for s in parse_samples(after):
        if s.name.startswith("nv_trt_llm") and s.labels.get("model") == "ensemble":
            keys.update(f"{k}={v}" for k, v in s.labels.items() if k not in ("model", "version"))
    assert keys == {
        "request_type=active",
        "request_type=max",
        "request_type=scheduled",
        "request_type=waiting",
        "kv_cache_block_type=max",
        "kv_cache_block_type=free",
        "kv_cache_block_type=used",
        "kv_cache_block_type=tokens_per",
        "kv_cache_block_type=reused",
        "kv_cache_block_type=fraction",
        "inflight_batcher_specific_metric=total_context_tokens",
        "inflight_batcher_specific_metric=generation_requests",
        "inflight_batcher_specific_metric=micro_batch_id",
        "general_type=iteration_counter",
        "general_type=timestamp",
        "memory_type=cpu",
        "memory_type=gpu",
        "memory_type=pinned",
    }
    m = partial(metric, after, model="ensemble")
    assert m("nv_trt_llm_request_metrics", request_type="max") == ENGINE["max_num_seqs"]
    assert m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="tokens_per") == 16
    total = m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="max")
    assert (
        total > 0
        and m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="free")
        + m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="used")
        == total
    )
    assert 0 <= m("nv_trt_llm_kv_cache_block_metrics", kv_cache_block_type="fraction") <= 1
    assert m("nv_trt_llm_general_metrics", general_type="iteration_counter") > 0
    # the serving process's memory in bytes: resident (the model, the KV cache, Python), and
    # no GPU or pinned memory on a CPU-only machine
    assert m("nv_trt_llm_runtime_memory_metrics", memory_type="cpu") > 50 * 2**20
    if not torch.cuda.is_available():
        assert m("nv_trt_llm_runtime_memory_metrics", memory_type="gpu") == 0
        assert m("nv_trt_llm_runtime_memory_metrics", memory_type="pinned") == 0
    for family, label, value in (
        ("nv_llm_input_token_len", "total_input_tokens", prompt_tokens),
        ("nv_llm_output_token_len", "total_output_tokens", 6),
    ):
        for le in ("10", "50", "100", "500", "1000", "+Inf"):
            pattern = (
                rf'{family}_bucket{{model="ensemble",response_metric_type="{label}",'
                rf'version="1",le="{re.escape(le)}"}}\s+(\d+)'
            )
            grew = [
                int(re.search(pattern, t).group(1)) if re.search(pattern, t) else 0
                for t in (before, after)
            ]
            assert grew[1] - grew[0] == (1 if le == "+Inf" or value <= float(le) else 0), (
                family,
                le,
                grew,
            )


# ------------------------------------------------------------------------------- max_batch_size 0
def test_trtllm_inputs_without_batch_dimension(server, reference):
    """The Python-backend layout (max_batch_size: 0, decoupled): TRT-LLM's inputs shaped [1]
    work too, beam_width and return_log_probs included."""
    inputs = {
        k: v[0] for k, v in prepare_inputs(PROMPTS[2], OUTPUT_LEN, return_log_probs=True).items()
    }
    inputs["temperature"] = np.array([0.0], np.float32)
    results = stream_request(server, "unbatched", inputs, outputs=["text_output", "cum_log_probs"])
    assert len(results) == 1 and not isinstance(results[0], Exception), results
    assert results[0].as_numpy("text_output")[0].decode() == PROMPTS[2] + greedy_text(
        reference, PROMPTS[2]
    )
    assert results[0].as_numpy("cum_log_probs").shape == (1, 1)


# ------------------------------------------------------------------------------- client example
@pytest.mark.parametrize("model, flags", [("ensemble", []), ("ensemble_stream", ["-S"])])
def test_client_example_batched_request(server, reference, model, flags):
    """client_examples/trtllm_ensemble_client.py: two prompts in one request, unary and
    streamed; each answer printed under its batch index."""
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "client_examples" / "trtllm_ensemble_client.py"),
            PROMPTS[0],
            PROMPTS[1],
            "--url",
            server.grpc_url,
            "--model",
            model,
            "-o",
            str(OUTPUT_LEN),
            *flags,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    streamed = bool(flags)  # streaming never repeats the prompt
    expected = [
        f"[{i}] {'' if streamed else p}{greedy_text(reference, p)}"
        for i, p in enumerate(PROMPTS[:2])
    ]
    assert out.stdout.splitlines()[-2:] == expected
