"""Pooling (embedding) requests through the engine loop: the vector is the model's last-layer
hidden states after the final norm (what transformers' base model returns), pooled as asked,
on both forward paths, and a pooling request takes nothing from generation's KV cache."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from slipstream import SamplingParams
from slipstream.core.pooling_params import PoolingParams, PoolingType
from slipstream.core.request import FinishReason
from slipstream.engine.loop import EngineLoop
from engine_support import GREEDY, config
from support import tiny_model_dir

PROMPT = [5, 17, 42, 7, 99, 3, 250, 11, 64]


def reference(ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir("llama")), dtype=torch.float32)
    with torch.no_grad():
        return model.model(input_ids=torch.tensor([ids])).last_hidden_state[0]


def finished(stream, timeout=60.0):
    return [out for out in stream][-1]


@pytest.fixture(scope="module", params=[True, False], ids=["lean", "transformers"])
def loop(request):
    lp = EngineLoop(config(fast_forward=request.param)).start()
    yield lp
    lp.shutdown(timeout=10)


@pytest.mark.parametrize(
    "pooling_type, normalize",
    [(PoolingType.LAST, True), (PoolingType.MEAN, True), (PoolingType.CLS, False)],
)
def test_the_vector_is_the_pooled_last_hidden_states(loop, pooling_type, normalize):
    out = finished(loop.embed(PROMPT, PoolingParams(pooling_type, normalize)))
    assert out.finish_reason is FinishReason.STOP and out.num_prompt_tokens == len(PROMPT)
    hidden = reference(PROMPT)
    expected = {
        PoolingType.LAST: hidden[-1],
        PoolingType.MEAN: hidden.mean(0),
        PoolingType.CLS: hidden[0],
    }[pooling_type]
    if normalize:
        expected = F.normalize(expected, dim=0)
    got = torch.tensor(out.embedding)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    if normalize:
        assert abs(got.norm().item() - 1.0) < 1e-5


def test_a_text_prompt_is_tokenized_as_a_generation_prompt_would_be(loop):
    text = "The capital of France is"
    ids = loop.engine.tokenize(text)
    by_text = finished(loop.embed(text)).embedding
    by_ids = finished(loop.embed(ids)).embedding
    assert by_text == by_ids


def test_pooling_beside_generation_takes_no_kv_block_and_changes_no_answer(loop):
    alone = loop.generate([8, 9, 10], SamplingParams(max_tokens=12, **GREEDY)).token_ids
    stream = loop.submit([8, 9, 10], SamplingParams(max_tokens=12, **GREEDY))
    vectors = [finished(loop.embed(PROMPT * (i + 1))) for i in range(3)]
    beside = [t for out in stream for t in out.token_ids]
    assert beside == alone
    assert all(v.embedding is not None for v in vectors)
    assert loop.stats().kv_blocks_used == 0


def test_a_bad_pooling_prompt_fails_alone_with_a_client_error(loop):
    out = finished(loop.embed([10**9]))
    assert out.finish_reason is FinishReason.ERROR and "token ids must be in" in out.error
    assert isinstance(loop.embed([1, 2, 3]).get(timeout=60).embedding, list)


def test_pooling_parameters_refuse_dimensions_and_unknown_types():
    with pytest.raises(ValueError, match="matryoshka"):
        PoolingParams.from_dict({"dimensions": 8}, "tiny")
    with pytest.raises(ValueError, match="pooling_type"):
        PoolingParams.from_dict({"pooling_type": "MAX"})
    assert PoolingParams.from_dict({"pooling_type": "mean", "normalize": False}) == PoolingParams(
        PoolingType.MEAN, False
    )
