"""The printed table and the ratios against the project's targets."""

from __future__ import annotations

from typing import Optional

# name -> (description, needed, compare): compare(value, needed) says whether it is met.
TARGETS = {
    "continuous_vs_static": (
        "continuous (Triton) / static batch 8 (Triton), tokens/s",
        6.0,
        lambda v, n: v >= n,
    ),
    "continuous_vs_hf_continuous": (
        "continuous (Triton) / HF continuous batching, tokens/s",
        2.0,
        lambda v, n: v >= n,
    ),
    "roofline_fraction": (
        "roofline best-possible time / continuous (Triton) makespan",
        0.85,
        lambda v, n: v >= n,
    ),
    "triton_overhead": (
        "1 - continuous (Triton) / in-process engine, tokens/s",
        0.05,
        lambda v, n: v <= n,
    ),
    # Against the backend Slipstream replaces: Triton + Triton's vLLM backend, vLLM offline.
    "continuous_vs_vllm_triton": (
        "continuous (Triton) / Triton + vLLM backend, tokens/s",
        1.2,
        lambda v, n: v >= n,
    ),
    "itl_p50_vs_vllm_triton": (
        "ITL p50, continuous (Triton) / Triton + vLLM backend",
        1.0,
        lambda v, n: v <= n,
    ),
    "itl_p90_vs_vllm_triton": (
        "ITL p90, continuous (Triton) / Triton + vLLM backend",
        1.0,
        lambda v, n: v <= n,
    ),
    "inprocess_vs_vllm_offline": (
        "in-process engine / vLLM offline (LLM.generate), tokens/s",
        1.2,
        lambda v, n: v >= n,
    ),
    # Reduced precision (issue 25): the server variants named bf16 and int8
    # (--variant bf16:dtype=bfloat16 --variant int8:quantization=int8 --variant-modes continuous)
    # against Triton + vLLM backend at vLLM's best CPU dtype, bfloat16.
    "bf16_vs_vllm_triton_bf16": (
        "continuous[bf16] / Triton + vLLM backend bf16, tokens/s",
        1.2,
        lambda v, n: v >= n,
    ),
    "bf16_itl_p50_vs_vllm_triton_bf16": (
        "ITL p50, continuous[bf16] / Triton + vLLM bf16",
        1.0,
        lambda v, n: v <= n,
    ),
    "bf16_itl_p90_vs_vllm_triton_bf16": (
        "ITL p90, continuous[bf16] / Triton + vLLM bf16",
        1.0,
        lambda v, n: v <= n,
    ),
    "int8_vs_vllm_triton_bf16": (
        "continuous[int8] / Triton + vLLM backend bf16, tokens/s",
        1.5,
        lambda v, n: v >= n,
    ),
}
LOWER_IS_BETTER = (
    "triton_overhead",
    "itl_p50_vs_vllm_triton",
    "itl_p90_vs_vllm_triton",
    "bf16_itl_p50_vs_vllm_triton_bf16",
    "bf16_itl_p90_vs_vllm_triton_bf16",
)


def _tps(results: dict, label: str) -> Optional[float]:
    for run in results.get("runs", []):
        if run["label"] == label and run["summary"].get("output_tokens"):
            return run["summary"]["tokens_per_s"]
    return None


def _itl(results: dict, label: str, p: str) -> Optional[float]:
    for run in results.get("runs", []):
        if run["label"] == label:
            return ((run["summary"] or {}).get("itl_ms") or {}).get(p)
    return None


def _ratio(a: Optional[float], b: Optional[float]) -> Optional[float]:
    return a / b if a and b else None


def ratios(results: dict) -> dict:
    cont = _tps(results, "continuous")
    out: dict = {}
    for name, other in (
        ("continuous_vs_static", "static"),
        ("continuous_vs_hf_continuous", "hf_continuous"),
        ("continuous_vs_vllm_triton", "vllm_triton"),
    ):
        out[name] = _ratio(cont, _tps(results, other))
    inproc = _tps(results, "inprocess")
    out["triton_overhead"] = 1 - cont / inproc if cont and inproc else None
    for p in ("p50", "p90"):
        out[f"itl_{p}_vs_vllm_triton"] = _ratio(
            _itl(results, "continuous", p), _itl(results, "vllm_triton", p)
        )
    out["inprocess_vs_vllm_offline"] = _ratio(inproc, _tps(results, "vllm_offline"))
    out["roofline_fraction"] = (
        (results.get("roofline") or {}).get("efficiency", {}).get("vs_makespan")
    )
    out.update(_reduced_ratios(results))
    return out


def _reduced_ratios(results: dict) -> dict:
    peer = "vllm_triton_bf16"
    out = {
        "bf16_vs_vllm_triton_bf16": _ratio(_tps(results, "continuous[bf16]"), _tps(results, peer)),
        "int8_vs_vllm_triton_bf16": _ratio(_tps(results, "continuous[int8]"), _tps(results, peer)),
    }
    for p in ("p50", "p90"):
        out[f"bf16_itl_{p}_vs_vllm_triton_bf16"] = _ratio(
            _itl(results, "continuous[bf16]", p), _itl(results, peer, p)
        )
    return out


def judged(results: dict) -> dict:
    """ratio name -> {value, target, met, description} (met is None when not measured)."""
    out = {}
    for name, value in ratios(results).items():
        desc, needed, ok = TARGETS[name]
        if name == "roofline_fraction":  # measured on the in-process run without a server
            source = (results.get("roofline") or {}).get("source", "continuous")
            desc = desc.replace("continuous (Triton)", source)
        out[name] = {
            "value": value,
            "target": needed,
            "description": desc,
            "met": None if value is None else bool(ok(value, needed)),
        }
    return out


def _trip(summary: dict, key: str) -> str:
    """A latency's p50/p90/p99 from a summary, as "a/b/c"."""
    return "/".join(_ms(summary.get(key), p) for p in ("p50", "p90", "p99"))


def _ms(d: Optional[dict], key: str) -> str:
    v = (d or {}).get(key)
    return "-" if v is None else f"{v:.0f}" if v >= 10 else f"{v:.1f}"


def machine_line(m: dict) -> str:
    """Every figure is only comparable on the machine it was taken on: say which."""
    load = [m.get("load_average_1m"), m.get("load_average_1m_at_end")]
    load_text = "/".join(f"{x:.2f}" for x in load if x is not None) or "?"
    return (
        f"machine: {m.get('cpu_model') or '?'} ({', '.join(m.get('cpu_flags') or []) or '?'})"
        f", {m.get('cpus')} CPUs, torch {m.get('torch')} x{m.get('torch_threads')} threads, "
        f"load 1m at start/end {load_text}"
    )


def table(results: dict) -> str:
    w = max([16] + [len(r["label"]) + 1 for r in results.get("runs", [])])
    head = (
        f"{'mode':<{w}}{'tok/s':>9}{'req/s':>8}{'makespan':>10}   "
        f"{'TTFT p50/p90/p99 ms':>22}   {'ITL p50/p90/p99 ms':>20}   "
        f"{'E2E p50/p90/p99 ms':>22}  {'err':>4}{'len!':>5}"
    )
    lines = [machine_line(results.get("machine") or {}), head, "-" * len(head)]
    for run in results.get("runs", []):
        if run.get("error"):
            lines.append(f"{run['label']:<{w}}failed: {run['error'][:100]}")
            continue
        if run.get("skipped"):
            lines.append(f"{run['label']:<{w}}skipped: {run['skipped'][:140]}")
            continue
        s = run["summary"]
        makespan = s.get("makespan_s")
        lines.append(
            f"{run['label']:<{w}}{s.get('tokens_per_s', 0):>9.1f}"
            f"{s.get('requests_per_s', 0):>8.2f}"
            f"{(f'{makespan:.1f}s' if makespan else '-'):>10}   "
            f"{_trip(s, 'ttft_ms'):>22}   {_trip(s, 'itl_ms'):>20}   {_trip(s, 'e2e_ms'):>22}  "
            f"{s.get('num_errors', 0):>4}{s.get('num_wrong_length', 0):>5}"
        )
    for run in results.get("runs", []):
        rounds = [t for t in run.get("rounds_tokens_per_s") or [] if t]
        if len(rounds) > 1:
            lines.append(
                f"{run['label']:<{w}}tok/s by round: "
                + ", ".join(f"{t:.1f}" for t in rounds)
                + " (the median one above)"
            )
    roof = results.get("roofline") or {}
    if roof.get("error"):
        lines.append(f"{'roofline':<{w}}failed: {roof['error'][:100]}")
    elif roof.get("best_possible_s"):
        lines.append(
            f"{'roofline':<{w}}{roof['best_tokens_per_s']:>9.1f}{'':>8}"
            f"{roof['best_possible_s']:>9.1f}s   (best possible for the continuous "
            f"run's {roof['num_steps']} steps)"
        )
    return "\n".join(lines)


def targets_text(results: dict) -> str:
    lines = ["targets:"]
    for name, t in results.get("targets", {}).items():
        if t["value"] is None:
            lines.append(f"  {t['description']}: not measured")
            continue
        verdict = "met" if t["met"] else "NOT met"
        cmp = "<=" if name in LOWER_IS_BETTER else ">="
        lines.append(
            f"  {t['description']}: {t['value']:.2f} (target {cmp} {t['target']}) {verdict}"
        )
    return "\n".join(lines)


def _points(results: dict) -> list:
    """(rate, runs) per measured rate: the sweep, or the one rate of ``runs``."""
    if results.get("sweep"):
        return [(p["rate"], p["runs"]) for p in results["sweep"]]
    return [(results.get("rate"), results.get("runs", []))]


def slo_table(results: dict) -> str:
    """Per rate and mode: SLO attainment and TTFT / ITL / TPOT percentiles; then goodput."""
    slo = results.get("slo") or {}
    w = max([16] + [len(r["label"]) + 1 for _, runs in _points(results) for r in runs])
    lines = [
        f"SLO: TTFT <= {slo.get('ttft_ms', 0):.0f} ms and TPOT <= "
        f"{slo.get('tpot_ms', 0):.0f} ms; goodput = the highest rate with >= "
        f"{slo.get('attainment', 0):.0%} of requests meeting both",
        f"{'rate':>6} {'mode':<{w}}{'SLO met':>9}   {'TTFT p50/p90/p99 ms':>22}   "
        f"{'ITL p50/p90/p99 ms':>20}   {'TPOT p50/p90/p99 ms':>21}  rounds",
    ]
    for rate, runs in _points(results):
        for run in runs:
            s, att = run.get("summary") or {}, run.get("slo")
            if not att:
                continue
            rounds = ", ".join(
                f"{a:.0%}" for a in run.get("rounds_slo_attainment") or [] if a is not None
            )
            lines.append(
                f"{str(rate):>6} {run['label']:<{w}}{att['attainment']:>9.1%}   "
                f"{_trip(s, 'ttft_ms'):>22}   {_trip(s, 'itl_ms'):>20}   "
                f"{_trip(s, 'tpot_ms'):>21}  {rounds}"
            )
    for label, g in (results.get("goodput") or {}).items():
        more = " (met at every measured rate: at least)" if g.get("met_at_every_rate") else ""
        interp = g.get("goodput_interpolated_rps")
        lines.append(
            f"goodput {label}: {g['goodput_rps']:g} req/s"
            + (f", interpolated {interp:.2f}" if interp is not None else "")
            + more
        )
    return "\n".join(lines)


def agreement_table(rows: list) -> str:
    """Greedy outputs of matched weight formats (``agreement.greedy_agreement``)."""
    lines = [
        "| format | Slipstream | llama.cpp | requests | identical | mean common prefix |",
        "| --- | --- | --- | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['format']} | {r['slipstream']} | {r['peer']} | {r['requests']} | "
            f"{r['identical']:.0%} | {r['mean_prefix_share']:.0%} |"
        )
    return "\n".join(lines)
