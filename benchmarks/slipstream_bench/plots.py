"""PNG figures of a results dict: throughput per mode, latency CDFs, the batch timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

from slipstream_bench.metrics import records_from_json


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def _runs(results: dict) -> list:
    return [r for r in results.get("runs", []) if r.get("summary", {}).get("output_tokens")]


def throughput(results: dict, path: Path) -> Optional[Path]:
    runs = _runs(results)
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    labels = [r["label"] for r in runs]
    for ax, key, title in (
        (axes[0], "tokens_per_s", "generated tokens/s"),
        (axes[1], "requests_per_s", "requests/s"),
    ):
        values = [r["summary"][key] for r in runs]
        bars = ax.bar(labels, values, color=[_mode_colour(i) for i in range(len(runs))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    best = (results.get("roofline") or {}).get("best_tokens_per_s")
    if best:
        axes[0].axhline(best, color="black", linestyle="--", linewidth=1)
        axes[0].annotate(
            f"roofline {best:.1f}", (0, best), textcoords="offset points", xytext=(2, 3), fontsize=8
        )
    fig.suptitle(_title(results))
    return _save(fig, path, plt)


def latency_cdfs(results: dict, path: Path) -> Optional[Path]:
    runs = _runs(results)
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    pickers = (
        ("TTFT", lambda rec: [rec.ttft] if rec.ttft is not None else []),
        ("inter-token latency", lambda rec: rec.itls),
        ("end-to-end latency", lambda rec: [rec.e2e] if rec.e2e is not None else []),
    )
    for ax, (title, pick) in zip(axes, pickers):
        for i, run in enumerate(runs):
            values = sorted(
                v * 1000
                for rec in records_from_json(run["records"])
                for v in pick(rec)
                if v is not None
            )
            if values:
                ys = [(k + 1) / len(values) for k in range(len(values))]
                ax.step(values, ys, where="post", label=run["label"], color=_mode_colour(i))
        ax.set_xscale("symlog", linthresh=1.0)
        ax.set_xlabel("ms")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("fraction of requests / tokens")
    axes[-1].legend(fontsize=8, loc="lower right")
    fig.suptitle(_title(results))
    return _save(fig, path, plt)


def batch_timeline(
    results: dict,
    path: Path,
    labels: Sequence[str] = ("continuous", "static"),
    max_steps: int = 4000,
) -> Optional[Path]:
    """Which request holds which batch slot at each step, one panel per traced run."""
    runs = [r for r in results.get("runs", []) if r.get("timeline") and r["label"] in labels]
    runs.sort(key=lambda r: list(labels).index(r["label"]))
    if not runs:
        return None
    plt = _pyplot()
    fig, axes = plt.subplots(len(runs), 1, figsize=(14, 3.5 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        _draw_timeline(ax, run["timeline"][:max_steps])
        ax.set_title(
            f"{run['label']}: batch slots per engine step (colour = request, hatched = "
            "prefill, grey = padding)",
            fontsize=10,
        )
    axes[-1, 0].set_xlabel("engine step")
    return _save(fig, path, plt)


def _draw_timeline(ax, steps: list) -> None:
    # [index, start, dur, [[rid, slot, prefill, decode], ...], padding_slots]
    spans: dict = {}  # (slot, rid, is_prefill) -> [(x, width)]
    pads: dict = {}
    ids: dict = {}
    for x, (_, _, _, slices, padding) in enumerate(steps):
        for rid, slot, prefill, _decode in slices:
            ids.setdefault(rid, len(ids))
            _extend(spans.setdefault((slot, rid, prefill > 0), []), x)
        for slot in padding:
            _extend(pads.setdefault(slot, []), x)
    for (slot, rid, is_prefill), segs in spans.items():
        ax.broken_barh(
            segs,
            (slot - 0.4, 0.8),
            facecolors=_colour(ids[rid]),
            hatch="////" if is_prefill else None,
            edgecolor="white",
            linewidth=0.2,
        )
    for slot, segs in pads.items():
        ax.broken_barh(segs, (slot - 0.4, 0.8), facecolors="#bbbbbb")
    ax.set_xlim(0, max(len(steps), 1))
    ax.set_ylabel("slot")
    ax.invert_yaxis()


def _extend(segs: list, x: int) -> None:
    if segs and segs[-1][0] + segs[-1][1] == x:
        segs[-1] = (segs[-1][0], segs[-1][1] + 1)
    else:
        segs.append((x, 1))


def _colour(i: int):
    import matplotlib

    return matplotlib.colormaps["tab20"](i % 20)


def _mode_colour(i: int):
    import matplotlib

    return matplotlib.colormaps["tab10"](i % 10)


def _title(results: dict) -> str:
    w = results.get("workload", {})
    sweep = results.get("sweep")
    rate = (
        f"rates {', '.join(str(p['rate']) for p in sweep)}"
        if sweep
        else f"rate {results.get('rate', 'inf')}"
    )
    return (
        f"{results.get('scenario', '')}: {w.get('num_requests', '?')} requests, "
        f"model {results.get('model', '?')}, {rate}"
    )


def _save(fig, path: Path, plt) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_all(results: dict, out_dir: Path) -> list:
    out_dir = Path(out_dir)
    made = [
        throughput(results, out_dir / "throughput.png"),
        latency_cdfs(results, out_dir / "latency_cdf.png"),
        batch_timeline(results, out_dir / "batch_timeline.png", _timeline_labels(results)),
        slo_attainment(results, out_dir / "slo_attainment.png"),
    ]
    return [str(p) for p in made if p is not None]


def slo_attainment(results: dict, path: Path) -> Optional[Path]:
    """SLO attainment against the request rate, one line per mode (a sweep's rates)."""
    by_mode: dict = {}
    for point in results.get("sweep") or []:
        if point["rate"] == "inf":
            continue
        for run in point["runs"]:
            if run.get("slo"):
                by_mode.setdefault(run["label"], []).append(
                    (point["rate"], run["slo"]["attainment"] * 100)
                )
    if not by_mode:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (label, pts) in enumerate(by_mode.items()):
        pts.sort()
        ax.plot(
            [p[0] for p in pts], [p[1] for p in pts], marker="o", label=label, color=_mode_colour(i)
        )
    slo = results.get("slo") or {}
    ax.axhline(slo.get("attainment", 0.9) * 100, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("request rate (requests/s, Poisson)")
    ax.set_ylabel("requests meeting the SLO (%)")
    ax.set_ylim(0, 102)
    ax.set_title(
        f"SLO attainment: TTFT <= {slo.get('ttft_ms', 0):.0f} ms, "
        f"TPOT <= {slo.get('tpot_ms', 0):.0f} ms",
        fontsize=10,
    )
    ax.legend(fontsize=8)
    fig.suptitle(_title(results), fontsize=9)
    return _save(fig, path, plt)


def _timeline_labels(results: dict) -> list:
    """The continuous server run (else the in-process one), and static batching beside it."""
    traced = [r["label"] for r in results.get("runs", []) if r.get("timeline")]
    main = [label for label in ("continuous", "inprocess") if label in traced][:1]
    chosen = main + [label for label in ("static",) if label in traced]
    return chosen or traced[:2]
