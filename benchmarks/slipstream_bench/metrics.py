"""Per-request timing records and the numbers a run is judged by.

Every path (Triton, in-process, Hugging Face) fills the same ``RequestRecord``: when the
request was sent and when each of its output tokens arrived, on ``time.perf_counter()``.
Throughput is over the makespan, from the first send to the last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    id: str
    prompt_len: int
    max_tokens: int
    send_time: float = 0.0
    token_times: list = field(default_factory=list)  # one entry per output token
    error: Optional[str] = None
    text: str = ""  # the output as streamed (greedy outputs of two systems are compared)

    @property
    def finished(self) -> bool:
        """Its last token arrived (lengths are exact: ``min_tokens`` = ``max_tokens``) or it
        failed."""
        return self.error is not None or len(self.token_times) >= self.max_tokens

    def add_tokens(self, when: float, count: int) -> None:
        # A response carrying k tokens delivers all k at once: k entries of the same time.
        self.token_times.extend([when] * count)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times)

    @property
    def ttft(self) -> Optional[float]:
        return self.token_times[0] - self.send_time if self.token_times else None

    @property
    def e2e(self) -> Optional[float]:
        return self.token_times[-1] - self.send_time if self.token_times else None

    @property
    def itls(self) -> list:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> Optional[float]:
        n = len(self.token_times)
        return (self.token_times[-1] - self.token_times[0]) / (n - 1) if n > 1 else None


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Iterable[Optional[float]], scale: float = 1000.0) -> dict:
    """mean and percentiles, in milliseconds by default."""
    xs = [v * scale for v in values if v is not None]
    if not xs:
        return {"mean": None, **{f"p{q}": None for q in PERCENTILES}, "count": 0}
    return {
        "mean": sum(xs) / len(xs),
        **{f"p{q}": percentile(xs, q) for q in PERCENTILES},
        "count": len(xs),
    }


def summarize(records: Sequence[RequestRecord]) -> dict:
    ok = [r for r in records if r.error is None and r.token_times]
    if not ok:
        return {
            "num_requests": len(records),
            "num_errors": len(records),
            "makespan_s": None,
            "output_tokens": 0,
            "tokens_per_s": 0.0,
            "requests_per_s": 0.0,
        }
    start = min(r.send_time for r in records)
    end = max(r.token_times[-1] for r in ok)
    makespan = end - start
    tokens = sum(r.num_output_tokens for r in ok)
    return {
        "num_requests": len(records),
        "num_errors": len(records) - len(ok),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "num_wrong_length": sum(1 for r in ok if r.num_output_tokens != r.max_tokens),
        "makespan_s": makespan,
        "output_tokens": tokens,
        "prompt_tokens": sum(r.prompt_len for r in ok),
        "tokens_per_s": tokens / makespan if makespan > 0 else 0.0,
        "requests_per_s": len(ok) / makespan if makespan > 0 else 0.0,
        "ttft_ms": distribution(r.ttft for r in ok),
        "itl_ms": distribution(x for r in ok for x in r.itls),
        "tpot_ms": distribution(r.tpot for r in ok),
        "e2e_ms": distribution(r.e2e for r in ok),
    }


def records_to_json(records: Sequence[RequestRecord]) -> list:
    """Compact per-request data for the results file (and for plotting CDFs later)."""
    start = min((r.send_time for r in records), default=0.0)
    return [
        {
            "id": r.id,
            "prompt_len": r.prompt_len,
            "max_tokens": r.max_tokens,
            "send_s": round(r.send_time - start, 6),
            "token_s": [round(t - start, 6) for t in r.token_times],
            "error": r.error,
            "text": r.text,
        }
        for r in records
    ]


def records_from_json(items: Sequence[dict]) -> list:
    return [
        RequestRecord(
            d["id"],
            d["prompt_len"],
            d["max_tokens"],
            d["send_s"],
            list(d["token_s"]),
            d.get("error"),
            d.get("text", ""),
        )
        for d in items
    ]
