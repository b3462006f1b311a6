"""Shared by the tensor-parallel tests on the embedded model: its prompts, the one-rank
reference, and the teacher-forced check that tells a flipped near-tie from an error."""

from __future__ import annotations

from dataclasses import dataclass

from slipstream import EngineConfig, SamplingParams

TOPICS = [
    "the history of Rome",
    "how bees make honey",
    "a recipe for bread",
    "the French revolution",
    "black holes",
    "learning to swim",
    "the water cycle",
    "the printing press",
    "a trip to Japan",
    "photosynthesis",
    "the rules of chess",
    "volcanoes",
    "the life of Mozart",
    "machine learning",
    "the Great Wall of China",
    "why the sky is blue",
]
PROMPTS = [f"Write a short paragraph about {topic}." for topic in TOPICS]  # 16 prompts
MAX_TOKENS = 32  # each answers 32 tokens, greedily
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
AGREEMENT = 0.995  # of teacher-forced positions, where a sum's order flipped a near-tie


def embedded_config(**more) -> EngineConfig:
    return EngineConfig(max_model_len=512, kv_cache_memory_bytes=64 * 2**20, **more)


@dataclass
class Answers:
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    texts: list[str]


def greedy_answers(engine) -> Answers:
    """The engine's greedy answers to ``PROMPTS`` (as raw text prompts)."""
    outs = engine.generate(PROMPTS, GREEDY)
    return Answers(
        [engine.tokenize(p) for p in PROMPTS],
        [o.token_ids for o in outs],
        [o.text for o in outs],
    )


def teacher_forced_agreement(engine, answers: Answers) -> float:
    """The share of ``answers``' tokens that ``engine`` also ranks first when each prompt is
    followed by those tokens (teacher forcing: one divergence does not carry on)."""
    forced = [p + t for p, t in zip(answers.prompt_ids, answers.token_ids)]
    outs = engine.generate(forced, SamplingParams(max_tokens=1, prompt_logprobs=0))
    agree = total = 0
    for prompt, full, out in zip(answers.prompt_ids, forced, outs):
        assert out.prompt_logprobs is not None
        for position in range(len(prompt), len(full)):
            total += 1
            agree += out.prompt_logprobs[position][full[position]].rank == 1
    return agree / total
