"""Queue orderings: which waiting request is admitted next, which running one is preempted.

A key is "smaller = served first". Priority and shortest-job-first age: every
``aging_seconds`` of waiting moves a request one class forward, so nothing starves.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Optional

from slipstream.core.request import Request

PolicyKey = Callable[[Request, float], tuple[Any, ...]]


def _aged(value: float, req: Request, now: float, aging_seconds: float) -> float:
    if aging_seconds <= 0:
        return value
    return value - (now - req.arrival_time) / aging_seconds


def make_policy(name: str, aging_seconds: float = 5.0) -> PolicyKey:
    if name == "fifo":
        return lambda req, now: (req.arrival_time,)
    if name == "priority":
        # vLLM convention: a lower ``priority`` value is served first.
        return lambda req, now: (_aged(req.priority, req, now, aging_seconds), req.arrival_time)
    if name == "sjf":
        # Job size = requested output length (+ the prompt still to prefill), in units of
        # 64 tokens per class so aging is comparable across scales.
        def key(req: Request, now: float) -> tuple[float, float]:
            size = (req.params.max_tokens + req.num_prompt_tokens) / 64.0
            return (_aged(size, req, now, aging_seconds), req.arrival_time)

        return key
    raise ValueError(f"unknown policy {name!r}")


Choose = Callable[..., Request]  # min or max, with a key


def _pick(
    choose: Choose, requests: list[Request], key: PolicyKey, now: Optional[float]
) -> Optional[Request]:
    if not requests:
        return None
    now = time.monotonic() if now is None else now
    return choose(requests, key=lambda r: key(r, now))


def pick_first(
    requests: list[Request], key: PolicyKey, now: Optional[float] = None
) -> Optional[Request]:
    """The waiting request to admit next: the one the policy serves first."""
    return _pick(min, requests, key, now)


def pick_victim(
    requests: list[Request], key: PolicyKey, now: Optional[float] = None
) -> Optional[Request]:
    """The running request to preempt: the one the policy would serve last."""
    return _pick(max, requests, key, now)
