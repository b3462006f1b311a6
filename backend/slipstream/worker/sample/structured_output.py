"""Structured outputs: grammars compiled with llguidance, a matcher per request, and the
token masks the batched sampler applies.

* ``GrammarCompiler`` turns a request's ``StructuredOutputsParams`` into a matcher. It runs
  where requests are made (the client or tokenizer thread, never the engine step), refuses an
  invalid schema, regex or grammar with a ``ValueError`` for that request alone, and keeps a
  bounded LRU of compiled grammars: a request whose spec was seen before gets a copy of the
  compiled matcher (microseconds) instead of a compile.
* ``GrammarState`` is one request's matcher and how many of its output tokens it has accepted.
  It is brought up to date from the request's own tokens just before each mask is computed, so
  whatever happened in between (chunked prefill, preemption and recompute, swap, a retried
  step) cannot put it out of step: the output tokens are the only truth.
* ``apply_grammar_masks`` fills one bitmask for the batch's constrained rows and masks only
  those rows; free rows are not touched (their logits stay bit for bit the same).

When the grammar is complete the mask allows only EOS, so the request ends as ``stop`` on the
next token, exactly like an unconstrained request that chose EOS (its text excludes it).
llguidance's parser limits bound the work of one mask (vLLM's "guidance" backend uses the same
library with the same defaults).
"""

from __future__ import annotations

import copy
import json
import os
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from slipstream.core.structured_outputs import GuideKind, StructuredOutputsParams

DEFAULT_CACHE_SIZE = 128  # distinct compiled grammars kept


class GrammarUnavailableError(ValueError):
    """llguidance is not installed: structured outputs are refused per request."""


@dataclass
class GrammarState:
    matcher: Any  # llguidance.LLMatcher
    consumed: int = 0  # output tokens the matcher has accepted

    def copy(self) -> "GrammarState":
        """An independent matcher at the same point (a forked sequence follows the grammar
        on its own)."""
        return GrammarState(self.matcher.deep_copy(), self.consumed)

    def sync(self, req) -> None:
        """Accept the request's output tokens the matcher has not seen yet."""
        out_start = req.num_prompt_tokens
        num_out = req.num_tokens - out_start
        if num_out < self.consumed:  # tokens taken back (never without speculation)
            self.matcher.rollback(self.consumed - num_out)
            self.consumed = num_out
        for token in req.all_token_ids[out_start + self.consumed :]:
            if not self.matcher.consume_token(token):
                raise ValueError(
                    f"token {token} does not follow the request's grammar: "
                    f"{self.matcher.get_error()}"
                )
            self.consumed += 1


class GrammarCompiler:
    """Compiles and caches grammars for one tokenizer; safe to call from several threads."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_id: Optional[int],
        cache_size: int = DEFAULT_CACHE_SIZE,
    ) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._cache_size = cache_size
        self._cache: OrderedDict = OrderedDict()  # cache_key -> compiled template matcher
        self._lock = threading.Lock()
        self._lltokenizer = None
        self.num_compiled = 0  # compiles done (cache misses), for tests and stats

    def state_for(self, spec: StructuredOutputsParams) -> GrammarState:
        return GrammarState(self.compiled(spec).deep_copy())

    def compiled(self, spec: StructuredOutputsParams):
        key = spec.cache_key
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
        # Outside the lock, on the low-priority compile thread: a big schema holds up only
        # the request that sent it (the caller waits), not the engine's step.
        matcher = _COMPILE_POOL.submit(self._compile, spec).result()
        with self._lock:
            self._cache[key] = matcher
            self.num_compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return matcher

    def _compile(self, spec: StructuredOutputsParams):
        llguidance = _import_llguidance()
        try:
            grammar = grammar_definition(spec)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid {_what(spec.kind)}: {e}") from None
        limits = llguidance.LLParserLimits(verbose_errors=False)
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, limits=limits)
        if not matcher.is_error():
            matcher.compute_bitmask()  # builds the lexer's first states here, not in a step
        if matcher.is_error():
            raise ValueError(f"invalid {_what(spec.kind)}: {matcher.get_error()}")
        return matcher

    def _llg_tokenizer(self):
        with self._lock:
            if self._lltokenizer is None:
                import llguidance.hf

                self._lltokenizer = llguidance.hf.from_tokenizer(
                    self._tokenizer, n_vocab=self._vocab_size, eos_token=self._eos_token_id
                )
            return self._lltokenizer


def _lowest_priority() -> None:
    """Make the calling thread the last the OS schedules (nice 19; Linux threads each have
    their own): while a grammar compiles, the engine's torch threads keep their cores."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at normal priority
        pass


_COMPILE_POOL = ThreadPoolExecutor(
    max_workers=1, thread_name_prefix="grammar-compile", initializer=_lowest_priority
)


def grammar_definition(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text for a spec (vLLM's "guidance" backend's choices)."""
    llguidance = _import_llguidance()
    options: dict[str, Any] = {"whitespace_flexible": not spec.disable_any_whitespace}
    if spec.whitespace_pattern is not None:
        options["whitespace_pattern"] = spec.whitespace_pattern
    kind = spec.kind
    if kind is GuideKind.JSON:
        schema = json.loads(spec.json) if isinstance(spec.json, str) else spec.json
        if not isinstance(schema, (dict, bool)):
            raise ValueError("a JSON schema must be an object")
        if spec.disable_additional_properties:
            schema = without_additional_properties(schema)
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=options)
    if kind is GuideKind.JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=options)
    if kind is GuideKind.CHOICE:
        assert spec.choice is not None  # the kind says so
        return llguidance.grammar_from("choice", json.dumps(list(spec.choice)))
    if kind is GuideKind.REGEX:
        return llguidance.grammar_from("regex", spec.regex)
    return llguidance.grammar_from("grammar", spec.grammar)


def without_additional_properties(schema: Any) -> Any:
    """A copy where every object schema that does not say otherwise forbids unlisted keys."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            if (
                node.get("type") == "object" or "properties" in node
            ) and "additionalProperties" not in node:
                node["additionalProperties"] = False
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)
    return schema


@dataclass
class GrammarMasks:
    """The allowed tokens of a batch's constrained rows, as llguidance computes them."""

    rows: list[int]  # rows with a grammar whose mask was computed
    bitmask: np.ndarray  # [len(rows), words] int32: bit t of a row's little-endian words = t
    failures: dict[int, str]  # rows whose request no longer follows its grammar -> message

    def blocked(self, vocab: int) -> np.ndarray:
        """[len(rows), vocab] bool: the tokens each row may not take."""
        bits = np.unpackbits(self.bitmask.view(np.uint8), axis=1, bitorder="little")
        return bits[:, :vocab] == 0


def grammar_masks(reqs: list, vocab: int) -> Optional[GrammarMasks]:
    """Bring each constrained request's matcher up to date and compute its mask (None: no row
    has a grammar). A request whose tokens no longer follow its grammar is reported in
    ``failures``, not masked. Raises ``ValueError`` when a constrained request owns several
    rows (draft verification)."""
    rows = [i for i, r in enumerate(reqs) if getattr(r, "grammar", None) is not None]
    if not rows:
        return None
    if len({id(reqs[i]) for i in rows}) != len(rows):
        raise ValueError("a request with structured outputs cannot verify draft tokens")
    failures: dict[int, str] = {}
    synced = []
    for i in rows:
        try:
            reqs[i].grammar.sync(reqs[i])
        except ValueError as e:
            failures[i] = str(e)
            continue
        synced.append(i)
    bitmask = np.full((len(synced), (vocab + 31) // 32), -1, dtype=np.int32)
    matchers = [(reqs[i].grammar.matcher, n) for n, i in enumerate(synced)]
    if matchers:
        _fill_bitmask(matchers, bitmask)
    kept = []
    for n, i in enumerate(synced):
        matcher = reqs[i].grammar.matcher
        if matcher.is_error():
            failures[i] = f"structured output failed: {matcher.get_error()}"
        else:
            kept.append(n)
    return GrammarMasks([synced[n] for n in kept], bitmask[kept], failures)


def apply_grammar_masks(logits: torch.Tensor, reqs: list) -> None:
    """Mask, in place, the rows of requests that carry a grammar (``req.grammar``): one
    bitmask tensor for those rows, the other rows untouched. Raises ``ValueError`` when a
    request's tokens no longer follow its grammar (the sampler then fails that request)."""
    masks = grammar_masks(reqs, logits.shape[-1])
    if masks is None:
        return
    if masks.failures:
        raise ValueError(next(iter(masks.failures.values())))
    # numpy, in place, one row at a time: a few torch ops over the batch cost ~25x more on a
    # loaded 2-core machine (each one waits for torch's whole thread pool).
    blocked = masks.blocked(logits.shape[-1])
    view = logits.numpy()
    for n, i in enumerate(masks.rows):
        np.copyto(view[i], -np.inf, where=blocked[n])


_EXECUTOR: list[Any] = []  # one llguidance thread pool, made on first use


def _fill_bitmask(matchers: list, bitmask: np.ndarray) -> None:
    """Each ``(matcher, row)``'s allowed tokens into ``bitmask[row]`` (bit t of the row's
    little-endian int32 words = token t); several rows are computed in parallel by
    llguidance's native threads. (``llguidance.torch`` is not imported: its module-level
    torch.compile fails inside Triton's Python stub, and its apply is a compiled kernel.)"""
    row_bytes = bitmask.shape[1] * 4
    base = bitmask.ctypes.data
    if len(matchers) == 1:
        matcher, row = matchers[0]
        matcher.unsafe_compute_mask_ptr(base + row * row_bytes, row_bytes)
        return
    if not _EXECUTOR:
        import llguidance

        _EXECUTOR.append(llguidance.LLExecutor())
    _EXECUTOR[0].unsafe_compute_mask_ptr(matchers, base, row_bytes, len(matchers))


def _what(kind: GuideKind) -> str:
    return {
        GuideKind.JSON: "JSON schema",
        GuideKind.REGEX: "regex",
        GuideKind.CHOICE: "choice",
        GuideKind.GRAMMAR: "grammar",
        GuideKind.JSON_OBJECT: "JSON object",
    }[kind]


def _import_llguidance():
    try:
        import llguidance
    except ImportError:
        raise GrammarUnavailableError(
            "structured outputs need the llguidance package (pip install 'slipstream[structured]')"
        ) from None
    return llguidance
