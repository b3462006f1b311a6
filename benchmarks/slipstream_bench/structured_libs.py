"""Grammar libraries compared on CPU: compile time and per-token mask cost.

For xgrammar, llguidance and outlines-core, with the default model's 49,152-token tokenizer:
the time to compile a JSON schema and a regex, then the time per generated token of
"fill this request's bitmask row + advance the matcher by the chosen token", along a walk
that picks a random allowed token at each step (the same seed for every library).

    python -m slipstream_bench.structured_libs [--steps 64] [--repeats 3]

Libraries that are not installed are skipped. Used to choose the library behind
``slipstream.worker.sample.structured_output`` (docs/structured_outputs.md has the figures).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
        "active": {"type": "boolean"},
    },
    "required": ["name", "age", "email", "tags", "address", "active"],
    "additionalProperties": False,
}
REGEX = (
    r"(\+1 )?\(?[0-9]{3}\)? [0-9]{3}-[0-9]{4}( ext\. [0-9]{1,5})?"
    r"|[a-z]{3,12}@[a-z]{3,10}\.(com|org|net)"
)


@dataclass
class Figure:
    library: str
    spec: str
    compile_ms: float
    step_us: float  # fill mask + advance, per token (median over repeats)
    tokens: int


def _walk(
    fill: Callable, advance: Callable, done: Callable, vocab: int, steps: int, seed: int
) -> tuple:
    """Random allowed tokens until the grammar completes or ``steps``; returns (s, tokens)."""
    rng = torch.Generator().manual_seed(seed)
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    bits = torch.arange(32, dtype=torch.int32)
    n, spent = 0, 0.0
    while n < steps and not done():
        t0 = time.perf_counter()
        fill(bitmask)
        spent += time.perf_counter() - t0
        allowed = ((bitmask[0, :, None] >> bits) & 1).flatten()[:vocab].nonzero()[:, 0]
        if allowed.numel() == 0:
            break
        token = int(allowed[torch.randint(allowed.numel(), (1,), generator=rng)])
        t0 = time.perf_counter()
        advance(token)
        spent += time.perf_counter() - t0
        n += 1
    return spent, n


def _xgrammar(tokenizer, vocab: int):
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)

    def compile_(kind: str, spec: str):
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return (
            compiler.compile_json_schema(spec) if kind == "json" else compiler.compile_regex(spec)
        )

    def matcher(compiled):
        m = xgr.GrammarMatcher(compiled)
        return (lambda b: m.fill_next_token_bitmask(b, 0)), m.accept_token, m.is_terminated

    return compile_, matcher


def _llguidance(tokenizer, vocab: int):
    import llguidance
    import llguidance.hf
    import llguidance.torch

    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile_(kind: str, spec: str):
        grammar = (
            llguidance.LLMatcher.grammar_from_json_schema(spec)
            if kind == "json"
            else llguidance.LLMatcher.grammar_from_regex(spec)
        )
        m = llguidance.LLMatcher(lltok, grammar)  # the first matcher builds the lexer
        if m.is_error():
            raise ValueError(m.get_error())
        return grammar

    def matcher(grammar):
        m = llguidance.LLMatcher(lltok, grammar)
        return (
            (lambda b: llguidance.torch.fill_next_token_bitmask(m, b, 0)),
            m.consume_token,
            m.is_stopped,
        )

    return compile_, matcher


def _outlines(tokenizer, vocab: int):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from outlines_core.kernels.torch import fill_next_token_bitmask

    vocabulary = outlines_vocabulary(tokenizer, Vocabulary)

    def compile_(kind: str, spec: str):
        regex = build_regex_from_schema(spec) if kind == "json" else spec
        return Index(regex, vocabulary)

    def matcher(index):
        g = Guide(index)
        return (lambda b: fill_next_token_bitmask(g, b)), g.advance, g.is_finished

    return compile_, matcher


def outlines_vocabulary(tokenizer, vocabulary_cls):
    """outlines-core wants each token's bytes (byte-level BPE pieces decoded) minus EOS."""
    to_byte = {c: b for b, c in _byte_level_alphabet().items()}
    eos = tokenizer.eos_token_id
    pieces: dict = {}
    for piece, idx in tokenizer.get_vocab().items():
        if idx == eos or idx in tokenizer.all_special_ids:
            continue
        try:
            raw = bytes(to_byte[c] for c in piece)
        except KeyError:
            raw = piece.encode()
        pieces.setdefault(raw, []).append(idx)
    return vocabulary_cls(eos, pieces)


def _byte_level_alphabet() -> dict:
    """GPT-2's byte -> printable character map (byte-level BPE token pieces use it)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


LIBRARIES = {"xgrammar": _xgrammar, "llguidance": _llguidance, "outlines-core": _outlines}


def measure(tokenizer, vocab: int, steps: int, repeats: int) -> list:
    figures = []
    specs = {"json": json.dumps(SCHEMA), "regex": REGEX}
    for name, make in LIBRARIES.items():
        try:
            __import__({"outlines-core": "outlines_core"}.get(name, name))
        except ImportError:
            continue
        compile_, matcher = make(tokenizer, vocab)
        for kind, spec in specs.items():
            t0 = time.perf_counter()
            compiled = compile_(kind, spec)
            compile_ms = (time.perf_counter() - t0) * 1e3
            per_token, tokens = [], 0
            for r in range(repeats):
                spent, tokens = _walk(*matcher(compiled), vocab, steps, seed=r)
                per_token.append(spent / max(tokens, 1) * 1e6)
            figures.append(Figure(name, kind, compile_ms, statistics.median(per_token), tokens))
    return figures


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    from slipstream.worker.model.gguf import default_model_dir
    from slipstream.worker.model.loader import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir())
    vocab = len(tokenizer)
    random.seed(0)
    print(f"vocab {vocab}, torch threads {torch.get_num_threads()}")
    print(f"{'library':<14} {'spec':<6} {'compile ms':>11} {'us/token':>9} {'tokens':>6}")
    for f in measure(tokenizer, vocab, args.steps, args.repeats):
        print(f"{f.library:<14} {f.spec:<6} {f.compile_ms:>11.1f} {f.step_us:>9.1f} {f.tokens:>6}")


if __name__ == "__main__":
    main()
