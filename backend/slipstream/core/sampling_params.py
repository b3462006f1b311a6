"""Per-request sampling parameters (vLLM names and defaults).

Everything vLLM's ``SamplingParams`` accepts that a text model can honour is here; what needs
the tokenizer (``bad_words``) or the vocabulary size (``logit_bias``, ``allowed_token_ids``) is
resolved and range-checked when the engine makes the request (``worker.sampler.prepare``).

Validation refuses what the engine cannot compute, so that one request's values can never
fail a batched step that other requests share: values torch or float32 cannot represent,
and lists large enough to slow every step down (stop strings are checked on each token).
"""

from __future__ import annotations

import json
import math
import reprlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from slipstream.core.boolean_text import REQUEST, parse_bool
from slipstream.core.field_values import from_values
from slipstream.core.structured_outputs import StructuredOutputsParams

# A temperature below this is greedy (vLLM's _SAMPLING_EPS); one between it and
# MIN_SAMPLED_TEMPERATURE is raised to that, as vLLM does: logits / 1e-300 overflow float32
# and the softmax of infinities is NaN.
GREEDY_TEMPERATURE_EPS = 1e-5
MIN_SAMPLED_TEMPERATURE = 1e-2
# torch.Generator.manual_seed accepts [-2**63, 2**64 - 1] (negative seeds wrap around).
SEED_RANGE = (-(2**63), 2**64 - 1)
# Penalties divide or multiply float32 logits: outside float32's normal range they turn
# logits into 0 or inf.
FLOAT32_NORMAL_RANGE = (1.1754943508222875e-38, 3.4028234663852886e38)
MAX_STOP_STRINGS = 64
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
# Sequences one request may generate (n, best_of): each is a running sequence of its own.
MAX_PARALLEL_SEQUENCES = 64


def show(value: Any) -> str:
    """A value for an error message: bounded in length, safe for deeply nested data."""
    return _SHORT.repr(value)


_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 3, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = 8


def _check_integer(params: "SamplingParams", name: str, low: int) -> None:
    value = getattr(params, name)
    if not isinstance(value, int) or isinstance(value, bool) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {show(value)}")


def _check_number(
    params: "SamplingParams", name: str, ok: Callable[[float], bool], rule: str
) -> None:
    """A finite number within ``rule`` (``ok``), stored as a float."""
    value = getattr(params, name)
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or not ok(value)
    ):
        raise ValueError(f"{name} must be {rule}, got {show(value)}")
    setattr(params, name, float(value))


# What beam search refuses (sampling truncations it does not apply): name, values meaning
# "off", the default a client should leave it at.
_BEAM_TRUNCATIONS: tuple[tuple[str, tuple[Any, ...], str], ...] = (
    ("top_k", (0, -1), "0 (or -1)"),
    ("top_p", (1.0,), "1.0"),
    ("min_p", (0.0,), "0.0"),
)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 or -1 = off
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None = off; N = the sampled token's logprob (+ top-N ids)
    use_speculation: bool = True  # opt out of speculative decoding for this request
    min_p: float = 0.0  # drop tokens below min_p x the most likely token's probability
    logit_bias: Optional[dict[int, float]] = (
        None  # token id -> bias added to its logit, in [-100, 100]
    )
    allowed_token_ids: Optional[list[int]] = None  # only these may be sampled
    bad_words: list[str] = field(
        default_factory=list
    )  # words whose last token is banned after the rest
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # keep the prompt's last k tokens (-1: max_model_len)
    truncate_prompt_tokens: Optional[int] = None
    prompt_logprobs: Optional[int] = None  # None = off; N = each prompt token's logprob + top-N
    n: int = 1  # sequences returned for the prompt (parallel sampling)
    best_of: Optional[int] = None  # sequences generated (>= n); the n most likely are returned
    detokenize: bool = True  # False: token ids only, empty text
    lora_name: Optional[str] = None  # the LoRA adapter to apply (engine's lora_modules name)
    # vLLM's cache_salt: mixed into the first block's prefix-cache hash, so only requests
    # with the same salt share cached KV (isolation between tenants).
    cache_salt: Optional[str] = None
    # The output must match a JSON schema / regex / choice / grammar (a dict with vLLM's
    # field names is accepted and converted).
    structured_outputs: Optional[StructuredOutputsParams] = None
    # Beam search (vLLM's former use_beam_search, TRT-LLM's beam_width): beam_width > 1 keeps
    # that many beams; use_beam_search=True takes the width from best_of, else n (vLLM's rule).
    # The n best finished beams are returned. length_penalty divides a finished beam's
    # cumulative logprob by (its length ** length_penalty); early_stopping: True ends the
    # search once beam_width beams have finished, False when no running beam can still beat
    # the worst finished one, "never" checks that against the longest possible length.
    use_beam_search: bool = False
    beam_width: int = 1
    length_penalty: float = 1.0
    early_stopping: Any = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, (list, tuple)):
                raise ValueError(f"{name} must be a list, got {show(value)}")
            setattr(self, name, list(value or []))
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.bad_words = list(self.bad_words or [])
        # Filled from bad_words by worker.sampler.prepare (needs the tokenizer).
        self.bad_words_token_ids: list[list[int]] = []
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _fit_temperature(self) -> None:
        if self.temperature < GREEDY_TEMPERATURE_EPS:
            self.temperature = 0.0
        elif self.temperature < MIN_SAMPLED_TEMPERATURE:
            self.temperature = MIN_SAMPLED_TEMPERATURE

    def validate(self) -> None:
        """Refuse what the engine cannot honour, in a fixed order (the first problem is the one
        reported); floats are normalised to ``float``."""
        self._validate_lengths()
        self._validate_sampling()
        self._validate_seed()
        self._validate_stops()
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {show(self.ignore_eos)}")
        self._validate_logprobs()
        self._validate_parallel_sampling()
        _check_number(self, "min_p", lambda v: 0 <= v <= 1, "in [0, 1]")
        self._validate_beam_search()
        self._validate_token_constraints()
        self._validate_output_switches()
        self._validate_names()
        if not self.detokenize and self.stop:
            raise ValueError("stop strings are only supported when detokenize is True")
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_value(self.structured_outputs)

    def _validate_lengths(self) -> None:
        _check_integer(self, "max_tokens", 1)
        _check_integer(self, "min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}"
            )

    def _validate_sampling(self) -> None:
        _check_number(self, "temperature", lambda v: v >= 0, ">= 0")
        self._fit_temperature()
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (off) or a positive integer, got {show(self.top_k)}"
            )
        _check_number(self, "top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        low, high = FLOAT32_NORMAL_RANGE
        _check_number(
            self,
            "repetition_penalty",
            lambda v: low <= v <= high,
            f"> 0 and within float32's range [{low:.3g}, {high:.3g}]",
        )
        _check_number(self, "presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        _check_number(self, "frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")

    def _validate_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            if getattr(self, name) is None:
                continue
            _check_integer(self, name, 0)
            if getattr(self, name) > MAX_LOGPROBS:
                raise ValueError(f"{name} must be <= {MAX_LOGPROBS}, got {getattr(self, name)}")

    def _validate_output_switches(self) -> None:
        for name in (
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "detokenize",
            "use_speculation",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a boolean, got {getattr(self, name)!r}")
        if not all(isinstance(w, str) and w.strip() for w in self.bad_words):
            raise ValueError(
                f"bad_words must be a list of non-empty strings, got {self.bad_words!r}"
            )
        t = self.truncate_prompt_tokens
        if t is not None and (isinstance(t, bool) or not isinstance(t, int) or (t < 1 and t != -1)):
            raise ValueError(f"truncate_prompt_tokens must be -1 or an integer >= 1, got {t!r}")

    def _validate_names(self) -> None:
        if self.lora_name == "":
            self.lora_name = None  # vllm_backend clients send "" for the base model
        for name in ("lora_name", "cache_salt"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string, got {show(value)}")

    def _validate_parallel_sampling(self) -> None:
        # vLLM's messages: clients match them.
        if isinstance(self.n, bool) or not isinstance(self.n, int):
            raise ValueError(f"n must be an int, but is of type {type(self.n).__name__}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_PARALLEL_SEQUENCES:
            raise ValueError(f"n must be at most {MAX_PARALLEL_SEQUENCES}, got {self.n}.")
        if self.best_of is None:
            return
        if isinstance(self.best_of, bool) or not isinstance(self.best_of, int):
            raise ValueError(
                f"best_of must be an int, but is of type {type(self.best_of).__name__}"
            )
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and "
                f"best_of={self.best_of}."
            )
        if self.best_of > MAX_PARALLEL_SEQUENCES:
            raise ValueError(
                f"best_of must be at most {MAX_PARALLEL_SEQUENCES}, got {self.best_of}."
            )

    @property
    def num_sequences(self) -> int:
        """How many sequences the engine generates for the prompt (the beams; else best_of,
        else n)."""
        if self.beam_width > 1:
            return self.beam_width
        return self.best_of if self.best_of is not None else self.n

    @property
    def beam_search(self) -> bool:
        return self.beam_width > 1

    def _validate_beam_search(self) -> None:
        if not isinstance(self.use_beam_search, bool):
            raise ValueError(f"use_beam_search must be a boolean, got {show(self.use_beam_search)}")
        if self.use_beam_search and self.beam_width == 1:
            self.beam_width = self.best_of if self.best_of is not None else self.n
            self.best_of = None
        w = self.beam_width
        if isinstance(w, bool) or not isinstance(w, int) or not 1 <= w <= MAX_PARALLEL_SEQUENCES:
            raise ValueError(
                f"beam_width must be an integer in [1, {MAX_PARALLEL_SEQUENCES}], got {show(w)}"
            )
        lp = self.length_penalty
        if isinstance(lp, bool) or not isinstance(lp, (int, float)) or not math.isfinite(lp):
            raise ValueError(f"length_penalty must be a finite number, got {show(lp)}")
        self.length_penalty = float(lp)
        if self.early_stopping not in (True, False, "never"):
            raise ValueError(
                f'early_stopping must be true, false or "never", got {show(self.early_stopping)}'
            )
        if w > 1:
            self._validate_beams(w)

    def _validate_beams(self, w: int) -> None:
        """What may come with more than one beam."""
        if self.n > w:
            raise ValueError(
                f"n must be <= beam_width with beam search, got n={self.n} and beam_width={w}"
            )
        if self.best_of is not None and self.best_of != w:
            raise ValueError(
                "best_of cannot be combined with beam search (beam_width is the "
                "number of sequences kept)"
            )
        # Beams are ranked on log-probabilities with the temperature, penalties, logit bias,
        # bad words, allowed ids and min_tokens applied (as TensorRT-LLM applies them to
        # beams); truncating the distribution is sampling's, which beam search does not do.
        if self.stop or self.structured_outputs is not None or self.prompt_logprobs is not None:
            raise ValueError(
                "beam search does not support stop strings, structured outputs or prompt_logprobs"
            )
        for name, unset, value in _BEAM_TRUNCATIONS:
            if getattr(self, name) not in unset:
                raise ValueError(
                    f"beam search does not apply {name} (beams are ranked on the whole "
                    f"distribution, as TensorRT-LLM's and vLLM's beam search rank them): "
                    f"leave it at {value}, got {show(getattr(self, name))}"
                )

    def _validate_seed(self) -> None:
        if self.seed is None:
            return
        low, high = SEED_RANGE
        if (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not low <= self.seed <= high
        ):
            raise ValueError(
                f"seed must be an integer in [-2**63, 2**64 - 1], got {show(self.seed)}"
            )

    def _validate_stops(self) -> None:
        # Counted before looking at elements: a list of 100,000 stops is refused at once.
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(
                f"stop has {len(self.stop)} strings; at most {MAX_STOP_STRINGS} are allowed"
            )
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {show(self.stop)}")
        longest = max((len(s) for s in self.stop), default=0)
        if longest > MAX_STOP_STRING_CHARS:
            raise ValueError(
                f"stop strings must be at most {MAX_STOP_STRING_CHARS} characters, "
                f"got one of {longest}"
            )
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids has {len(self.stop_token_ids)} ids; at most "
                f"{MAX_STOP_TOKEN_IDS} are allowed"
            )
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(
                f"stop_token_ids must be non-negative integers, got {show(self.stop_token_ids)}"
            )

    def check_vocab(self, vocab_size: int) -> None:
        """Token ids index the logits: each must be below the model's vocabulary size."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(
                f"stop_token_ids must be < the vocabulary size {vocab_size}, got {show(bad)}"
            )

    def _validate_token_constraints(self) -> None:
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            if not isinstance(ids, (list, tuple)) or not ids:
                raise ValueError("allowed_token_ids must be a non-empty list of token ids")
            if not all(_is_token_id(t) for t in ids):
                raise ValueError(f"allowed_token_ids must be non-negative integers, got {ids!r}")
            self.allowed_token_ids = list(ids)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError("logit_bias must be an object mapping token ids to biases")
            bias = {}
            for key, value in self.logit_bias.items():
                if not _is_token_id(key):
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
                if (
                    isinstance(value, bool)
                    or not isinstance(value, (int, float))
                    or not math.isfinite(value)
                ):
                    raise ValueError(f"logit_bias values must be numbers, got {value!r}")
                bias[int(key)] = min(max(float(value), -100.0), 100.0)  # OpenAI's range
            self.logit_bias = bias

    @property
    def uses_vocabulary_constraints(self) -> bool:
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words_token_ids)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from JSON-ish values; numbers may arrive as strings (Triton's vLLM backend)."""
        return from_values(
            cls,
            values,
            lambda f, raw: _coerce(f.name, raw),
            lambda key: f"unknown sampling parameter {show(key)}",
        )


_INT_FIELDS = {
    "max_tokens",
    "min_tokens",
    "top_k",
    "seed",
    "logprobs",
    "prompt_logprobs",
    "truncate_prompt_tokens",
    "n",
    "best_of",
    "beam_width",
}
_FLOAT_FIELDS = {
    "temperature",
    "top_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "length_penalty",
}
_BOOL_FIELDS = {
    "ignore_eos",
    "use_speculation",
    "include_stop_str_in_output",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "detokenize",
    "use_beam_search",
}


def _is_token_id(value: Any) -> bool:
    """An int >= 0, or its decimal string (JSON object keys are strings)."""
    if isinstance(value, str):
        return value.strip().isdigit()
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _request_bool(text: str) -> bool:
    value = parse_bool(text, REQUEST)
    if value is None:
        raise ValueError(text)
    return value


def _coerce(key: str, raw: Any) -> Any:
    """A value of a JSON request in the field's own type (numbers and booleans may come as
    strings, token-id lists as "1 2 3", logit_bias as a JSON text)."""
    if raw is None:
        return None
    try:
        if key in _INT_FIELDS:
            return _coerce_int(raw)
        if key in _FLOAT_FIELDS and isinstance(raw, str):
            return float(raw.strip())
        if key in _BOOL_FIELDS and isinstance(raw, str):
            return _request_bool(raw)
        if isinstance(raw, str):
            return _coerce_text(key, raw)
    except ValueError:  # json.JSONDecodeError is one too
        raise ValueError(f"{key}: cannot parse {show(raw)}") from None
    return raw


def _coerce_int(raw: Any) -> Any:
    if isinstance(raw, str):
        return int(raw.strip())
    if isinstance(raw, float) and raw.is_integer():
        return int(raw)
    return raw


def _coerce_text(key: str, raw: str) -> Any:
    """The other fields a string may stand for."""
    if key in ("stop_token_ids", "allowed_token_ids"):
        return [int(x) for x in raw.replace(",", " ").split()]
    if key == "early_stopping" and raw.strip().lower() != "never":
        return _request_bool(raw)  # a boolean's spelling
    if key == "logit_bias":
        return json.loads(raw)
    return raw
