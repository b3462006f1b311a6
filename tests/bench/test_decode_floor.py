"""The memory floor of a decode step (``slipstream_bench.decode_floor``) and the machine probe
it is held to (``machine_probe``), on the tiny model: the weights a step reads are counted as
the engine holds them, and the probe's figures are real measurements."""

import pytest
import torch

from slipstream.worker import kernels
from slipstream_bench import decode_floor, machine_probe
from support import tiny_model_dir

pytestmark = pytest.mark.skipif(
    not kernels.load(), reason=f"no CPU kernel: {kernels.unavailable_reason()}"
)


def _engine(**settings):
    from slipstream import EngineConfig
    from slipstream.engine import LLMEngine

    return LLMEngine(
        EngineConfig(
            model=str(tiny_model_dir("llama")),
            device="cpu",
            max_model_len=128,
            num_gpu_blocks_override=32,
            **settings,
        )
    )


def _linear_shapes(model) -> list[tuple[int, int]]:
    return [
        (m.out_features, m.in_features) for m in model.modules() if isinstance(m, torch.nn.Linear)
    ]


def test_a_step_reads_each_weight_once_at_its_formats_bytes():
    fp32 = _engine()
    assert decode_floor.step_weight_bytes(fp32.model) == sum(
        4 * n * k for n, k in _linear_shapes(fp32.model)
    )
    int8 = _engine(quantization="int8")
    # per weight one byte and a float32 scale per 32; 8 outlier columns a layer in float32
    # (the tiny model's widths are whole panels of 32: no padding)
    expected = sum(n * k * 9 // 8 + n * 8 * 4 for n, k in _linear_shapes(int8.model))
    # fused q/k/v and gate/up plans are counted once, as their parts' bytes
    assert decode_floor.step_weight_bytes(int8.model) == expected


def test_the_probe_measures_bandwidth_and_peak_rates():
    bandwidth = machine_probe.Bandwidth(64 * 2**20).measure(passes=2)
    assert 1e8 < bandwidth < 1e13  # bytes a second: a real figure, not a constant
    assert machine_probe.peak_macs_per_second("float32", iterations=20_000) > 1e8
    flags = machine_probe.describe_cpu()
    assert flags.threads == torch.get_num_threads() and flags.model


def test_the_floor_table_holds_every_format_asked_for():
    result = decode_floor.run(
        ["int8", "bfloat16"],
        [1],
        rounds=1,
        context=8,
        steps=2,
        model=str(tiny_model_dir("llama")),
        bandwidth_bytes=32 * 2**20,
    )
    rows = {r["format"]: r for r in result["rows"]}
    assert set(rows) == {"int8", "bfloat16"} and result["cpu"]
    for row in rows.values():
        assert row["step_ms"] >= row["forward_ms"] > 0 and row["floor_ms"] > 0
        assert row["step_over_floor"] == pytest.approx(row["step_ms"] / row["floor_ms"])
        # the compiled stack ran the layers: its phases are reported
        assert set(row["phases_ms"]) >= {"qkv", "attention", "down"}
    assert rows["int8"]["weight_mb"] < rows["bfloat16"]["weight_mb"]
    assert "where a step's layers go" in decode_floor.format_table(result)
