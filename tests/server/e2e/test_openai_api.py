"""The OpenAI-compatible API (``slipstream serve --openai-port``) against a real tritonserver,
driven by the official ``openai`` SDK (sync and async, streaming) and plain HTTP. Every answer
is compared with the same request through Triton's generate endpoint (greedy)."""

from __future__ import annotations

import asyncio
import http.client
import json
import re
import shutil
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.openai.frontend import OpenAIFrontend
from lora_support import adapter_dir
from support import http_generate, need_tritonserver
from vllm_backend_support import FAILING_HEALTH_MODEL_PY, tokenizer_of, write_model

pytestmark = [pytest.mark.server, pytest.mark.slow]

MODEL = "tiny"  # the tiny llama, LoRA adapters doll and sheep
QUEUED = "tiny_queue1"  # one running request, one waiting: the third is refused
SICK = "sick"  # its engine check fails from the second batch on (ENABLE_VLLM_HEALTH_CHECK)
PROMPT = "The capital of France is"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("openai_repo")
    model_dir = write_model(
        repo, MODEL, model_json={"enable_lora": True, "max_loras": 2, "max_lora_rank": 16}
    )
    for name in ("doll", "sheep"):
        shutil.copytree(adapter_dir(name), model_dir / "1" / "loras" / name)
    (model_dir / "1" / "multi_lora.json").write_text(
        json.dumps({"doll": "./loras/doll", "sheep": "./loras/sheep"})
    )
    write_model(
        repo,
        QUEUED,
        parameters={"max_queue_size": "1", "max_num_seqs": "1", "metrics_interval_ms": "100"},
    )
    write_model(
        repo,
        SICK,
        backend="python",
        model_py=FAILING_HEALTH_MODEL_PY,
        parameters={"ENABLE_VLLM_HEALTH_CHECK": "true"},
    )
    return repo


@pytest.fixture(scope="module")
def server(repo):
    need_tritonserver()
    with TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        models=[MODEL, QUEUED, SICK],
        startup_timeout=600,
    ) as srv:
        yield srv


@pytest.fixture(scope="module")
def frontend(repo, server):
    with OpenAIFrontend.for_repository(repo, server.grpc_url, metrics_url=server.metrics_url) as f:
        yield f


@pytest.fixture(scope="module")
def client(frontend):
    return openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)


def generate(server, model: str, prompt: str, **parameters) -> str:
    """The same request through Triton's generate endpoint: the reference."""
    status, body = http_generate(
        server,
        model,
        {
            "text_input": prompt,
            "parameters": {"stream": False, "exclude_input_in_output": True, **parameters},
        },
    )
    assert status == 200, body
    return body["text_output"]


def post(frontend, path: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        frontend.url + path,
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def scrape(server) -> list:
    text = urllib.request.urlopen(server.metrics_url, timeout=10).read().decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def metric(server, name: str, model: str) -> float:
    return sum(
        s.value for s in scrape(server) if s.name == name and s.labels.get("model_name") == model
    )


def wait_idle(server, model: str, timeout: float = 30) -> None:
    """Until nothing runs on ``model`` and its counters have been flushed (an interval)."""
    deadline = time.monotonic() + timeout
    while metric(server, "vllm:num_requests_running", model) and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.5)


# ------------------------------------------------------------------------ models, health
def test_models_lists_each_model_and_lora_adapter(client):
    ids = {m.id: m for m in client.models.list().data}
    assert {MODEL, QUEUED, SICK, "doll", "sheep"} <= set(ids)
    assert ids["doll"].model_extra["parent"] == MODEL
    assert ids[MODEL].owned_by == "slipstream" and ids[MODEL].model_extra["max_model_len"] == 1024
    assert client.models.retrieve("sheep").id == "sheep"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")


# ------------------------------------------------------------------------ equal to generate
def test_chat_greedy_equals_generate_with_the_chat_template(server, client):
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=12
    )
    expected = generate(
        server, MODEL, QUESTION, temperature=0, max_tokens=12, apply_chat_template=True
    )
    assert answer.choices[0].message.content == expected
    assert answer.choices[0].message.role == "assistant"
    tokenizer = tokenizer_of()
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}], add_generation_prompt=True, tokenize=False
    )
    prompt_ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
    assert answer.usage.prompt_tokens == len(prompt_ids)
    assert answer.usage.completion_tokens == len(
        tokenizer(expected, add_special_tokens=False)["input_ids"]
    )
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens


def test_completions_greedy_equals_generate(server, client):
    answer = client.completions.create(
        model=MODEL, prompt=PROMPT, temperature=0, max_tokens=10, extra_body={"ignore_eos": True}
    )
    expected = generate(server, MODEL, PROMPT, temperature=0, max_tokens=10, ignore_eos=True)
    assert answer.choices[0].text == expected
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage.completion_tokens == 10
    assert answer.usage.prompt_tokens == len(tokenizer_of()(PROMPT)["input_ids"])


def test_lora_adapter_named_as_model_equals_generate_with_lora_name(server, client):
    texts = {}
    for name in ("doll", "sheep", MODEL):
        texts[name] = (
            client.completions.create(
                model=name,
                prompt=PROMPT,
                temperature=0,
                max_tokens=8,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
        )
        lora = {} if name == MODEL else {"lora_name": name}
        assert texts[name] == generate(
            server, MODEL, PROMPT, temperature=0, max_tokens=8, ignore_eos=True, **lora
        )
    assert len(set(texts.values())) == 3  # the adapters really change the answer


# ------------------------------------------------------------------------ streaming
def test_async_chat_stream_with_usage_equals_the_whole_answer(client, frontend):
    whole = (
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_completion_tokens=16,
            extra_body={"ignore_eos": True},
        )
        .choices[0]
        .message.content
    )

    async def stream():
        aclient = openai.AsyncOpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)
        chunks = []
        async for chunk in await aclient.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": QUESTION}],
            temperature=0,
            max_completion_tokens=16,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        ):
            chunks.append(chunk)
        await aclient.close()
        return chunks

    chunks = asyncio.run(stream())
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and not any(finishes[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 16
    assert all(c.usage is None for c in chunks[:-1])


def test_sync_completions_stream_n2_seeded_is_reproducible(client):
    def run() -> dict:
        texts: dict = {}
        finish: dict = {}
        for chunk in client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            n=2,
            seed=7,
            temperature=1.0,
            max_tokens=8,
            stream=True,
            extra_body={"ignore_eos": True},
        ):
            for c in chunk.choices:
                texts[c.index] = texts.get(c.index, "") + c.text
                if c.finish_reason:
                    finish[c.index] = c.finish_reason
        assert finish == {0: "length", 1: "length"}
        return texts

    first = run()
    assert set(first) == {0, 1}
    assert run() == first


# ------------------------------------------------------------------------ sampling fields
def test_chat_logprobs_give_the_greedy_token_first_among_top_logprobs(client):
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": QUESTION}],
        temperature=0,
        max_tokens=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    content = answer.choices[0].logprobs.content
    assert len(content) == 5
    assert "".join(t.token for t in content) == answer.choices[0].message.content
    for t in content:
        assert len(t.top_logprobs) == 3
        assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob
        values = [x.logprob for x in t.top_logprobs]
        assert values == sorted(values, reverse=True) and all(v <= 0 for v in values)
        assert t.bytes == list(t.token.encode())


def test_completions_logprobs_and_echo(client):
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=4,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = answer.choices[0].logprobs
    assert "".join(lp.tokens) == answer.choices[0].text and len(lp.token_logprobs) == 4
    assert all(len(top) in (2, 3) for top in lp.top_logprobs)
    assert lp.text_offset[0] == 0
    echoed = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=4,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    assert echoed.choices[0].text == PROMPT + answer.choices[0].text


def test_stop_string_ends_with_finish_reason_stop(server, client):
    full = generate(server, MODEL, PROMPT, temperature=0, max_tokens=12, ignore_eos=True)
    stop = full.strip().split()[1] if len(full.split()) > 1 else full.strip()[:2]
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=12,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].finish_reason == "stop"
    assert answer.choices[0].text == full[: full.index(stop)]


def test_response_format_json_schema_constrains_the_answer(client):
    schema = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    answer = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Yes or no?"}],
        temperature=0,
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
    )
    # the random test model may spend its budget on the whitespace JSON allows
    compact = re.sub(r"\s", "", answer.choices[0].message.content)
    assert any(full.startswith(compact) for full in ('{"answer":"yes"}', '{"answer":"no"}'))
    assert compact.startswith('{"answer"')
    tight = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Yes or no?"}],
        temperature=0,
        max_tokens=40,
        extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}},
    )
    assert json.loads(tight.choices[0].message.content)["answer"] in ("yes", "no")
    obj = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        temperature=0,
        max_tokens=20,
        response_format={"type": "json_object"},
    )
    assert obj.choices[0].message.content.lstrip().startswith("{")
    choice = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["Paris", "Rome"]}},
    )
    assert choice.choices[0].text in ("Paris", "Rome")


def test_min_tokens_top_k_and_penalties_reach_the_engine(server, client):
    answer = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        temperature=0,
        max_tokens=6,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        extra_body={"min_tokens": 6, "top_k": 5, "repetition_penalty": 1.2},
    )
    expected = generate(
        server,
        MODEL,
        PROMPT,
        temperature=0,
        max_tokens=6,
        min_tokens=6,
        top_k=5,
        repetition_penalty=1.2,
        presence_penalty=0.5,
        frequency_penalty=0.5,
    )
    assert answer.choices[0].text == expected and answer.usage.completion_tokens == 6


# ------------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "body, status, message",
    [
        ({"model": "nope", "prompt": "x"}, 404, "The model `nope` does not exist."),
        ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, "temperature"),
        (
            {"model": MODEL, "prompt": "x", "frobnicate": 1},
            400,
            "unknown field 'frobnicate' (not supported)",
        ),
        ({"model": MODEL, "prompt": "x", "suffix": "y"}, 400, "suffix is not supported"),
        ({"model": MODEL, "prompt": [1, 2, 3]}, 400, "prompts as token ids are not supported"),
        (
            {"model": MODEL, "prompt": "x", "stream_options": {"include_usage": True}},
            400,
            "Stream options can only be defined when `stream=True`.",
        ),
    ],
)
def test_completion_errors_are_openai_error_bodies(frontend, body, status, message):
    got, answer = post(frontend, "/v1/completions", body)
    assert got == status, answer
    assert message in answer["error"]["message"] and answer["error"]["code"] == status


@pytest.mark.parametrize(
    "extra, message",
    [
        (
            {"tools": [{"type": "code_interpreter"}]},
            "tools[0]: only tools of type 'function' are supported",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
            '"auto" tool choice requires --enable-auto-tool-choice',
        ),
        ({"top_logprobs": 2}, "when using `top_logprobs`, `logprobs` must be set to true"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
            "content part of type 'image_url' is not supported",
        ),
    ],
)
def test_chat_errors_name_the_refused_field(frontend, extra, message):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **extra}
    got, answer = post(frontend, "/v1/chat/completions", body)
    assert got == 400 and message in answer["error"]["message"], answer


def test_bad_value_streaming_is_an_http_400_before_any_event(client):
    with pytest.raises(openai.BadRequestError, match="top_p"):
        client.completions.create(model=MODEL, prompt=PROMPT, top_p=7.0, stream=True)


def test_full_queue_answers_429(frontend, server):
    """max_num_seqs 1 and max_queue_size 1: of four long requests at once, the engine takes
    one and queues one; the others get 429 (RateLimitError), which routers retry elsewhere."""
    client = openai.OpenAI(base_url=f"{frontend.url}/v1", api_key="none", max_retries=0)

    def one(_):
        try:
            client.completions.create(
                model=QUEUED, prompt=PROMPT, max_tokens=40, extra_body={"ignore_eos": True}
            )
            return 200
        except openai.APIStatusError as e:
            assert "overloaded" in e.message or "queue" in e.message
            assert e.response.headers.get("retry-after") == "1"  # before: in the body only
            return e.status_code

    with ThreadPoolExecutor(4) as pool:
        codes = list(pool.map(one, range(4)))
    assert codes.count(429) >= 1 and codes.count(200) >= 1, codes


# ------------------------------------------------------------------------ cancellation
def aborted(server, model: str) -> float:
    return sum(
        s.value
        for s in scrape(server)
        if s.name == "vllm:request_success_total"
        and s.labels.get("model_name") == model
        and s.labels.get("finished_reason") == "abort"
    )


def poll(check, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_client_disconnect_cancels_the_request_in_the_engine(frontend, server):
    """The engine counts the request aborted (its finish is counted before any log line is
    written: the count, not the log, is what the test waits for), nothing runs and the
    generated-token counter stops."""
    wait_idle(server, QUEUED)
    before = metric(server, "vllm:generation_tokens_total", QUEUED)
    aborts = aborted(server, QUEUED)
    conn = http.client.HTTPConnection(frontend.host, frontend.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": QUEUED,
                "prompt": PROMPT,
                "max_tokens": 900,
                "stream": True,
                "ignore_eos": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.status == 200
    for _ in range(3):
        assert response.readline().startswith(b"data: ")
        response.readline()
    assert poll(lambda: metric(server, "vllm:num_requests_running", QUEUED) >= 1, 30)
    conn.sock.shutdown(2)
    conn.close()
    assert poll(lambda: aborted(server, QUEUED) == aborts + 1, 30)
    assert poll(lambda: metric(server, "vllm:num_requests_running", QUEUED) == 0, 30)
    generated = metric(server, "vllm:generation_tokens_total", QUEUED) - before
    assert generated < 900  # it stopped long before max_tokens
    time.sleep(1)
    assert metric(server, "vllm:generation_tokens_total", QUEUED) - before == generated


# ------------------------------------------------------------------------ health
def test_health_fails_once_the_engine_is_dead(repo, server):
    sick = [
        m
        for m in OpenAIFrontend.for_repository(repo, server.grpc_url).table.models
        if m.name == SICK
    ]
    with OpenAIFrontend(sick, server.grpc_url) as only_sick:
        health = f"{only_sick.url}/health"
        assert urllib.request.urlopen(health, timeout=10).status == 200
        body = {"model": SICK, "prompt": PROMPT, "max_tokens": 2}
        assert post(only_sick, "/v1/completions", body)[0] == 200  # first check passes
        status, answer = post(only_sick, "/v1/completions", body)
        assert status == 503 and "unhealthy" in answer["error"]["message"]
        deadline = time.monotonic() + 30
        code = 200
        while code == 200 and time.monotonic() < deadline:
            try:
                code = urllib.request.urlopen(health, timeout=10).status
            except urllib.error.HTTPError as e:
                code = e.code
            time.sleep(0.2)
        assert code == 503


# ------------------------------------------------------------------------ metrics contract
# The Gateway API Inference Extension's model-server protocol (docs/proposals/
# 003-model-server-protocol) and vLLM's dashboard read these series of every served model.
GRAFANA = json.loads((Path(__file__).parent / "data" / "vllm_grafana_queries.json").read_text())
SELECTOR = re.compile(r"(vllm:[A-Za-z0-9_:]+)(?:\{([^}]*)\})?")
MATCHER = re.compile(r'(\w+)\s*=\s*"([^"]*)"')


def dashboard_selectors() -> list[tuple[str, dict]]:
    """(series name, labels it must carry) for every series vLLM's dashboard queries, with
    $model_name set to the served model; a ``sum by(label)`` needs that label too."""
    out = []
    for expr in GRAFANA["expressions"]:
        by = re.findall(r"by\s*\(([^)]*)\)", expr)
        grouped = {g.strip() for group in by for g in group.split(",")} - {"le"}
        for name, matchers in SELECTOR.findall(expr):
            labels = {k: v.replace("$model_name", MODEL) for k, v in MATCHER.findall(matchers)}
            out.append((name, {**labels, **{g: None for g in grouped}}))
    return out


def has_series(samples, name: str, labels: dict) -> bool:
    return any(
        s.name == name
        and all(k in s.labels and (v is None or s.labels[k] == v) for k, v in labels.items())
        for s in samples
    )


def test_metrics_contract_every_vllm_dashboard_series_exists_with_its_labels(server, client):
    client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    selectors = dashboard_selectors()
    assert len(selectors) >= 30
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        missing = [
            (name, labels) for name, labels in selectors if not has_series(samples, name, labels)
        ]
        if not missing or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not missing
    # the dashboard's model picker: label_values({__name__=~"vllm:.*"}, model_name)
    assert GRAFANA["templating"] == ['label_values({__name__=~"vllm:.*"},model_name)']
    assert MODEL in {s.labels.get("model_name") for s in samples if s.name.startswith("vllm:")}


def test_metrics_contract_gateway_gauges_and_info_series(server, frontend):
    """The endpoint picker's inputs: queue, running, KV usage gauges; block size from
    vllm:cache_config_info; LoRA state from vllm:lora_requests_info (value: when it was last
    current, so a reader takes the newest series). Read at /metrics on the OpenAI port, as
    on a vLLM server."""
    text = urllib.request.urlopen(f"{frontend.url}/metrics", timeout=10).read().decode()
    samples = [s for f in text_string_to_metric_families(text) for s in f.samples]
    mine = [s for s in samples if s.labels.get("model_name") == MODEL]
    names = {s.name for s in mine}
    assert {
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:lora_requests_info",
    } <= names
    for s in mine:
        if s.name == "vllm:kv_cache_usage_perc":
            assert 0.0 <= s.value <= 1.0
    [cache] = [s for s in mine if s.name == "vllm:cache_config_info"]
    assert cache.labels["block_size"] == "16" and int(cache.labels["num_gpu_blocks"]) > 0
    infos = [s for s in mine if s.name == "vllm:lora_requests_info"]
    newest = max(infos, key=lambda s: s.value)
    assert newest.labels["max_lora"] == "2"
    assert {"running_lora_adapters", "waiting_lora_adapters"} <= set(newest.labels)
    assert abs(newest.value - time.time()) < 24 * 3600  # a unix timestamp


def test_metrics_contract_running_lora_and_gauges_refresh_within_the_interval(server, frontend):
    """While a request on adapter doll decodes, the newest lora_requests_info names it and
    num_requests_running counts it, within the metrics interval (1 s) plus a scrape."""
    conn = http.client.HTTPConnection(frontend.host, frontend.port, timeout=60)
    conn.request(
        "POST",
        "/v1/completions",
        json.dumps(
            {
                "model": "doll",
                "prompt": PROMPT,
                "max_tokens": 600,
                "stream": True,
                "ignore_eos": True,
            }
        ),
        {"Content-Type": "application/json"},
    )
    response = conn.getresponse()
    assert response.readline().startswith(b"data: ")
    started = time.monotonic()

    def newest_lora() -> dict:
        infos = [
            s
            for s in scrape(server)
            if s.name == "vllm:lora_requests_info" and s.labels.get("model_name") == MODEL
        ]
        return max(infos, key=lambda s: s.value).labels

    try:
        while time.monotonic() - started < 10 and (
            newest_lora()["running_lora_adapters"] != "doll"
            or metric(server, "vllm:num_requests_running", MODEL) < 1
        ):
            time.sleep(0.1)
        seen = time.monotonic() - started
        assert newest_lora()["running_lora_adapters"] == "doll"
        assert metric(server, "vllm:num_requests_running", MODEL) >= 1
        assert seen < 3.0, seen  # metrics_interval_ms 1000, plus the scrape
    finally:
        conn.close()


def test_metrics_contract_counts_of_openai_requests(server, client):
    """vLLM's own metric assertions (tests/entrypoints/openai/test_metrics.py): per request
    its prompt and generation tokens, one success with its finish reason, one TPOT per
    request, inter-token latencies between the first token and the last."""
    names = (
        "vllm:generation_tokens_total",
        "vllm:request_generation_tokens_sum",
        "vllm:request_success_total",
        "vllm:request_time_per_output_token_seconds_count",
        "vllm:request_max_num_generation_tokens_sum",
        "vllm:inter_token_latency_seconds_count",
        "vllm:prompt_tokens_total",
        "vllm:e2e_request_latency_seconds_count",
    )

    def values() -> dict:
        out = dict.fromkeys(names, 0.0)
        for s in scrape(server):
            if s.labels.get("model_name") != MODEL or s.name not in out:
                continue
            if s.name == "vllm:request_success_total" and s.labels["finished_reason"] != "length":
                continue
            out[s.name] += s.value
        return out

    wait_idle(server, MODEL)  # an earlier test's cancelled request may still be ending
    before = values()
    requests, tokens = 3, 5
    for _ in range(requests):
        client.completions.create(
            model=MODEL,
            prompt=PROMPT,
            max_tokens=tokens,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
    prompt_tokens = len(tokenizer_of()(PROMPT)["input_ids"])
    expected = {
        "vllm:generation_tokens_total": requests * tokens,
        "vllm:request_generation_tokens_sum": requests * tokens,
        "vllm:request_success_total": requests,
        "vllm:request_time_per_output_token_seconds_count": requests,
        "vllm:request_max_num_generation_tokens_sum": requests * tokens,
        "vllm:prompt_tokens_total": requests * prompt_tokens,
        "vllm:e2e_request_latency_seconds_count": requests,
    }
    deadline = time.monotonic() + 10
    while True:
        delta = {k: v - before[k] for k, v in values().items()}
        if all(delta[k] == v for k, v in expected.items()) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {k: delta[k] for k in expected} == expected
    assert requests <= delta["vllm:inter_token_latency_seconds_count"] <= requests * (tokens - 1)


# ------------------------------------------------------------------------ Triton's own frontend
def triton_frontend_inputs(stream: bool, sampling: dict) -> list:
    """The tensors Triton's OpenAI frontend (server repo python/openai, engine/utils/triton.py,
    _create_vllm_generate_request) builds for a model whose backend is "vllm": its request
    model dumped without None values as sampling_parameters (n, temperature, top_p and the
    penalties always there), max_tokens, logprobs, lora_name and a tool's schema as a
    structured_outputs JSON string; echo as exclude_input_in_output; usage flags."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    text = np.array([QUESTION.encode()], dtype=np.object_)
    return [
        tensor("text_input", text, "BYTES"),
        tensor("stream", np.bool_([stream]), "BOOL"),
        tensor("exclude_input_in_output", np.bool_([True]), "BOOL"),
        tensor(
            "sampling_parameters",
            np.array([json.dumps(sampling).encode()], dtype=np.object_),
            "BYTES",
        ),
        tensor("return_num_input_tokens", np.bool_([True]), "BOOL"),
        tensor("return_num_output_tokens", np.bool_([True]), "BOOL"),
        tensor("return_logprobs", np.bool_([True]), "BOOL"),
    ]


@pytest.mark.parametrize("stream", [False, True])
def test_triton_openai_frontend_request_shape_is_served(server, stream):
    """What Triton's OpenAI frontend reads back works: one text_output string per response
    (volume 1), UINT32 token counts, vLLM's logprobs JSON whose lowest rank is the chosen
    token; non-streaming is one response (it checks for 1 or 2, the last final)."""
    from vllm_backend_support import stream_requests

    tool_schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    sampling = {
        "frequency_penalty": 0,
        "presence_penalty": 0,
        "n": 1,
        "temperature": 0,
        "top_p": 1,
        "max_tokens": 6,
        "logprobs": 2,
        "ignore_eos": True,
        "logit_bias": {"11": 0},
        "lora_name": "doll",
        "structured_outputs": json.dumps({"json": json.dumps(tool_schema)}),
    }
    responses = stream_requests(
        server.grpc_url, MODEL, [{"inputs": triton_frontend_inputs(stream, sampling)}]
    )
    assert all(error is None for _, error in responses), [str(e) for _, e in responses]
    results = [r for r, _ in responses]
    assert len(results) == (len(results) if stream else 1)
    text, count, chosen = "", 0, ""
    for r in results:
        assert r.as_numpy("text_output").size == 1
        assert r.as_numpy("num_input_tokens").dtype.name == "uint32"
        assert r.as_numpy("num_output_tokens").dtype.name == "uint32"
        count += int(r.as_numpy("num_output_tokens").reshape(-1)[0])
        text += r.as_numpy("text_output").reshape(-1)[0].decode()
        for position in json.loads(r.as_numpy("logprobs").reshape(-1)[0]) or []:
            entries = list(position.values())
            assert all(isinstance(e["rank"], int) for e in entries)
            # the sampled token first; the frontend takes the lowest rank, which is the same
            # token unless a grammar or sampling picked a less likely one (as with vLLM)
            chosen += entries[0]["decoded_token"]
    assert count == 6 and text.lstrip().startswith("{") and chosen == text


# ------------------------------------------------------------------------ vLLM's benchmark client
PEER_PYTHON = Path.home() / ".cache" / "slipstream" / "peers" / "venv" / "bin" / "python"
VLLM_BENCH = (
    "import sys; from vllm.utils.argparse_utils import FlexibleArgumentParser; "
    "from vllm.benchmarks.serve import add_cli_args, main; "
    "p = FlexibleArgumentParser(); add_cli_args(p); main(p.parse_args(sys.argv[1:]))"
)


def test_vllm_bench_serve_openai_chat_completes_every_request(frontend, tmp_path):
    """vLLM's own benchmark client (vllm.benchmarks.serve, backend openai-chat, from the vLLM
    peer's virtualenv, scripts/setup_peers.py) against the OpenAI port: every request
    succeeds and it reports goodput. The peer (GBs) is not installed in CI: skipped there."""
    import subprocess

    if not PEER_PYTHON.exists():
        pytest.skip(f"no vLLM peer virtualenv ({PEER_PYTHON}; scripts/setup_peers.py)")
    from support import tiny_model_dir

    cmd = [
        str(PEER_PYTHON),
        "-c",
        VLLM_BENCH,
        "--backend",
        "openai-chat",
        "--endpoint",
        "/v1/chat/completions",
        "--base-url",
        frontend.url,
        "--model",
        MODEL,
        "--tokenizer",
        str(tiny_model_dir("llama")),
        "--dataset-name",
        "random",
        "--random-input-len",
        "32",
        "--random-output-len",
        "8",
        "--num-prompts",
        "8",
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--goodput",
        "ttft:60000",
        "tpot:60000",
        "--save-result",
        "--result-dir",
        str(tmp_path),
        "--result-filename",
        "bench.json",
        "--seed",
        "0",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    result = json.loads((tmp_path / "bench.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0, result
    assert result["total_output_tokens"] == 8 * 8
    assert "Request goodput (req/s):" in out.stdout and result["request_goodput"] > 0


def test_chat_render_returns_the_prompt_tokens_the_engine_prefills(frontend, client):
    # vllm-router's kv_aware policy matches these ids against the replica's KV events
    messages = [{"role": "user", "content": QUESTION}]
    status, body = post(
        frontend, "/v1/chat/completions/render", {"model": MODEL, "messages": messages}
    )
    assert status == 200, body
    tokenizer = tokenizer_of()
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert body["token_ids"] == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1)
    assert chat.usage.prompt_tokens == len(body["token_ids"])


def test_completion_render_returns_one_token_list_per_prompt(frontend, client):
    status, body = post(
        frontend, "/v1/completions/render", {"model": MODEL, "prompt": [PROMPT, QUESTION]}
    )
    assert status == 200, body
    assert [len(r["token_ids"]) for r in body] == [
        client.completions.create(model=MODEL, prompt=p, max_tokens=1).usage.prompt_tokens
        for p in (PROMPT, QUESTION)
    ]


def test_router_added_fields_do_not_change_the_answer(client):
    messages = [{"role": "user", "content": QUESTION}]
    plain = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=8, temperature=0
    )
    routed = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=8,
        temperature=0,
        extra_body={
            "no_stop_trim": True,
            "separate_reasoning": True,
            "stream_reasoning": True,
            "return_hidden_states": False,
            "include_reasoning": True,
        },
    )
    assert routed.choices[0].message.content == plain.choices[0].message.content
