"""Benchmark workloads: prompts of exact token lengths, exact output lengths, arrival times.

Prompts are text (the server only takes text) built from whole-word vocabulary tokens
(" word" tokens of a byte-level BPE), so the text tokenizes back to exactly the tokens it
was built from and every path (Triton, in-process, Hugging Face) sees the same prompt
length. Outputs have exact lengths because every run ignores EOS.

A length distribution is a string, components joined by ``+``, each optionally weighted
(``W*``): ``uniform:LO:HI`` or ``fixed:N``. A mixture assigns each component exactly its
share of the requests (largest remainder), shuffled with the seed, so "a few long outputs"
is the same few in every run of the same seed.

Decoding is greedy unless a ``SamplingMix`` gives the requests sampling parameters
(``BenchRequest.sampling``: SamplingParams fields that every path sends as they are; a share
may stay greedy, and sampled requests may each get a seed of their own).
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

DEFAULT_PROMPT_LENS = "uniform:16:256"
# Skewed like chat traffic: most answers short, a few long ones that pin a static batch.
DEFAULT_OUTPUT_LENS = "0.875*uniform:16:64+0.125*uniform:256:512"
WORKLOAD_VERSION = 1


@dataclass
class BenchRequest:
    id: str
    prompt: str
    prompt_len: int  # tokens, as the engine's tokenizer counts them
    max_tokens: int  # exact output length (EOS ignored)
    # SamplingParams fields besides the lengths (temperature, top_p, seed, ...); None: greedy
    sampling: Optional[dict] = None

    def sampling_fields(self) -> dict:
        """What every path sends besides the exact length: greedy unless sampled."""
        return dict(self.sampling) if self.sampling else {"temperature": 0.0}


@dataclass
class SamplingMix:
    """How the requests decode: ``greedy_fraction`` of them greedily (exactly that share,
    chosen with the workload's seed), the rest with these parameters (defaults are off);
    ``seeded``: each sampled request gets a seed of its own."""

    temperature: float = 0.0  # 0: every request greedy
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seeded: bool = False
    greedy_fraction: float = 0.0

    @property
    def sampled(self) -> bool:
        return self.temperature > 0.0 and self.greedy_fraction < 1.0

    def fields(self) -> dict:
        """The SamplingParams fields that differ from off (a peer gets only those)."""
        out: dict = {"temperature": self.temperature}
        for name, off in (
            ("top_p", 1.0),
            ("top_k", 0),
            ("min_p", 0.0),
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
        ):
            if getattr(self, name) != off:
                out[name] = getattr(self, name)
        return out


def apply_sampling(workload: "Workload", mix: SamplingMix, seed: int = 0) -> "Workload":
    """``workload`` with each request's sampling set from ``mix`` (in place; returned)."""
    if not mix.sampled:
        for req in workload.requests:
            req.sampling = None
        workload.description.pop("sampling", None)
        return workload
    n = len(workload)
    rng = random.Random(seed + 2_000_003)  # independent of the lengths and the arrivals
    greedy = set(rng.sample(range(n), round(mix.greedy_fraction * n)))
    for i, req in enumerate(workload.requests):
        if i in greedy:
            req.sampling = None
            continue
        req.sampling = mix.fields()
        if mix.seeded:
            req.sampling["seed"] = seed * 1_000_003 + i
    workload.description["sampling"] = {
        **mix.fields(),
        "seeded": mix.seeded,
        "greedy_fraction": mix.greedy_fraction,
    }
    return workload


@dataclass
class Workload:
    requests: list
    seed: int = 0
    description: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def total_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def total_prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def sampled(self) -> bool:
        return any(r.sampling for r in self.requests)

    def save(self, path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        body = {
            "version": WORKLOAD_VERSION,
            "seed": self.seed,
            "description": self.description,
            "requests": [asdict(r) for r in self.requests],
        }
        path.write_text(json.dumps(body, indent=1))
        return path

    @classmethod
    def load(cls, path) -> "Workload":
        body = json.loads(Path(path).read_text())
        reqs = [BenchRequest(**r) for r in body["requests"]]
        if not reqs:
            raise ValueError(f"workload {path} has no requests")
        return cls(reqs, body.get("seed", 0), body.get("description", {}))

    def prompt_ids(self, tokenizer) -> list:
        """Token ids exactly as the engine tokenizes the text (HF baselines send ids)."""
        return [tokenizer(r.prompt)["input_ids"] for r in self.requests]


# ------------------------------------------------------------------------ distributions
@dataclass
class Component:
    weight: float
    kind: str  # "uniform" or "fixed"
    lo: int
    hi: int

    def sample(self, rng: random.Random) -> int:
        return self.lo if self.kind == "fixed" else rng.randint(self.lo, self.hi)


def parse_distribution(spec: str) -> list:
    comps = []
    for part in spec.replace(" ", "").split("+"):
        m = re.fullmatch(r"(?:([0-9.]+)\*)?(uniform:(\d+):(\d+)|fixed:(\d+))", part)
        if not m:
            raise ValueError(
                f"bad length distribution component {part!r} in {spec!r} "
                "(want [W*]uniform:LO:HI or [W*]fixed:N)"
            )
        weight = float(m.group(1) or 1.0)
        if m.group(5) is not None:
            lo = hi = int(m.group(5))
            kind = "fixed"
        else:
            lo, hi, kind = int(m.group(3)), int(m.group(4)), "uniform"
        if lo <= 0 or hi < lo or weight <= 0:
            raise ValueError(
                f"bad length distribution component {part!r}: need 0 < LO <= HI, W > 0"
            )
        comps.append(Component(weight, kind, lo, hi))
    return comps


def sample_lengths(spec: str, n: int, rng: random.Random) -> list:
    comps = parse_distribution(spec)
    total = sum(c.weight for c in comps)
    shares = [c.weight / total * n for c in comps]
    counts = [math.floor(s) for s in shares]
    by_remainder = sorted(range(len(comps)), key=lambda i: shares[i] - counts[i], reverse=True)
    for i in by_remainder[: n - sum(counts)]:
        counts[i] += 1
    which = [i for i, c in enumerate(counts) for _ in range(c)]
    rng.shuffle(which)
    return [comps[i].sample(rng) for i in which]


# ------------------------------------------------------------------------ prompt text
class PromptBuilder:
    """Text of an exact token length from single-token " word" pieces of the vocabulary."""

    def __init__(self, tokenizer, max_words: int = 4000) -> None:
        self.tokenizer = tokenizer
        self.num_special = len(tokenizer("")["input_ids"])  # e.g. a BOS the tokenizer adds
        self.words = self._single_token_words(max_words)
        if len(self.words) < 50:
            raise ValueError(
                "the tokenizer has too few single-token ' word' pieces to build "
                "prompts of exact length; pass a workload file instead"
            )

    def _single_token_words(self, limit: int) -> list:
        vocab = sorted(self.tokenizer.get_vocab().items(), key=lambda kv: kv[1])
        words = []
        for piece, _ in vocab:
            text = self.tokenizer.convert_tokens_to_string([piece])
            if (
                re.fullmatch(r" [a-z]{3,10}", text)
                and len(self.tokenizer(text, add_special_tokens=False)["input_ids"]) == 1
            ):
                words.append(text)
                if len(words) >= limit:
                    break
        return words

    def build(self, num_tokens: int, rng: random.Random, prefix: str = "") -> tuple:
        """(text, actual token count) of ``prefix`` + random words, aiming at ``num_tokens``."""
        have = self.count(prefix) if prefix else self.num_special
        for _ in range(5):  # rare merges across words: retry with other words
            text = prefix + "".join(
                rng.choice(self.words) for _ in range(max(num_tokens - have, 1))
            )
            got = self.count(text)
            if got == num_tokens:
                break
        return text, got

    def count(self, text: str) -> int:
        return len(self.tokenizer(text)["input_ids"])


# ------------------------------------------------------------------------ workloads
def generate_workload(
    tokenizer,
    num_requests: int = 64,
    seed: int = 0,
    prompt_lens: str = DEFAULT_PROMPT_LENS,
    output_lens: str = DEFAULT_OUTPUT_LENS,
) -> Workload:
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer)
    p_lens = sample_lengths(prompt_lens, num_requests, rng)
    o_lens = sample_lengths(output_lens, num_requests, rng)
    reqs = []
    for i, (p, o) in enumerate(zip(p_lens, o_lens)):
        text, got = builder.build(p, rng)
        reqs.append(BenchRequest(f"r{i:04d}", text, got, o))
    desc = {"kind": "generated", "prompt_lens": prompt_lens, "output_lens": output_lens}
    return Workload(reqs, seed, desc)


def shared_prefix_workload(
    tokenizer,
    num_requests: int = 32,
    seed: int = 0,
    system_len: int = 512,
    suffix_lens: str = "uniform:16:48",
    output_lens: str = "fixed:32",
) -> Workload:
    """Every prompt = one long shared system prompt + its own short question."""
    rng = random.Random(seed)
    builder = PromptBuilder(tokenizer)
    system, sys_len = builder.build(system_len, rng)
    s_lens = sample_lengths(suffix_lens, num_requests, rng)
    o_lens = sample_lengths(output_lens, num_requests, rng)
    reqs = []
    for i, (s, o) in enumerate(zip(s_lens, o_lens)):
        text, got = builder.build(sys_len + s, rng, prefix=system)
        reqs.append(BenchRequest(f"p{i:04d}", text, got, o))
    desc = {
        "kind": "shared_prefix",
        "system_len": sys_len,
        "suffix_lens": suffix_lens,
        "output_lens": output_lens,
    }
    return Workload(reqs, seed, desc)


def arrival_times(n: int, rate: float, seed: int = 0) -> list:
    """Send offsets in seconds: all zero for rate=inf (offline), else a Poisson process."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"rate must be positive (requests/s) or inf, got {rate}")
    rng = random.Random(seed + 1_000_003)  # independent of the lengths drawn with seed
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def scaled(
    workload: Workload, num_requests: Optional[int] = None, max_output: Optional[int] = None
) -> Workload:
    """A smaller copy (smoke runs): the first requests, outputs capped."""
    reqs = workload.requests[:num_requests] if num_requests else list(workload.requests)
    if max_output:
        reqs = [
            BenchRequest(r.id, r.prompt, r.prompt_len, min(r.max_tokens, max_output), r.sampling)
            for r in reqs
        ]
    return Workload(reqs, workload.seed, dict(workload.description))


def lengths_summary(workload: Workload) -> dict:
    def stats(values: Sequence[int]) -> dict:
        return {
            "min": min(values),
            "max": max(values),
            "mean": sum(values) / len(values),
            "total": sum(values),
        }

    return {
        "num_requests": len(workload),
        "prompt_tokens": stats([r.prompt_len for r in workload.requests]),
        "output_tokens": stats([r.max_tokens for r in workload.requests]),
    }
