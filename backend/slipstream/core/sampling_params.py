"""Per-request sampling parameters (vLLM names and defaults)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Optional


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
    stop: list = field(default_factory=list)
    stop_token_ids: list = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: Optional[int] = None  # None = off; N = the sampled token's logprob (+ top-N ids)
    use_speculation: bool = True  # opt out of speculative decoding for this request

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def integer(name: str, low: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an integer >= {low}, got {v!r}")

        def number(name: str, ok, rule: str) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"{name} must be {rule}, got {v!r}")
            setattr(self, name, float(v))

        integer("max_tokens", 1)
        integer("min_tokens", 0)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens, got {self.min_tokens} > {self.max_tokens}")
        number("temperature", lambda v: v >= 0, ">= 0")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1, 0 (off) or a positive integer, got {self.top_k!r}")
        number("top_p", lambda v: 0 < v <= 1, "in (0, 1]")
        number("repetition_penalty", lambda v: v > 0, "> 0")
        number("presence_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        number("frequency_penalty", lambda v: -2 <= v <= 2, "in [-2, 2]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a boolean, got {self.ignore_eos!r}")
        if self.logprobs is not None:
            integer("logprobs", 0)

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "SamplingParams":
        """Build from JSON-ish values; numbers may arrive as strings (Triton's vLLM backend)."""
        known = {f.name: f for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            if key not in known:
                raise ValueError(f"unknown sampling parameter {key!r}")
            kwargs[key] = _coerce(key, raw)
        return cls(**kwargs)


_INT_FIELDS = {"max_tokens", "min_tokens", "top_k", "seed", "logprobs"}
_FLOAT_FIELDS = {"temperature", "top_p", "repetition_penalty", "presence_penalty", "frequency_penalty"}
_BOOL_FIELDS = {"ignore_eos", "use_speculation"}


def _coerce(key: str, raw: Any) -> Any:
    if raw is None:
        return None
    try:
        if key in _INT_FIELDS and isinstance(raw, str):
            return int(raw.strip())
        if key in _INT_FIELDS and isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if key in _FLOAT_FIELDS and isinstance(raw, str):
            return float(raw.strip())
        if key in _BOOL_FIELDS and isinstance(raw, str):
            low = raw.strip().lower()
            if low in ("true", "1", "yes"):
                return True
            if low in ("false", "0", "no"):
                return False
            raise ValueError
        if key == "stop_token_ids" and isinstance(raw, str):
            return [int(x) for x in raw.replace(",", " ").split()]
    except ValueError:
        raise ValueError(f"{key}: cannot parse {raw!r}") from None
    return raw
