"""Values one request could use to fail a step it shares with others are refused at submit
(or made safe), with a message naming the field; the engine never sees them."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core import sampling_params as sp
from slipstream.engine import LLMEngine
from slipstream.server.stub.request_parser import BadRequestError, parse_request
from slipstream.testing import make_tiny_model_dir
from slipstream.worker.model.context_length import fit_max_model_len, position_limit
from support import tiny_model_dir

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            block_size=4,
            max_model_len=128,
            num_gpu_blocks_override=64,
        )
    )


def s(text):
    return np.array([text.encode() if isinstance(text, str) else text], dtype=object)


def test_temperature_below_epsilon_is_greedy_and_tiny_ones_are_raised():
    assert SamplingParams(temperature=1e-300).greedy
    assert SamplingParams(temperature=sp.GREEDY_TEMPERATURE_EPS / 2).temperature == 0.0
    assert SamplingParams(temperature=1e-3).temperature == sp.MIN_SAMPLED_TEMPERATURE
    assert SamplingParams(temperature=0.7).temperature == pytest.approx(0.7)


def test_seed_must_fit_what_torch_generator_accepts():
    assert SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    assert SamplingParams(seed=-(2**63)).seed == -(2**63)
    for bad in (2**64, -(2**63) - 1, 10**30):
        with pytest.raises(
            ValueError, match=r"seed must be an integer in \[-2\*\*63, 2\*\*64 - 1\]"
        ):
            SamplingParams(seed=bad)


@pytest.mark.parametrize("value", [1e-300, 1e-39, 1e39, 0.0])
def test_repetition_penalty_outside_float32_is_refused(value):
    with pytest.raises(ValueError, match="repetition_penalty must be > 0 and within float32"):
        SamplingParams(repetition_penalty=value)


def test_stop_lists_are_bounded_in_count_and_length():
    with pytest.raises(ValueError, match=f"at most {sp.MAX_STOP_STRINGS} are allowed"):
        SamplingParams(stop=[f"s{i}" for i in range(100_000)])
    with pytest.raises(ValueError, match=f"at most {sp.MAX_STOP_STRING_CHARS} characters"):
        SamplingParams(stop=["x" * (sp.MAX_STOP_STRING_CHARS + 1)])
    with pytest.raises(ValueError, match=f"at most {sp.MAX_STOP_TOKEN_IDS} are allowed"):
        SamplingParams(stop_token_ids=list(range(sp.MAX_STOP_TOKEN_IDS + 1)))
    with pytest.raises(ValueError, match="stop must be a list"):
        SamplingParams(stop={"a": 1})
    ok = SamplingParams(stop=["x" * sp.MAX_STOP_STRING_CHARS] * sp.MAX_STOP_STRINGS)
    assert len(ok.stop) == sp.MAX_STOP_STRINGS


def test_error_messages_stay_short_for_huge_or_deep_values():
    deep = []
    for _ in range(50_000):
        deep = [deep]
    for bad in (dict(stop=[deep]), dict(stop_token_ids=["x" * 1_000_000])):
        with pytest.raises(ValueError) as err:
            SamplingParams(**bad)
        assert len(str(err.value)) < 300


def test_stop_token_ids_and_end_id_beyond_the_vocabulary_are_refused(engine):
    vocab = engine.logits_vocab_size
    for ids in ([10**12], [vocab], [5, 2**31 - 1]):
        with pytest.raises(
            ValueError, match=f"stop_token_ids must be < the vocabulary size {vocab}"
        ):
            engine.make_request("hello", SamplingParams(stop_token_ids=ids, min_tokens=2))
    parsed = parse_request(
        {
            "text_input": s("hi"),
            "end_id": np.array([2**31 - 1], np.int32),
            "min_tokens": np.array([2], np.int32),
        }
    )
    with pytest.raises(ValueError, match="vocabulary size"):
        engine.make_request(parsed.prompt, parsed.params)
    assert engine.make_request("hello", SamplingParams(stop_token_ids=[vocab - 1]))


def test_oversized_prompt_is_refused_by_size_before_tokenizing(engine):
    huge = "word " * (2 * 1024 * 1024)  # 10 MB
    started = time.perf_counter()
    with pytest.raises(ValueError, match="bytes, more than max_model_len 128 tokens can hold"):
        engine.make_request(huge)
    assert time.perf_counter() - started < 0.5  # tokenizing it would take seconds
    with pytest.raises(ValueError, match="max_model_len"):  # under the byte bound: counted
        engine.make_request("word " * 200)


def test_max_model_len_above_the_model_positions_is_refused_at_load(tmp_path):
    gpt2 = make_tiny_model_dir(tmp_path / "gpt2-64", "gpt2", n_positions=64)
    with pytest.raises(
        ValueError, match="max_model_len 512 is larger than the model's position limit 64"
    ):
        LLMEngine(EngineConfig(model=str(gpt2), max_model_len=512))
    engine = LLMEngine(EngineConfig(model=str(gpt2), num_gpu_blocks_override=32, block_size=4))
    assert engine.config.max_model_len == 64  # unset: the model's limit
    out = engine.generate(["hello there"], SamplingParams(max_tokens=500, **GREEDY))[0]
    assert out.finish_reason == "length" and out.num_prompt_tokens + out.num_output_tokens == 64


def test_position_limit_reads_every_naming_and_rope_stretching():
    class Config:
        max_position_embeddings = 4096
        rope_scaling = {
            "rope_type": "yarn",
            "factor": 4.0,
            "original_max_position_embeddings": 2048,
        }

    assert position_limit(Config()) == 8192
    Config.rope_scaling = {"rope_type": "llama3", "factor": 8.0}
    assert position_limit(Config()) == 4096
    Config.rope_scaling = None
    Config.seq_length = 1000
    assert position_limit(Config()) == 1000
    assert fit_max_model_len(EngineConfig(max_model_len=1000), Config()).max_model_len == 1000


def test_deeply_nested_sampling_parameters_are_a_bad_request():
    for body in ("[" * 100_000 + "]" * 100_000, '{"stop": ' + "[" * 100_000 + "]" * 100_000 + "}"):
        with pytest.raises(
            BadRequestError, match="input 'sampling_parameters' is nested too deeply"
        ):
            parse_request({"text_input": s("hi"), "sampling_parameters": s(body)})
    with pytest.raises(BadRequestError, match="nested too deeply"):
        parse_request({"text_input": s("hi")}, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}")


def test_oversized_json_and_stop_word_tensors_are_refused_before_parsing():
    body = json.dumps({"stop": [f"s{i}" for i in range(200_000)]})
    with pytest.raises(BadRequestError, match="bytes long; at most"):
        parse_request({"text_input": s("hi"), "sampling_parameters": s(body)})
    words = np.array([b"w%d" % i for i in range(100_000)], dtype=object)
    with pytest.raises(BadRequestError, match="'stop_words' has 100000 strings"):
        parse_request({"text_input": s("hi"), "stop_words": words})
    with pytest.raises(BadRequestError, match="at most 64 are allowed"):
        parse_request(
            {"text_input": s("hi"), "sampling_parameters": s(json.dumps({"stop": ["a"] * 65}))}
        )


def test_every_parse_of_request_json_is_bounded():
    """The LoRA check reads sampling_parameters before parse_request: deep nesting must not
    escape it as a RecursionError (an internal error instead of INVALID_ARG)."""
    from slipstream.server.stub.request_parser import lora_error

    deep = s("[" * 100_000 + "]" * 100_000)
    assert lora_error({"text_input": s("hi"), "sampling_parameters": deep}) is None
    assert (
        lora_error({"text_input": s("hi")}, '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}") is None
    )
