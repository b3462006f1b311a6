"""Structured outputs in the engine: JSON schema / regex / choice / grammar masks in the
batched sampler, with the tiny random model (only the grammar can make its output valid)."""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest

from slipstream import EngineConfig, SamplingParams
from slipstream.core.structured_outputs import StructuredOutputsParams
from slipstream.engine import LLMEngine
from slipstream.server.stub.request_parser import BadRequestError, parse_request
from slipstream.worker.sample.structured_output import GrammarCompiler
from support import SAMPLERS, engine_with_sampler, random_workload, tiny_model_dir

pytest.importorskip("llguidance")

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
REGEX = r"[a-z]{2,6}-[0-9]{3}"
CHOICES = ["alpha", "beta", "gamma delta"]
GRAMMAR = 'root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?'
# With flexible whitespace a random model may emit whitespace until max_tokens (as vLLM would):
# the JSON checks turn it off so that the output must close.
JSON_SPEC = {"json": SCHEMA, "disable_any_whitespace": True}


def make_engine(**overrides) -> LLMEngine:
    settings = dict(
        model=str(tiny_model_dir()),
        block_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=512,
        num_gpu_blocks_override=400,
    )
    settings.update(overrides)
    return LLMEngine(EngineConfig(**settings))


@pytest.fixture(scope="module", params=SAMPLERS)
def engine(request, tier_device) -> LLMEngine:
    return engine_with_sampler(request.param, tier_device, lambda device: make_engine(**device))


def constrained(spec: dict, **kw) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 120, "temperature": 0, **kw}, structured_outputs=spec)


def check(kind: str, text: str) -> None:
    if kind == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    elif kind == "regex":
        assert re.fullmatch(REGEX, text), text
    elif kind == "choice":
        assert text in CHOICES, text
    else:
        assert re.fullmatch(r"\((?:[1-9][0-9]?)(?:\+[1-9][0-9]?)*\)", text), text


SPECS = {
    "json": JSON_SPEC,
    "regex": {"regex": REGEX},
    "choice": {"choice": CHOICES},
    "grammar": {"grammar": GRAMMAR},
}


def test_constrained_outputs_match_their_spec_in_a_batch_with_free_requests(engine):
    prompts, outs = random_workload(8, seed=11, lengths=(3, 9, 20, 41))
    params, kinds = [], []
    for i, kind in enumerate(["json", "regex", None, "choice", "grammar", None, "json", "regex"]):
        kinds.append(kind)
        if kind is None:
            params.append(SamplingParams(max_tokens=outs[i], temperature=0, ignore_eos=True))
        else:  # greedy and seeded sampling both must obey the grammar
            extra = {} if i % 2 == 0 else {"temperature": 1.0, "seed": i}
            params.append(constrained(SPECS[kind], **extra))
    results = engine.generate(prompts, params)
    for kind, result in zip(kinds, results):
        if kind is not None:
            assert result.finish_reason == "stop", (kind, result.text)
            check(kind, result.text)


def test_free_requests_are_bit_identical_with_constrained_neighbours(engine):
    prompts, outs = random_workload(4, seed=3, lengths=(5, 17, 30))
    free = [
        SamplingParams(max_tokens=o, temperature=0, ignore_eos=True, logprobs=2) for o in outs[:2]
    ]
    free += [
        SamplingParams(max_tokens=o, temperature=0.9, seed=7 + i, ignore_eos=True)
        for i, o in enumerate(outs[2:])
    ]
    alone = engine.generate(prompts, free)
    neighbours = [constrained(SPECS[k]) for k in ("json", "regex", "choice", "grammar")]
    mixed = engine.generate(prompts + prompts, free + neighbours)[:4]
    for a, m in zip(alone, mixed):
        assert m.token_ids == a.token_ids
        assert m.logprobs == a.logprobs  # the raw logprobs, bit for bit
        ranked = [
            [(getattr(lp, "rank", None), getattr(lp, "top", None)) for lp in r.logprobs]
            for r in (a, m)
        ]
        assert ranked[0] == ranked[1]


def test_every_sequence_of_a_parallel_sampled_request_follows_the_grammar(engine):
    """n=4 sampled sequences fork from one prefill: each gets its own matcher (sharing the
    parent's would let one sequence's tokens advance the others' grammar)."""
    [seqs] = engine.generate_sequences(
        [[7, 8, 9, 10]], [constrained({"regex": REGEX}, n=4, temperature=1.0, seed=5)]
    )
    assert len(seqs) == 4
    for out in seqs:
        assert out.finish_reason == "stop", out.text
        check("regex", out.text)
    assert len({out.text for out in seqs}) > 1  # sampled apart, each constrained


def test_grammar_completion_ends_the_request_as_stop_without_eos_text(engine):
    [out] = engine.generate([[400, 500, 600]], [constrained({"regex": "ok!"}, max_tokens=50)])
    assert (out.text, out.finish_reason) == ("ok!", "stop")
    tokenizer = engine.tokenizer
    assert out.token_ids[-1] == engine.eos_token_id  # EOS ends it; its text is not output
    assert tokenizer.decode(out.token_ids[:-1]) == "ok!"


@pytest.mark.parametrize(
    "spec, message",
    [
        ({"json": {"type": "bogus"}}, "invalid JSON schema"),
        ({"json": "{not json"}, "invalid JSON schema"),
        ({"regex": "a(b"}, "invalid regex"),
        ({"grammar": "root ::= ( unclosed"}, "invalid grammar"),
    ],
)
def test_invalid_spec_is_refused_for_that_request_alone(engine, spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        engine.make_request([1, 2, 3], constrained(spec))
    # The engine goes on serving, constrained and free requests alike.
    ok = engine.generate(
        [[7, 8, 9], [10, 11]], [constrained({"choice": CHOICES}), SamplingParams(max_tokens=4)]
    )
    assert ok[0].text in CHOICES and len(ok[1].token_ids) <= 4


@pytest.mark.parametrize(
    "spec, message",
    [
        (
            {"json": SCHEMA, "regex": "a"},
            "You can only use one kind of structured outputs constraint",
        ),
        (
            {"disable_any_whitespace": True},
            "You must use one kind of structured outputs constraint",
        ),
        ({"choice": []}, "'choice' must be a list of 1 to"),
        ({"regex": "a", "colour": 1}, "unknown field(s) ['colour']"),
        ({"structural_tag": "{}"}, "'structural_tag' is not supported"),
    ],
)
def test_malformed_structured_outputs_get_vllm_errors(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        SamplingParams(structured_outputs=spec)


def test_grammars_are_compiled_once_per_distinct_spec_and_the_cache_is_bounded(engine):
    compiler = GrammarCompiler(
        engine.tokenizer, engine.logits_vocab_size, engine.eos_token_id, cache_size=2
    )
    specs = [StructuredOutputsParams(regex=r) for r in ("a+", "b+", "a+", "c+", "b+")]
    states = [compiler.state_for(s) for s in specs]
    # The second "a+" is a hit; "c+" evicts "b+" (least recently used), which compiles again.
    assert compiler.num_compiled == 4
    assert len({id(s.matcher) for s in states}) == len(states)  # each request its own matcher
    same = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA))]
    assert same[0].cache_key == same[1].cache_key


def test_preemption_and_chunked_prefill_keep_the_matcher_in_step():
    prompts, _ = random_workload(8, seed=5, lengths=(30, 50, 70))
    kinds = ["json", "regex", "grammar", "json"] * 2
    params = [constrained(SPECS[k]) for k in kinds]
    roomy = make_engine().generate(prompts, params)
    tight = make_engine(
        num_gpu_blocks_override=60, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    squeezed = tight.generate(prompts, [constrained(SPECS[k]) for k in kinds])
    assert tight.scheduler.num_preemptions > 0
    for kind, a, b in zip(kinds, roomy, squeezed):
        assert b.token_ids == a.token_ids
        check(kind, b.text)
    assert tight.block_manager.num_used_blocks == 0


def test_constrained_requests_never_speculate_and_match_plain_decoding():
    prompts = [([300, 301, 302] * 8)[:20], ([900, 901] * 9)[:17]]
    free = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    plain = make_engine().generate(prompts, [constrained(SPECS["json"]), free])
    spec_engine = make_engine(speculative_method="ngram", num_speculative_tokens=4)
    seen_drafts = []
    original = spec_engine._propose

    def propose(reqs):
        original(reqs)
        seen_drafts.extend((r.grammar is not None, bool(r.spec_token_ids)) for r in reqs)

    spec_engine._propose = propose
    fast = spec_engine.generate(prompts, [constrained(SPECS["json"]), free])
    assert [r.token_ids for r in fast] == [r.token_ids for r in plain]
    assert (True, True) not in seen_drafts  # no constrained request ever got drafts
    assert spec_engine.stats.spec_draft_tokens > 0  # the free one did speculate
    check("json", fast[0].text)


# ------------------------------------------------------------------ request shapes
def s(text: str) -> np.ndarray:
    return np.array([text.encode()], dtype=object)


def spec_of(inputs: dict, parameters=None) -> StructuredOutputsParams:
    return parse_request({"text_input": s("hi"), **inputs}, parameters).params.structured_outputs


@pytest.mark.parametrize(
    "sampling, expected",
    [
        ({"structured_outputs": {"regex": "[0-9]+"}}, StructuredOutputsParams(regex="[0-9]+")),
        (
            {"structured_outputs": json.dumps({"choice": ["a", "b"]})},
            StructuredOutputsParams(choice=("a", "b")),
        ),
        (
            {"guided_decoding": {"json": SCHEMA, "backend": "xgrammar"}},
            StructuredOutputsParams(json=SCHEMA),
        ),
        (
            {"guided_json": SCHEMA, "guided_whitespace_pattern": " ?"},
            StructuredOutputsParams(json=SCHEMA, whitespace_pattern=" ?"),
        ),
        (
            {"guided_regex": "x+", "guided_decoding_backend": "outlines"},
            StructuredOutputsParams(regex="x+"),
        ),
        ({"guided_choice": ["a"]}, StructuredOutputsParams(choice=("a",))),
        ({"guided_grammar": GRAMMAR}, StructuredOutputsParams(grammar=GRAMMAR)),
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": SCHEMA},
                }
            },
            StructuredOutputsParams(json=SCHEMA),
        ),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_vllm_request_shapes_become_structured_outputs(sampling, expected):
    assert spec_of({"sampling_parameters": s(json.dumps(sampling))}) == expected
    assert spec_of({}, sampling) == expected  # HTTP generate "parameters" too


@pytest.mark.parametrize(
    "guide_type, guide, expected",
    [
        ("json_schema", json.dumps(SCHEMA), StructuredOutputsParams(json=json.dumps(SCHEMA))),
        ("json", None, StructuredOutputsParams(json={"type": ["object", "array"]})),
        ("regex", r"\d+", StructuredOutputsParams(regex=r"\d+")),
        ("ebnf_grammar", "root ::= [0-9]+", StructuredOutputsParams(grammar="root ::= [0-9]+")),
    ],
)
def test_trtllm_guided_decoding_inputs_become_structured_outputs(guide_type, guide, expected):
    inputs = {"guided_decoding_guide_type": s(guide_type)}
    if guide is not None:
        inputs["guided_decoding_guide"] = s(guide)
    assert spec_of(inputs) == expected


@pytest.mark.parametrize(
    "inputs, parameters, message",
    [
        (
            {"guided_decoding_guide_type": s("xml")},
            None,
            "guided_decoding_guide_type must be one of",
        ),
        ({"guided_decoding_guide_type": s("regex")}, None, "needs a 'guided_decoding_guide'"),
        ({"guided_decoding_guide": s("x")}, None, "needs 'guided_decoding_guide_type'"),
        (
            {"guided_decoding_guide_type": s("regex"), "guided_decoding_guide": s("x")},
            {"guided_regex": "y"},
            "structured outputs are given more than once",
        ),
        (
            {},
            {"guided_json": SCHEMA, "guided_regex": "y"},
            "You can only use one kind of structured outputs constraint",
        ),
        ({}, {"response_format": {"type": "yaml"}}, "response_format type must be"),
    ],
)
def test_malformed_structured_requests_are_bad_requests(inputs, parameters, message):
    with pytest.raises(BadRequestError, match=re.escape(message)):
        spec_of(inputs, parameters)
