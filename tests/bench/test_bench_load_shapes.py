"""The benchmark's load shapes and comparisons: one request at a time (a closed loop), the
automatic rate sweep that stops once every system misses the SLO, and the greedy agreement
of matched weight formats."""

import threading
import time

from slipstream_bench import runner
from slipstream_bench.agreement import compare, greedy_agreement, weight_format
from slipstream_bench.driver import Arrivals, send_on_schedule
from slipstream_bench.goodput import Slo
from slipstream_bench.metrics import RequestRecord


def test_a_closed_loop_of_one_sends_each_request_after_the_previous_ones_last_token():
    records = [RequestRecord(str(i), 4, 3) for i in range(4)]
    sent_while_busy = []

    def serve(rec: RequestRecord) -> None:
        for _ in range(rec.max_tokens):
            time.sleep(0.005)
            rec.add_tokens(time.perf_counter(), 1)

    def send(i: int) -> None:
        busy = [r.id for r in records[:i] if not r.finished]
        sent_while_busy.extend(busy)
        records[i].send_time = time.perf_counter()
        threading.Thread(target=serve, args=(records[i],)).start()

    send_on_schedule(Arrivals([0.0] * 4, max_in_flight=1), send, records=records)
    while not all(r.finished for r in records):
        time.sleep(0.001)
    assert sent_while_busy == []
    for before, after in zip(records, records[1:]):
        assert after.send_time >= before.token_times[-1]


def test_an_open_loop_sends_everything_at_once_whatever_is_in_flight():
    records = [RequestRecord(str(i), 4, 3) for i in range(3)]
    sent = []
    send_on_schedule(Arrivals([0.0] * 3), sent.append, records=records)
    assert sent == [0, 1, 2] and not any(r.finished for r in records)


def _run(label: str, attainment: float) -> dict:
    return {"label": label, "slo": {"attainment": attainment}, "summary": {}}


def test_the_automatic_sweep_raises_the_rate_until_every_mode_misses_and_retires_each_miss(
    monkeypatch,
):
    # mode a meets the SLO up to 2 req/s, mode b up to 3: rates 1, 2, 3, 4 are measured
    limits = {"a": 2.0, "b": 3.0}
    measured: list = []

    def fake_rounds(sh):
        rate = sh.current_rate
        measured.append((rate, sorted(m for m in limits if m not in sh.retired)))
        return [_run(m, 1.0 if rate <= limits[m] else 0.5) for m in limits if m not in sh.retired]

    def fake_rate(sh, rate):
        sh.current_rate = rate
        return {"rate": rate, "arrivals_s": [], "runs": fake_rounds(sh)}

    monkeypatch.setattr(runner, "run_rate", fake_rate)
    opts = runner.BenchOptions(rates=(1.0,), sweep_until_all_fail=True, sweep_step=1.0)
    opts.slo = Slo()
    sh = runner._Shared(opts, None, [], None, None)
    sweep = runner.run_sweep(sh)
    assert [p["rate"] for p in sweep] == [1.0, 2.0, 3.0, 4.0]
    assert measured == [(1.0, ["a", "b"]), (2.0, ["a", "b"]), (3.0, ["a", "b"]), (4.0, ["b"])]
    assert sh.retired == {"a", "b"}


def test_greedy_agreement_pairs_each_slipstream_format_with_the_peer_of_the_same_values():
    texts = ["The capital of France is Paris.", "One, two, three"]
    ours = [{"text": t} for t in texts]
    peer = [{"text": texts[0]}, {"text": "One, two, four"}]
    runs = [
        {
            "label": "continuous[int8]",
            "kind": "triton",
            "settings": {"quantization": "int8"},
            "records": ours,
        },
        {"label": "continuous", "kind": "triton", "settings": {}, "records": ours},
        {"label": "llamacpp_q8_0", "kind": "peer_llamacpp", "records": peer},
        {"label": "llamacpp_bf16", "kind": "peer_llamacpp", "records": peer},
    ]
    assert weight_format(runs[0]) == "int8" and weight_format(runs[1]) == "fp32"
    rows = greedy_agreement(runs)
    assert [(r["format"], r["slipstream"], r["peer"]) for r in rows] == [
        ("int8", "continuous[int8]", "llamacpp_q8_0")
    ]
    assert rows[0]["identical"] == 0.5
    assert compare(ours, ours) == {"requests": 2, "identical": 1.0, "mean_prefix_share": 1.0}
