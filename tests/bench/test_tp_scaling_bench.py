"""The tensor-parallel benchmark's smoke run: both configurations on both workloads, every
request answered, and rank 0's collectives counted per step (the figures themselves are taken
on a quiet machine, not here)."""

import json

from slipstream_bench import tp_scaling
from support import tiny_model_dir


def test_the_tp_benchmark_measures_one_and_two_ranks_on_burst_and_poisson(tmp_path):
    code = tp_scaling.main(
        [
            "--quick",
            "--model",
            str(tiny_model_dir("llama")),
            "--set",
            "max_model_len=1024",
            "--output-dir",
            str(tmp_path),
            "--no-progress",
        ]
    )
    assert code == 0
    report = json.loads((tmp_path / "tp_scaling.json").read_text())
    medians = report["medians"]
    assert set(medians) == {"burst", "poisson"}
    for workload in medians.values():
        assert set(workload) == {"tp1", "tp2"}
        for row in workload.values():
            assert row["errors"] == 0 and row["tokens_per_s"] > 0 and row["itl_p50_ms"] > 0
        # two layers: after attention and the MLP each, the embedding, the logits' gather
        assert workload["tp2"]["collectives_per_step"] == 2 * 2 + 2
        assert workload["tp2"]["collective_ms_per_step"] > 0
        assert workload["tp1"]["collectives_per_step"] == 0
    assert report["settings"]["tp2"]["tensor_parallel_size"] == "2"
    assert report["runs"]["poisson"]["tp2"][0]["summary"]["num_requests"] == 6
