"""vLLM's sampling parameters beyond the basics, in the engine, against Hugging Face logits.

Each constrained greedy run is checked step by step against the tiny model's own logits with
the same constraint applied (``hf_constrained_greedy``), so a constraint applied at the wrong
time, to the wrong row or not at all fails here.
"""

from __future__ import annotations

import pytest
import torch

from slipstream import EngineConfig, SamplingParams
from slipstream.core.request import TokenLogprob
from slipstream.engine import LLMEngine
from support import SAMPLERS, engine_with_sampler, hf_greedy, reference_model, tiny_model_dir

PROMPT = [1200, 305, 7781, 42, 999, 15000, 23]
GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module", params=SAMPLERS)
def engine(request, tier_device) -> LLMEngine:
    return engine_with_sampler(
        request.param,
        tier_device,
        lambda device: LLMEngine(
            EngineConfig(
                model=str(tiny_model_dir("llama")),
                block_size=4,
                max_num_batched_tokens=64,
                max_num_seqs=8,
                max_model_len=256,
                num_gpu_blocks_override=200,
                **device,
            )
        ),
    )


def hf_constrained_greedy(prompt: list, steps: int, adjust) -> list:
    """Greedy decoding where ``adjust(logits, generated)`` edits each step's logits."""
    model = reference_model(tiny_model_dir("llama"))
    generated: list = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + generated])).logits[0, -1].float()
            adjust(logits, generated)
            generated.append(int(logits.argmax()))
    return generated


def run(engine: LLMEngine, prompt=PROMPT, **params):
    return engine.generate([prompt], SamplingParams(**{**GREEDY, **params}))[0]


def test_allowed_token_ids_restrict_greedy_choice(engine):
    allowed = [300, 301, 5000, 7781, 12345]
    out = run(engine, max_tokens=6, allowed_token_ids=allowed)

    def only_allowed(logits, _):
        mask = torch.full_like(logits, float("-inf"))
        mask[allowed] = 0
        logits += mask

    assert out.token_ids == hf_constrained_greedy(PROMPT, 6, only_allowed)
    assert set(out.token_ids) <= set(allowed)


def test_logit_bias_is_added_before_the_choice(engine):
    bias = {4242: 100.0, 17: -100.0}
    out = run(engine, max_tokens=5, logit_bias={"4242": 100, "17": -250})  # clamped to +-100

    def biased(logits, _):
        for token, b in bias.items():
            logits[token] += b

    assert out.token_ids == hf_constrained_greedy(PROMPT, 5, biased) == [4242] * 5


def test_bad_words_ban_their_last_token_after_their_prefix(engine):
    plain = hf_greedy(tiny_model_dir("llama"), PROMPT, 8)
    word = engine.tokenizer.decode(plain[2:4])  # a two-token stretch the model would produce
    out = run(engine, max_tokens=8, bad_words=[word])
    sequences = (
        engine.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"],
        engine.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"],
    )

    def ban(logits, generated):
        for seq in sequences:
            if len(seq) == 1 or generated[len(generated) - len(seq) + 1 :] == seq[:-1]:
                logits[seq[-1]] = float("-inf")

    assert out.token_ids == hf_constrained_greedy(PROMPT, 8, ban)
    assert out.token_ids != plain


def test_min_p_one_keeps_only_the_most_likely_token(engine):
    greedy = run(engine, max_tokens=6)
    sampled = run(engine, max_tokens=6, temperature=1.0, min_p=1.0, seed=3)
    assert sampled.token_ids == greedy.token_ids


def test_logprobs_carry_rank_and_top_alternatives(engine):
    out = run(engine, max_tokens=3, logprobs=4)
    model = reference_model(tiny_model_dir("llama"))
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + out.token_ids])).logits[0].float()
    expected = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs)):
        assert isinstance(lp, TokenLogprob) and lp.rank == 1  # greedy picks the top token
        assert float(lp) == pytest.approx(float(expected[step, token]), abs=1e-4)
        ids = [t for t, _ in lp.top]
        assert ids == expected[step].topk(4).indices.tolist() and ids[0] == token
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    unasked = run(engine, max_tokens=2)
    assert not isinstance(unasked.logprobs[0], TokenLogprob)


def test_rank_of_a_token_forced_by_logit_bias(engine):
    out = run(engine, max_tokens=1, logprobs=0, logit_bias={"4242": 100})
    lp = out.logprobs[0]
    assert out.token_ids == [4242] and lp.top == ()
    model = reference_model(tiny_model_dir("llama"))
    with torch.no_grad():
        raw = torch.log_softmax(model(torch.tensor([PROMPT])).logits[0, -1].float(), -1)
    assert lp.rank == int((raw >= raw[4242]).sum()) > 1  # raw logprobs: bias not included


def test_include_stop_str_in_output(engine):
    text = run(engine, max_tokens=10).text
    stop = text[3:6]
    cut = run(engine, max_tokens=10, stop=[stop])
    kept = run(engine, max_tokens=10, stop=[stop], include_stop_str_in_output=True)
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and text.startswith(kept.text)


def test_stop_token_text_is_left_out_unless_asked(engine):
    tokens = run(engine, max_tokens=6).token_ids
    stop_id = tokens[3]
    out = run(engine, max_tokens=6, stop_token_ids=[stop_id])
    with_it = run(engine, max_tokens=6, stop_token_ids=[stop_id], include_stop_str_in_output=True)
    assert out.token_ids == with_it.token_ids == tokens[:4]
    assert out.text == engine.tokenizer.decode(tokens[:3])
    assert with_it.text == engine.tokenizer.decode(tokens[:4])


def test_skip_special_tokens_false_keeps_them_in_the_text(engine):
    special = engine.tokenizer.convert_tokens_to_ids("<|im_start|>")
    forced = {str(special): 100}
    assert "<|im_start|>" not in run(engine, max_tokens=2, logit_bias=forced).text
    assert (
        run(engine, max_tokens=2, logit_bias=forced, skip_special_tokens=False).text
        == "<|im_start|>" * 2
    )


def test_truncate_prompt_tokens_keeps_the_last_tokens(engine):
    out = run(engine, max_tokens=4, truncate_prompt_tokens=3)
    assert out.num_prompt_tokens == 3
    assert out.token_ids == hf_greedy(tiny_model_dir("llama"), PROMPT[-3:], 4)


def test_detokenize_false_gives_tokens_without_text(engine):
    out = run(engine, max_tokens=4, detokenize=False)
    assert out.text == "" and out.token_ids == run(engine, max_tokens=4).token_ids


@pytest.mark.parametrize(
    "params, message",
    [
        ({"allowed_token_ids": [10**7]}, "allowed_token_ids contains out-of-vocab token id!"),
        ({"logit_bias": {"99999999": 1}}, "in logit_bias contain out-of-vocab token ids"),
        ({"allowed_token_ids": []}, "non-empty"),
        ({"min_p": 1.5}, "min_p must be in [0, 1]"),
        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
        ({"detokenize": False, "stop": ["x"]}, "only supported when detokenize is True"),
    ],
)
def test_invalid_extensions_are_refused_at_submission(engine, params, message):
    with pytest.raises(ValueError) as err:
        engine.make_request(PROMPT, SamplingParams.from_dict(params))
    assert message in str(err.value)
