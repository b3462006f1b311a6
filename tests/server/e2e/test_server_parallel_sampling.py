"""n / best_of and prompt logprobs through a real tritonserver (one server for the module):
n sequences come back as vLLM's backend returns them, one element per sequence in each
output tensor; cancelling such a request frees every KV block."""

import json
import os

import numpy as np
import pytest
import torch

grpcclient = pytest.importorskip("tritonclient.grpc")

from server_support import StreamClient, metrics, run_stream, text_inputs, wait_metric  # noqa: E402
from support import reference_model  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]

PROMPT = "The quick brown fox jumps over the lazy dog"
OUTPUTS = dict(
    return_finish_reason=np.array([True]),
    return_cumulative_logprob=np.array([True]),
    return_num_output_tokens=np.array([True]),
)


def strings(result, name):
    return [v.decode() for v in result.as_numpy(name).reshape(-1)]


def test_non_streaming_n_returns_every_sequence(server, reference):
    results, error = run_stream(
        server,
        text_inputs(
            PROMPT, stream=False, sampling={"temperature": 0, "max_tokens": 12, "n": 3}, **OUTPUTS
        ),
    )
    assert error is None
    [last] = [r for r in results if r.as_numpy("text_output") is not None]
    want = PROMPT + reference(PROMPT)  # greedy: three copies of the single-request text
    assert strings(last, "text_output") == [want] * 3
    assert strings(last, "finish_reason") == ["length"] * 3
    assert last.as_numpy("num_output_tokens").tolist() == [12] * 3


def test_streaming_n_is_indexed_by_position(server, reference):
    results, error = run_stream(
        server,
        text_inputs(PROMPT, sampling={"temperature": 0, "max_tokens": 12, "n": 2}, **OUTPUTS),
    )
    assert error is None
    texts = ["", ""]
    for r in results:
        if r.as_numpy("text_output") is None:
            continue
        deltas = strings(r, "text_output")
        assert len(deltas) == 2 and sum(bool(d) for d in deltas) <= 1  # one sequence moved
        texts = [t + d for t, d in zip(texts, deltas)]
    assert texts == [reference(PROMPT)] * 2
    assert strings(results[-1], "finish_reason") == ["length", "length"]


def test_seeded_n_is_reproducible_and_best_of_ranks(server):
    sampling = {"temperature": 1.0, "max_tokens": 8, "n": 2, "seed": 42, "ignore_eos": True}

    def ask(**extra):
        results, error = run_stream(
            server, text_inputs(PROMPT, stream=False, sampling={**sampling, **extra}, **OUTPUTS)
        )
        assert error is None
        return [r for r in results if r.as_numpy("text_output") is not None][-1]

    first, again = ask(), ask()
    assert strings(first, "text_output") == strings(again, "text_output")
    assert len(set(strings(first, "text_output"))) == 2
    single = ask(n=1, seed=43)  # sequence 1 samples with seed + 1
    assert strings(single, "text_output")[0] == strings(first, "text_output")[1]
    every = ask(n=4)
    best = ask(best_of=4)
    ranked = sorted(
        zip(every.as_numpy("cumulative_logprob").tolist(), strings(every, "text_output")),
        reverse=True,
    )[:2]
    assert strings(best, "text_output") == [text for _, text in ranked]
    assert best.as_numpy("cumulative_logprob").tolist() == pytest.approx(
        [lp for lp, _ in ranked], abs=1e-4
    )


@pytest.mark.parametrize(
    "sampling, message",
    [
        ({"n": 0}, "n must be at least 1, got 0."),
        (
            {"n": 3, "best_of": 2},
            "best_of must be greater than or equal to n, got n=3 and best_of=2.",
        ),
    ],
)
def test_invalid_n_fails_alone_with_vllm_message(server, reference, sampling, message):
    _, error = run_stream(server, text_inputs(PROMPT, sampling=sampling))
    assert error is not None and message in str(error)
    results, error = run_stream(
        server, text_inputs(PROMPT, sampling={"temperature": 0, "max_tokens": 12})
    )
    assert error is None


def test_prompt_logprobs_match_hf(server, tiny_model):
    from transformers import AutoTokenizer

    results, error = run_stream(
        server,
        text_inputs(
            PROMPT,
            stream=False,
            sampling={"temperature": 0, "max_tokens": 2, "prompt_logprobs": 2},
            return_prompt_logprobs=np.array([True]),
        ),
    )
    assert error is None
    [last] = [r for r in results if r.as_numpy("text_output") is not None]
    entries = json.loads(last.as_numpy("prompt_logprobs").reshape(-1)[0])
    ids = AutoTokenizer.from_pretrained(str(tiny_model))(PROMPT)["input_ids"]
    with torch.no_grad():
        logits = reference_model(tiny_model)(torch.tensor([ids])).logits[0]
    ref = torch.log_softmax(logits.float(), dim=-1)
    assert len(entries) == len(ids) and entries[0] is None
    for pos in range(1, len(ids)):
        entry = entries[pos]
        assert next(iter(entry)) == str(ids[pos])
        assert entry[str(ids[pos])]["logprob"] == pytest.approx(
            ref[pos - 1, ids[pos]].item(), abs=1e-4
        )
        top = torch.topk(ref[pos - 1], 2).indices.tolist()
        assert {str(t) for t in top} <= set(entry)


def test_cancelled_n_stream_frees_every_kv_block(server):
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
    client = StreamClient(server.grpc_url)
    client.send(
        "many",
        text_inputs(
            PROMPT, sampling={"temperature": 1.0, "max_tokens": 900, "ignore_eos": True, "n": 4}
        ),
    )
    before = metrics(server)["slipstream_generation_tokens_total"]
    for _ in range(8):  # its sequences are generating
        client.queues["many"].get(timeout=60)
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v > 0)
    client.close(cancel=True)
    wait_metric(server, "slipstream_kv_blocks_used", lambda v: v == 0)
    wait_metric(server, "slipstream_requests_running", lambda v: v == 0)
    generated = metrics(server)["slipstream_generation_tokens_total"] - before
    assert generated < 4 * 900, "the request ran to completion instead of being aborted"
    results, error = run_stream(server, text_inputs("still alive?", sampling={"max_tokens": 4}))
    assert error is None and results
