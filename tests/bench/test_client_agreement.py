"""The two-client comparison's arithmetic: attainment, goodput and ratios from each client's
own per-request figures, and vLLM's saved result read back into the same shape."""

import json

import pytest

from slipstream_bench import client_agreement as ca
from slipstream_bench.goodput import Slo


def result(client: str, ttft: list, tpot: list, duration: float = 10.0) -> ca.ClientResult:
    return ca.ClientResult(client, len(ttft), 100.0, ttft, tpot, [50.0, 60.0], duration)


def test_a_request_counts_as_good_only_when_it_meets_both_targets():
    slo = Slo(ttft_ms=2000, tpot_ms=150)
    # met, ttft too slow, tpot too slow, met at the limits
    row = result("a", [100, 2500, 100, 2000], [100, 100, 151, 150]).row(slo)
    assert row["attainment"] == pytest.approx(0.5)
    assert row["goodput_rps"] == pytest.approx(2 / 10.0)
    assert row["ttft_p50_ms"] == pytest.approx(1050.0)


def test_medians_and_the_ratio_row_compare_the_same_field_of_both_clients():
    slo = Slo()
    rounds = [
        sorted(
            [result("slipstream x", [100.0 * k], [50.0]).row(slo),
             result("vllm y", [200.0 * k], [100.0]).row(slo)],
            key=lambda r: r["client"],
        )
        for k in (1, 2, 3)
    ]  # fmt: skip
    medians = ca._medians(rounds)
    assert [m["client"] for m in medians] == ["slipstream x", "vllm y"]
    assert medians[0]["ttft_p50_ms"] == 200.0 and medians[1]["ttft_p50_ms"] == 400.0
    ratio = ca._ratio(medians)
    assert ratio["ttft_p50_ms"] == pytest.approx(0.5) and ratio["tpot_p50_ms"] == 0.5
    assert "slipstream / vllm" in ca.table({"median": medians})


def test_vllm_saved_result_becomes_per_request_ttft_and_tpot(tmp_path, monkeypatch):
    """TPOT from vLLM's detailed result: the request's inter-token gaps over n - 1."""
    saved = {
        "completed": 2,
        "output_throughput": 12.5,
        "duration": 4.0,
        "ttfts": [0.5, 1.0],
        "itls": [[0.1, 0.3], [0.2, 0.2, 0.2]],
        "output_lens": [3, 4],
    }

    def fake_run(args, **_):
        out = tmp_path / args[args.index("--result-filename") + 1]
        out.write_text(json.dumps(saved))

    monkeypatch.setattr(ca.subprocess, "run", fake_run)

    class Req:
        prompt, max_tokens = "hello there", 3

    class W:
        requests = [Req(), Req()]

    got = ca._vllm("python", "http://x", "/m", W(), 2.0, 0, {"temperature": 0.8}, tmp_path)
    assert got.completed == 2 and got.tokens_per_s == 12.5 and got.duration_s == 4.0
    assert got.ttft_ms == [500.0, 1000.0]
    assert got.tpot_ms == pytest.approx([200.0, 200.0])
    assert len(got.itl_ms) == 5
    lines = (tmp_path / "prompts.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"prompt": "hello there", "output_tokens": 3}
