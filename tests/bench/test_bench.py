"""``slipstream bench`` smoke test: a 4-request run on a tiny random model through the
continuous server, the in-process engine, both Hugging Face baselines and the roofline.
Checks the files and fields, never timings (benchmarks are not tests)."""

import json
import os
import random
import tempfile

import pytest

from slipstream.server.launch.cli import main as cli_main
from slipstream_bench import timeline
from slipstream_bench.metrics import RequestRecord, percentile, summarize
from slipstream_bench.workload import (
    Workload,
    arrival_times,
    generate_workload,
    sample_lengths,
    shared_prefix_workload,
)
from support import ROOT, tiny_model_dir


def test_workload_lengths_are_exact_and_round_trip(tokenizer, tmp_path):
    w = generate_workload(
        tokenizer, 8, seed=3, prompt_lens="uniform:5:40", output_lens="0.75*fixed:4+0.25*fixed:30"
    )
    assert [len(ids) for ids in w.prompt_ids(tokenizer)] == [r.prompt_len for r in w.requests]
    assert all(5 <= r.prompt_len <= 40 for r in w.requests)
    assert sorted(r.max_tokens for r in w.requests) == [4] * 6 + [30] * 2  # exact shares
    again = Workload.load(w.save(tmp_path / "w.json"))
    assert again.requests == w.requests
    assert (
        generate_workload(
            tokenizer,
            8,
            seed=3,
            prompt_lens="uniform:5:40",
            output_lens="0.75*fixed:4+0.25*fixed:30",
        ).requests
        == w.requests
    )


def test_shared_prefix_workload_shares_its_system_prompt(tokenizer):
    w = shared_prefix_workload(tokenizer, 4, system_len=48, suffix_lens="fixed:8")
    ids = w.prompt_ids(tokenizer)
    assert all(i[:48] == ids[0][:48] for i in ids) and len({tuple(i) for i in ids}) == 4


def test_distributions_and_arrivals():
    with pytest.raises(ValueError):
        sample_lengths("normal:3:4", 4, random.Random(0))
    assert arrival_times(3, float("inf")) == [0.0, 0.0, 0.0]
    poisson = arrival_times(50, 10.0, seed=1)
    assert poisson == sorted(poisson) and poisson == arrival_times(50, 10.0, seed=1)
    assert 2.0 < poisson[-1] < 10.0  # about 49 / 10 s


def test_metrics():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    rec = RequestRecord("a", 10, 3, send_time=1.0, token_times=[1.5, 1.75, 2.0])
    s = summarize([rec])
    assert s["output_tokens"] == 3 and s["tokens_per_s"] == pytest.approx(3.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(500) and s["itl_ms"]["p50"] == pytest.approx(250)


def test_sampled_rows_of_a_chunked_prefill():
    steps = [
        timeline.Step(0, 0, 1, [timeline.Slice("a", 0, 8, 0)]),
        timeline.Step(1, 1, 1, [timeline.Slice("a", 0, 4, 0), timeline.Slice("b", 1, 3, 0)]),
        timeline.Step(2, 2, 1, [timeline.Slice("a", 0, 0, 1), timeline.Slice("b", 1, 0, 1, True)]),
    ]
    assert timeline.sampled_rows(steps) == [0, 2, 2]


def _server_available() -> bool:
    if os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1":
        return False
    from slipstream.server.launch.triton_install import find_tritonserver

    try:
        find_tritonserver()
        return True
    except Exception:
        return False


@pytest.mark.server
def test_bench_quick_run_writes_results_and_plots(tmp_path, monkeypatch):
    scratch = tmp_path / "scratch"  # where the runs render their model repositories
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    modes = ["inprocess", "hf_static", "hf_continuous", "roofline"]
    if _server_available():
        modes.insert(1, "continuous")  # the order runs go in
    out = tmp_path / "results"
    code = cli_main(
        [
            "bench",
            "--quick",
            "--num-requests",
            "4",
            "--model",
            str(tiny_model_dir("llama")),
            "--modes",
            ",".join(modes),
            "--output-dir",
            str(out),
            "--no-progress",
            "--kv-cache-bytes",
            str(16 * 1024 * 1024),
            "--set",
            "max_model_len=1024",
        ]
    )  # the tiny model's positions
    assert code == 0
    assert not list(scratch.glob("slipstream-bench-*"))  # rendered repositories removed
    results = json.loads((out / "results.json").read_text())
    workload = Workload.load(out / "workload.json")
    assert [r["label"] for r in results["runs"]] == [m for m in modes if m != "roofline"]
    for run in results["runs"]:
        s = run["summary"]
        assert s["num_errors"] == 0 and s["num_wrong_length"] == 0, run["label"]
        assert s["output_tokens"] == workload.total_output_tokens
        for key in ("tokens_per_s", "requests_per_s", "makespan_s"):
            assert s[key] > 0
        for key in ("ttft_ms", "itl_ms", "e2e_ms"):
            assert set(s[key]) >= {"p50", "p90", "p99", "mean"}
        assert len(run["records"]) == 4
    engine_runs = [r for r in results["runs"] if r["kind"] != "hf"]
    for run in engine_runs:  # the step trace made it into the timeline
        assert run["timeline"] and run["steps"]["decode_tokens"] > 0
    assert results["roofline"]["best_possible_s"] > 0
    assert set(results["targets"]) == {
        "continuous_vs_static",
        "continuous_vs_hf_continuous",
        "roofline_fraction",
        "triton_overhead",
        "continuous_vs_vllm_triton",
        "itl_p50_vs_vllm_triton",
        "itl_p90_vs_vllm_triton",
        "inprocess_vs_vllm_offline",
        "bf16_vs_vllm_triton_bf16",
        "int8_vs_vllm_triton_bf16",
        "bf16_itl_p50_vs_vllm_triton_bf16",
        "bf16_itl_p90_vs_vllm_triton_bf16",
    }
    assert results["targets"]["continuous_vs_vllm_triton"]["value"] is None  # no peer run
    assert results["targets"]["bf16_vs_vllm_triton_bf16"]["value"] is None
    assert results["machine"]["cpu_model"] and "load_average_1m" in results["machine"]
    for name in ("throughput.png", "latency_cdf.png", "batch_timeline.png"):
        assert (out / name).stat().st_size > 1000
    summary = json.loads((out / "summary.json").read_text())
    assert summary["targets"] == results["targets"]
    assert [r["summary"] for r in summary["runs"]] == [r["summary"] for r in results["runs"]]
    assert not any("records" in r or "timeline" in r for r in summary["runs"])


def test_rounds_alternate_order_and_report_the_median(monkeypatch):
    from slipstream_bench import runner

    calls = []
    speed = {
        ("inprocess", 0): 10.0,
        ("inprocess", 1): 30.0,
        ("inprocess", 2): 20.0,
        ("continuous", 0): 5.0,
        ("continuous", 1): None,
        ("continuous", 2): 7.0,
    }

    def fake_run_mode(mode, sh, r):
        calls.append((mode, r))
        tps = speed[(mode, r)]
        return {"label": mode, "round": r, "summary": {"tokens_per_s": tps} if tps else {}}

    monkeypatch.setattr(runner, "run_mode", fake_run_mode)
    opts = runner.BenchOptions(modes=("inprocess", "continuous"), repeat=3)
    sh = runner._Shared(opts, None, [], None, None)
    runs = runner.run_rounds(sh)
    assert calls == [
        ("inprocess", 0),
        ("continuous", 0),
        ("continuous", 1),
        ("inprocess", 1),
        ("inprocess", 2),
        ("continuous", 2),
    ]
    reps = {r["label"]: r for r in runner.representatives(runs)}
    assert reps["inprocess"]["round"] == 2 and reps["inprocess"]["summary"]["tokens_per_s"] == 20.0
    # a failed round (no tokens/s) ranks slowest: the median of (fail, 5, 7) is 5
    assert reps["continuous"]["round"] == 0
    assert reps["continuous"]["rounds_tokens_per_s"] == [5.0, None, 7.0]


def test_rounds_with_equal_slo_attainment_are_represented_by_their_median_speed():
    from slipstream_bench import runner

    def run(r, attainment, tps):
        return {
            "label": "m",
            "round": r,
            "slo": {"attainment": attainment},
            "summary": {"tokens_per_s": tps},
        }

    ties = [run(0, 1.0, 212.3), run(1, 1.0, 198.7), run(2, 1.0, 218.7)]
    (rep,) = runner.representatives(ties, by_slo=True)
    assert rep["round"] == 0 and rep["rounds_tokens_per_s"] == [212.3, 198.7, 218.7]
    # attainment still ranks first: the median round by attainment, whatever its speed
    mixed = [run(0, 0.47, 123.6), run(1, 0.84, 140.2), run(2, 0.73, 137.0)]
    (rep,) = runner.representatives(mixed, by_slo=True)
    assert rep["round"] == 2


def test_vllm_peer_modes_are_skipped_with_how_to_install_when_absent(tmp_path):
    from slipstream_bench import report, runner

    opts = runner.BenchOptions(modes=("vllm_triton", "vllm_offline"), peers_dir=tmp_path)
    sh = runner._Shared(opts, None, [], None, tmp_path)
    runs = [runner.run_peer(mode, sh, "") for mode in opts.modes]
    for run in runs:
        assert run["summary"] == {} and "setup_peers.py" in run["skipped"]
    text = report.table({"runs": runs})
    assert text.count("skipped: vLLM peer not installed") == 2


def test_variants_parse_into_named_settings():
    from slipstream_bench.cli import _variants

    assert _variants(["mkl:cpu_linear=transposed,attention_ops=torch", "defaults:"]) == {
        "mkl": {"cpu_linear": "transposed", "attention_ops": "torch"},
        "defaults": {},
    }
    with pytest.raises(SystemExit):
        _variants(["bad name:x=1"])


def _setup_peers_module():
    import importlib.util

    path = ROOT / "scripts" / "setup_peers.py"
    spec = importlib.util.spec_from_file_location("setup_peers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_setup_peers_patches_vllm_backend_for_vllm_0_32(tmp_path):
    setup = _setup_peers_module()
    src = tmp_path / "src"
    (src / "utils").mkdir(parents=True)
    (src / "model.py").write_text("import json\nimport numpy as np\n")
    (src / "utils" / "request.py").write_text("from vllm.inputs.data import TokensPrompt\n")
    (src / "utils" / "metrics.py").write_text(
        "from vllm.v1.metrics.loggers import StatLoggerBase, build_1_2_5_buckets\n"
    )
    assert len(setup.patch_backend(src)) == 3
    assert "from vllm.inputs import TokensPrompt" in (src / "utils" / "request.py").read_text()
    assert (
        "vllm.v1.metrics.buckets import build_1_2_5_buckets"
        in (src / "utils" / "metrics.py").read_text()
    )
    model = (src / "model.py").read_text()
    assert model.index('setlocale(locale.LC_CTYPE, "C.UTF-8")') < model.index("import numpy")
    assert setup.patch_backend(src) == []  # applied once, idempotent
    (src / "model.py").write_text("import json\n")  # a version the patch does not know
    with pytest.raises(SystemExit, match="differs"):
        setup.patch_backend(src)


def _record(rid: str, ttft: float, tpot: float, n: int = 5, error=None) -> RequestRecord:
    rec = RequestRecord(rid, 10, n, send_time=0.0, error=error)
    rec.token_times = [ttft + tpot * i for i in range(n)]
    return rec


def test_slo_attainment_counts_requests_meeting_both_targets():
    from slipstream_bench.goodput import Slo, attainment

    slo = Slo(ttft_ms=2000, tpot_ms=150)
    records = [
        _record("ok", 1.0, 0.1),
        _record("slow_first", 2.5, 0.1),
        _record("slow_tokens", 1.0, 0.2),
        _record("one_token", 1.5, 9.0, n=1),
        _record("failed", 0.1, 0.01, error="boom"),
    ]
    assert attainment(records, slo) == pytest.approx(2 / 5)  # ok, one_token (no TPOT)


def test_goodput_is_the_highest_rate_whose_attainment_reaches_the_target():
    from slipstream_bench.goodput import Slo, goodput

    slo = Slo(attainment=0.9)
    got = goodput([(2.0, 0.95), (1.0, 1.0), (3.0, 0.7), (4.0, 0.92)], slo)
    assert got["goodput_rps"] == 2.0  # 4.0 recovering above a failing 3.0 is noise
    assert got["goodput_interpolated_rps"] == pytest.approx(2.0 + (0.95 - 0.9) / (0.95 - 0.7))
    assert goodput([(1.0, 0.5)], slo)["goodput_rps"] == 0.0
    assert goodput([(1.0, 0.99), (2.0, 0.95)], slo)["met_at_every_rate"]


def test_a_sampling_mix_reaches_every_path_with_a_greedy_share_and_seeds():
    from slipstream_bench.inprocess import exact_params
    from slipstream_bench.loadgen import sampling_json
    from slipstream_bench.workload import BenchRequest, SamplingMix, apply_sampling

    workload = Workload([BenchRequest(f"r{i}", "x", 3, 8) for i in range(10)])
    mix = SamplingMix(temperature=0.8, top_p=0.95, seeded=True, greedy_fraction=0.3)
    apply_sampling(workload, mix, seed=4)
    greedy = [r for r in workload.requests if r.sampling is None]
    sampled = [r for r in workload.requests if r.sampling]
    assert len(greedy) == 3 and len(sampled) == 7
    assert len({r.sampling["seed"] for r in sampled}) == 7
    body = json.loads(sampling_json(sampled[0]))
    assert body == {
        "max_tokens": 8,
        "min_tokens": 8,
        "ignore_eos": True,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": sampled[0].sampling["seed"],
    }
    assert json.loads(sampling_json(greedy[0]))["temperature"] == 0.0
    params = exact_params(8, sampled[0].sampling)
    assert (params.temperature, params.top_p, params.seed) == (
        0.8,
        0.95,
        sampled[0].sampling["seed"],
    )
    assert workload.sampled and workload.description["sampling"]["greedy_fraction"] == 0.3


def test_a_rate_sweep_reports_attainment_per_rate_goodput_and_a_plot(monkeypatch, tmp_path):
    from slipstream_bench import plots, report, runner
    from slipstream_bench.metrics import records_to_json
    from slipstream_bench.workload import BenchRequest

    # the fake system: requests meet the SLO at low rates, continuous holds out longer
    def fake_run_mode(mode, sh, r):
        limit = {"inprocess": 2.5, "continuous": 4.5}[mode]
        slow = sh.opts.all_rates.index(rate_of[sh.tag]) + 1 > limit
        recs = [_record(f"q{i}", 3.0 if slow and i % 2 else 0.5, 0.05) for i in range(10)]
        return {
            "label": mode,
            "kind": "triton",
            "round": r,
            "summary": summarize(recs),
            "records": records_to_json(recs),
        }

    rates = (1.0, 2.0, 3.0, 4.0, 5.0)
    rate_of = {f"_rate{x:g}": x for x in rates}
    monkeypatch.setattr(runner, "run_mode", fake_run_mode)
    opts = runner.BenchOptions(modes=("inprocess", "continuous"), rates=rates)
    workload = Workload([BenchRequest(f"q{i}", "x", 3, 5) for i in range(10)])
    sh = runner._Shared(opts, workload, [], None, None)
    sweep = [runner.run_rate(sh, rate) for rate in rates]
    good = runner.goodputs(sweep, opts.slo)
    assert good["inprocess"]["goodput_rps"] == 2.0 and good["continuous"]["goodput_rps"] == 4.0
    results = {
        "runs": sweep[0]["runs"],
        "slo": vars(opts.slo),
        "sweep": [{"rate": p["rate"], "runs": p["runs"]} for p in sweep],
        "goodput": good,
    }
    text = report.slo_table(results)
    assert "goodput continuous: 4 req/s" in text and text.count("inprocess") >= 5
    assert plots.slo_attainment(results, tmp_path / "slo.png").stat().st_size > 1000


def test_reduced_precision_targets_compare_the_bf16_and_int8_variants_with_vllm_bf16():
    from slipstream_bench import report

    def run(label, tps, itl):
        return {
            "label": label,
            "summary": {
                "output_tokens": 10,
                "tokens_per_s": tps,
                "itl_ms": {"p50": itl, "p90": 2 * itl},
            },
        }

    results = {
        "runs": [
            run("vllm_triton_bf16", 100.0, 50.0),
            run("continuous[bf16]", 130.0, 40.0),
            run("continuous[int8]", 140.0, 45.0),
        ]
    }
    judged = report.judged(results)
    assert judged["bf16_vs_vllm_triton_bf16"]["value"] == pytest.approx(1.3)
    assert judged["bf16_vs_vllm_triton_bf16"]["met"] is True
    assert judged["int8_vs_vllm_triton_bf16"]["met"] is False  # 1.4 < 1.5
    assert judged["bf16_itl_p90_vs_vllm_triton_bf16"]["value"] == pytest.approx(0.8)


def test_llamacpp_modes_are_skipped_with_the_setup_hint_when_not_built(tmp_path):
    from slipstream_bench import llamacpp_peer

    with pytest.raises(llamacpp_peer.PeerUnavailable, match="setup_llamacpp.sh"):
        llamacpp_peer.load_peer(tmp_path)
