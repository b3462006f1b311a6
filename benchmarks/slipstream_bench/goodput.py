"""Service-level objectives over a rate sweep: SLO attainment per run and goodput.

Goodput as DistServe defines it: the highest request rate at which at least
``attainment`` (90%) of the requests meet BOTH their TTFT and TPOT targets. A request meets
them when it finished without error, its first token came within ``ttft_ms`` of sending and
its mean time per output token after the first (TPOT) is at most ``tpot_ms`` (a one-token
output has no TPOT: TTFT alone). A failed request misses.

The sweep measures some rates; ``goodput_rps`` is the highest measured rate that meets the
target (with every lower measured rate meeting it too: attainment that recovers above a
failing rate is noise), and ``goodput_interpolated_rps`` places the crossing on the straight
line between it and the next measured rate.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional, Sequence

from slipstream_bench.metrics import RequestRecord, percentile, records_from_json


@dataclass
class Slo:
    ttft_ms: float = 2000.0
    tpot_ms: float = 150.0
    attainment: float = 0.9  # the share of requests that must meet both

    def met_by(self, rec: RequestRecord) -> bool:
        if rec.error is not None or not rec.token_times:
            return False
        tpot = rec.tpot
        return rec.ttft * 1e3 <= self.ttft_ms and (tpot is None or tpot * 1e3 <= self.tpot_ms)


def attainment(records: Sequence[RequestRecord], slo: Slo) -> Optional[float]:
    """The share of the requests that met both targets (None: no request)."""
    if not records:
        return None
    return sum(1 for r in records if slo.met_by(r)) / len(records)


def slo_summary(run: dict, slo: Slo) -> Optional[dict]:
    """A run's attainment and TPOT percentiles (None for runs without per-token times)."""
    if run.get("kind") == "peer_offline" or not run.get("records"):
        return None
    records = records_from_json(run["records"])
    tpots = [r.tpot * 1e3 for r in records if r.tpot is not None and r.error is None]
    return {
        "attainment": attainment(records, slo),
        "target": asdict(slo),
        "tpot_ms": {f"p{q}": percentile(tpots, q) for q in (50, 90, 99)},
        "met": sum(1 for r in records if slo.met_by(r)),
        "requests": len(records),
    }


def goodput(points: Sequence[tuple], slo: Slo) -> dict:
    """``points``: (rate, attainment) of one system, any order. The highest rate meeting the
    target from the lowest up, and the interpolated crossing."""
    ordered = sorted((rate, a) for rate, a in points if a is not None)
    best, nxt = None, None
    for rate, a in ordered:
        if a >= slo.attainment:
            best = (rate, a)
        else:
            nxt = (rate, a)
            break
    out = {"goodput_rps": best[0] if best else 0.0, "goodput_interpolated_rps": None}
    if best and nxt:
        (r0, a0), (r1, a1) = best, nxt
        out["goodput_interpolated_rps"] = r0 + (r1 - r0) * (a0 - slo.attainment) / (a0 - a1)
    elif best:
        out["goodput_interpolated_rps"] = best[0]  # every measured rate met it: at least this
    out["met_at_every_rate"] = bool(best) and nxt is None
    return out
