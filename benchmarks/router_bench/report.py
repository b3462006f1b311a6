"""One table and one plot from one run: TTFT p50/p90, throughput and the engines' prefix-cache
hit rate per routing policy."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Optional

from slipstream_bench.metrics import percentile


def summarize(name: str, records: list, wall_s: float, counters: dict) -> dict:
    ok = [r for r in records if r.error is None and r.ttft_s is not None]
    ttfts = [r.ttft_s * 1000 for r in ok]
    queries = counters.get("queries", 0.0)
    return {
        "name": name,
        "turns": len(records),
        "errors": len(records) - len(ok),
        "ttft_ms": {"p50": percentile(ttfts, 50), "p90": percentile(ttfts, 90)},
        "turns_per_s": len(ok) / wall_s if wall_s else 0.0,
        "output_tokens_per_s": sum(r.output_tokens for r in ok) / wall_s if wall_s else 0.0,
        "wall_s": wall_s,
        "prefix_cache_hit_rate": counters.get("hits", 0.0) / queries if queries else None,
        "prompt_tokens_looked_up": queries,
        "first_error": next((r.error for r in records if r.error), None),
    }


def _fmt(value: Optional[float], spec: str = ".0f") -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list) -> str:
    """One row per (engine, policy); ``TTFT p50 cut`` is round robin's p50 over this row's,
    same engine; ``kv_aware scored, found`` is how many of vllm-router's kv_aware decisions it
    scored with the replicas' KV events, and how often its index found a cached prefix."""
    show_engine = bool({row.get("engine") for row in rows} - {None, "slipstream"})
    lines = [
        ("| engine " if show_engine else "")
        + "| routing | TTFT p50 (ms) | TTFT p90 (ms) | TTFT p50 cut vs round robin | turns/s | "
        "output tokens/s | prefix-cache hit rate | kv_aware scored, found | turns (errors) |",
        ("| --- " if show_engine else "")
        + "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        rate = row["prefix_cache_hit_rate"]
        cut = ttft_cut(rows, row)
        lines.append(
            (f"| {row.get('engine', 'slipstream')} " if show_engine else "")
            + f"| {row['name']} | {_fmt(row['ttft_ms']['p50'])} | {_fmt(row['ttft_ms']['p90'])} | "
            f"{'-' if cut is None else f'{cut:.2f}x'} | "
            f"{row['turns_per_s']:.2f} | {row['output_tokens_per_s']:.1f} | "
            f"{'-' if rate is None else f'{rate:.1%}'} | {_credited(row)} | "
            f"{row['turns']} ({row['errors']}) |"
        )
    return "\n".join(lines)


def ttft_cut(rows: list, row: dict) -> Optional[float]:
    """Round robin's TTFT p50 over ``row``'s, for the same engine (None without one)."""
    engine = row.get("engine")
    base = next(
        (r for r in rows if r.get("policy") == "vllm-rr" and r.get("engine") == engine), None
    )
    p50, rr = row["ttft_ms"]["p50"], base["ttft_ms"]["p50"] if base else None
    return rr / p50 if rr and p50 else None


def _credited(row: dict) -> str:
    """``scored/decisions, found``: decisions the router scored with the replicas' KV events
    (the rest had no token ids: render failed) and lookups that found a cached prefix."""
    kv = row.get("router_kv_decisions", {})
    decisions = kv.get("prefix_routing_decisions")
    if not decisions:
        return "-"
    found = kv.get("kv_placement_lookups", {}).get("hit", 0)
    return f"{decisions.get('prefix_cost', 0)}/{sum(decisions.values())}, {found}"


def plot(rows: list, path: Path, title: str) -> Optional[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    names = [
        (f"{r['engine']}\n" if "engine" in r else "")
        + r["name"].replace(" (", "\n(").replace("router ", "router\n")
        for r in rows
    ]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = range(len(rows))
    p50 = [r["ttft_ms"]["p50"] or 0 for r in rows]
    p90 = [r["ttft_ms"]["p90"] or 0 for r in rows]
    ax1.bar([x - 0.2 for x in xs], p50, 0.4, label="p50")
    ax1.bar([x + 0.2 for x in xs], p90, 0.4, label="p90")
    ax1.set_xticks(list(xs), names, fontsize=8)
    ax1.set_ylabel("time to first token (ms)")
    ax1.legend()
    ax2.bar(list(xs), [100 * (r["prefix_cache_hit_rate"] or 0) for r in rows], color="tab:green")
    ax2.set_xticks(list(xs), names, fontsize=8)
    ax2.set_ylabel("engines' prefix-cache hit rate (%)")
    ax2.set_ylim(0, 100)
    fig.suptitle("\n".join(textwrap.wrap(title, 120)), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replot(results_path: Path) -> Optional[Path]:
    """The plot again from a run's results.json (``python -m router_bench.report FILE``)."""
    results = json.loads(Path(results_path).read_text())
    title = results.get("title") or (
        f"{results['replicas']} Slipstream replicas (1 core each) behind each router; "
        f"{results['description']}; {results['cpu']}"
    )
    return plot(results["rows"], Path(results_path).with_name("router_bench.png"), title)


if __name__ == "__main__":
    print(replot(Path(sys.argv[1])))
