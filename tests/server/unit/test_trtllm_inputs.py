"""TensorRT-LLM inputs and outputs without a server: rows of a batched request, the mapping of
the ensemble's inputs onto sampling settings, the refusals, the stacked non-decoupled
response, and what ``auto_complete`` declares."""

import numpy as np
import pytest

from slipstream.core.request import FinishReason, RequestOutput
from slipstream.server import model_interfaces
from slipstream.server.stub import model_config
from slipstream.server.stub.request_parser import BadRequestError, parse_request
from slipstream.server.stub.responses import ResponseBuilder
from slipstream.server.stub.row_sender import merge_rows
from slipstream.server.trtllm import llmapi
from slipstream.server.trtllm.inputs import (
    check_unsupported,
    split_rows,
    translate,
    trtllm_queue_full,
)
from slipstream.server.trtllm.outputs import TrtllmResponses
from support import ROOT


def s(*texts):
    return np.array([t.encode() for t in texts], dtype=object)


def i32(v):
    return np.array([v], np.int32)


def parsed(row, **kw):
    t = translate(row, encode=lambda w: [ord(c) for c in w], **kw)
    return t, parse_request(t.row.inputs, t.row.parameters)


def test_batched_request_splits_into_rows_without_the_batch_dimension():
    rows = split_rows(
        {
            "text_input": np.array([[b"a"], [b"b"]], object),
            "max_tokens": np.array([[3], [4]], np.int32),
        },
        batched=True,
    )
    assert [r["text_input"].tolist() for r in rows] == [[b"a"], [b"b"]]
    assert [int(r["max_tokens"][0]) for r in rows] == [3, 4]
    assert split_rows({"text_input": s("a")}, batched=False) == [{"text_input": s("a")}]


def test_rows_with_different_batch_sizes_are_refused():
    with pytest.raises(BadRequestError, match="max_tokens"):
        split_rows(
            {
                "text_input": np.array([[b"a"], [b"b"]], object),
                "max_tokens": np.array([[3]], np.int32),
            },
            batched=True,
        )


def test_trtllm_names_map_onto_sampling_settings():
    _, p = parsed(
        {
            "text_input": s("hi"),
            "min_length": i32(3),
            "max_tokens": i32(8),
            "random_seed": np.array([7], np.uint64),
            "beam_width": i32(1),
            "length_penalty": np.array([1.0], np.float32),
            "pad_id": i32(0),
            "bad_words": s("x", ""),
            "stop_words": s("", "end"),
            "embedding_bias_words": s("ab"),
            "embedding_bias_weights": np.array([2.0], np.float32),
            "num_return_sequences": i32(1),
        }
    )
    assert (p.params.min_tokens, p.params.max_tokens, p.params.seed) == (3, 8, 7)
    assert p.params.bad_words == ["x"] and p.params.stop == ["end"]
    assert p.params.logit_bias == {ord("a"): 2.0, ord("b"): 2.0}


def test_empty_stop_and_bad_words_mean_none():
    _, p = parsed({"text_input": s("hi"), "stop_words": s(""), "bad_words": s("")})
    assert p.params.stop == [] and p.params.bad_words == []


def test_trtllm_defaults_greedy_and_streaming_ignores_exclude_false():
    t, p = parsed(
        {
            "text_input": s("hi"),
            "temperature": np.array([1.0], np.float32),
            "stream": np.array([True]),
            "exclude_input_in_output": np.array([False]),
        },
        trtllm_defaults=True,
    )
    assert p.params.top_k == 1 and p.options.stream
    _, p = parsed(
        {"text_input": s("hi"), "top_p": np.array([0.9], np.float32)}, trtllm_defaults=True
    )
    assert p.params.top_k == 0 and p.params.top_p == pytest.approx(0.9)
    _, p = parsed({"text_input": s("hi")})  # vLLM's defaults otherwise
    assert p.params.top_k == 0


def test_return_log_probs_asks_the_engine_for_the_sampled_logprobs():
    t, p = parsed({"text_input": s("hi"), "return_log_probs": np.array([True])})
    assert t.options.return_log_probs and p.params.logprobs == 0


@pytest.mark.parametrize(
    "row, named",
    [
        ({"beam_width": i32(0)}, "beam_width"),
        ({"length_penalty": np.array([np.inf], np.float32)}, "length_penalty"),
        ({"return_context_logits": np.array([True])}, "return_context_logits"),
        ({"return_generation_logits": np.array([True])}, "return_generation_logits"),
        ({"return_perf_metrics": np.array([1], np.int32)}, "return_perf_metrics"),
        ({"decoder_text_input": s("x")}, "decoder_text_input"),
        ({"lora_task_id": np.array([1], np.uint64)}, "lora_task_id"),
        ({"embedding_bias_words": s("a")}, "embedding_bias"),
        ({"beam_width": np.array([1.0], np.float32)}, "beam_width"),
    ],
)
def test_what_cannot_be_honoured_is_refused_by_name(row, named):
    with pytest.raises(BadRequestError, match=named):
        translate({"text_input": s("hi"), **row}, encode=lambda w: [1])


def test_beam_width_asks_for_beam_search_returning_every_beam_unless_fewer_are_asked():
    t, p = parsed(
        {"text_input": s("hi"), "beam_width": i32(3), "length_penalty": np.array([0.5], np.float32)}
    )
    assert (p.params.beam_width, p.params.n, p.params.length_penalty) == (3, 3, 0.5)
    assert t.options.beam_width == 3 and t.options.num_return_sequences == 1
    t, p = parsed({"text_input": s("hi"), "beam_width": i32(3), "num_return_sequences": i32(2)})
    assert (p.params.beam_width, p.params.n) == (3, 2)
    assert t.options.num_return_sequences == 1  # the beams come in one response


@pytest.mark.parametrize(
    "inputs, outputs, named",
    [
        ({"input_ids": np.array([1, 2], np.int32)}, (), "input 'input_ids'"),
        ({"request_output_len": i32(4)}, (), "input 'request_output_len'"),
        ({"prompt_embedding_table": np.zeros((1, 4), np.float16)}, (), "p-tuning"),
        ({"prompt_table_extra_id": np.array([1], np.uint64)}, (), "prompt_table_extra_id"),
        ({"prompt_vocab_size": i32(4)}, (), "prompt_vocab_size"),
        ({"lora_weights": np.zeros((1, 4), np.float16)}, (), "lora_weights"),
        ({"lora_config": np.zeros((1, 3), np.int32)}, (), "lora_config"),
        ({"stop": np.array([True])}, (), "in-band stop"),
        ({}, ("text_output", "output_ids"), "output 'output_ids'"),
    ],
)
def test_inputs_never_served_are_refused_naming_them(inputs, outputs, named):
    with pytest.raises(BadRequestError, match=named):
        check_unsupported(inputs, outputs)


def test_stop_false_and_every_output_unnamed_are_accepted():
    check_unsupported({"text_input": s("hi"), "stop": np.array([False])}, ("text_output",))
    every = ("text_output", "output_ids")  # what Triton lists when the client names none
    check_unsupported({"text_input": s("hi")}, every, every)


def test_false_flags_and_neutral_values_are_accepted():
    translate(
        {
            "text_input": s("hi"),
            "return_context_logits": np.array([False]),
            "return_generation_logits": np.array([False]),
            "length_penalty": np.array([1.0], np.float32),
            "beam_width": i32(1),
        }
    )
    # with one beam a length penalty changes nothing (TRT-LLM applies it to beam scores)
    translate(
        {"text_input": s("hi"), "length_penalty": np.array([1.5], np.float32), "beam_width": i32(1)}
    )


def test_end_id_text_is_not_emitted():
    class Tok:
        def decode(self, ids, **kw):
            return "<E>" if ids == [5] else "?"

    t = translate({"text_input": s("hi"), "end_id": i32(5), "stream": np.array([True])})
    assert t.row.end_ids == [5]
    out = RequestOutput(
        "r",
        text="ab<E>",
        token_ids=[3, 5],
        logprobs=[-0.5, -0.25],
        finished=True,
        finish_reason=FinishReason.STOP,
        cumulative_logprob=-0.75,
    )
    native = ResponseBuilder(parse_request(t.row.inputs, t.row.parameters), Tok(), t.row.end_ids)
    got = TrtllmResponses(native, t.options).streamed(out)
    assert got["text_output"][0] == b"ab"


def test_merge_rows_stacks_and_pads():
    merged = merge_rows(
        [
            {"text_output": s("a"), "output_log_probs": np.zeros((1, 1, 2), np.float32)},
            {"text_output": s("b"), "output_log_probs": np.ones((1, 1, 3), np.float32)},
        ]
    )
    assert merged["text_output"].tolist() == [b"a", b"b"]
    assert merged["output_log_probs"].shape == (2, 1, 3)


def test_queue_full_text_is_trtllms():
    assert trtllm_queue_full(4) == (
        "Exceeds maximum queue size: Maximum queue size of 4 has "
        "been reached, please try again later"
    )


class FakeConfig:
    def __init__(self, declared):
        self.declared, self.inputs, self.outputs = declared, [], []
        self.policy, self.max_batch_size = None, None

    def as_dict(self):
        return self.declared

    def add_input(self, entry):
        self.inputs.append(entry)

    def add_output(self, entry):
        self.outputs.append(entry)

    def set_model_transaction_policy(self, policy):
        self.policy = policy

    def set_max_batch_size(self, size):
        self.max_batch_size = size


def test_auto_complete_keeps_a_configs_batch_size_and_decoupled_parameter():
    config = model_interfaces.auto_complete(
        FakeConfig({"max_batch_size": 64, "parameters": {"decoupled": {"string_value": "false"}}})
    )
    assert config.max_batch_size is None  # left as the config has it
    assert config.policy == {"decoupled": False}
    names = {e["name"] for e in config.inputs}
    assert {
        "bad_words",
        "beam_width",
        "min_length",
        "random_seed",
        "num_return_sequences",
        "embedding_bias_words",
        "return_log_probs",
    } <= names
    assert {"cum_log_probs", "output_log_probs", "batch_index", "sequence_index"} <= {
        e["name"] for e in config.outputs
    }


def test_auto_complete_defaults_to_decoupled_without_batch_dimension():
    config = model_config.auto_complete(FakeConfig({"max_batch_size": 0}))
    assert config.max_batch_size == 0 and config.policy == {"decoupled": True}


def test_trtllm_input_names_are_declared_once():
    from slipstream.server.trtllm.inputs import INPUT_NAMES

    names = model_config.INPUT_NAMES + INPUT_NAMES + llmapi.INPUT_NAMES
    assert len(names) == len(set(names))


def test_vllm_layout_keeps_vllms_outputs_unless_trtllm_is_asked_for():
    vllm = model_interfaces.auto_complete(
        FakeConfig({"backend": "slipstream", "max_batch_size": 0})
    )
    assert "cum_log_probs" not in {e["name"] for e in vllm.outputs}
    trt = model_interfaces.auto_complete(
        FakeConfig(
            {"backend": "slipstream", "parameters": {"compatibility": {"string_value": "trtllm"}}}
        )
    )
    assert "cum_log_probs" in {e["name"] for e in trt.outputs}
    own = model_interfaces.auto_complete(FakeConfig({"backend": "python"}))
    assert "batch_index" in {e["name"] for e in own.outputs}


@pytest.mark.parametrize("sample", ["trtllm_model_repository", "trtllm_streaming_model_repository"])
def test_shipped_trtllm_samples_check_out(sample):
    """samples/trtllm_*: one model named `ensemble` (TRT-LLM clients' default), the backend
    named slipstream, TRT-LLM compatibility and metric families."""

    from slipstream.server.launch.repository import check_models, find_models

    models = find_models(ROOT / "samples" / sample)
    assert [(m.name, m.backend) for m in models] == [("ensemble", "slipstream")]
    settings = check_models(models)["ensemble"]
    assert settings.compatibility == "trtllm" and "trtllm" in settings.metric_families
    assert settings.report_metrics and settings.engine["model"] == "default"


def test_shipped_llmapi_sample_checks_out():
    """samples/trtllm_llmapi_model_repository: one model named `tensorrt_llm` (the LLM-API
    model's name) with the llmapi interface: its inputs, and its STRING outputs only."""

    from slipstream.server.launch.repository import check_models, find_models

    sample = ROOT / "samples" / "trtllm_llmapi_model_repository"
    models = find_models(sample)
    assert [(m.name, m.backend) for m in models] == [("tensorrt_llm", "slipstream")]
    assert check_models(models)["tensorrt_llm"].interface == "llmapi"
    config = model_interfaces.auto_complete(
        FakeConfig(
            {"backend": "slipstream", "parameters": {"interface": {"string_value": "llmapi"}}}
        )
    )
    names = {e["name"]: e["data_type"] for e in config.outputs}
    assert names["cumulative_logprob"] == names["kv_cache_hit_rate"] == "TYPE_STRING"
    assert "cum_log_probs" not in names
    assert {"streaming", "sampling_param_max_tokens", "sampling_param_stop"} <= {
        e["name"] for e in config.inputs
    }
