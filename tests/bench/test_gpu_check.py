"""``benchmarks/gpu_check.py`` runs end to end: on CPU with ``--smoke`` (tiny shapes, Triton's
interpreter) every part reports, none fails; the tokenizer it carries to a GPU machine is the
embedded model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_smoke_run_reports_every_part_without_an_error(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the script finds its own
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=1500,
        cwd=tmp_path,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(out.read_text())
    parts = data["parts"]
    assert not [name for name, part in parts.items() if "result" not in part], parts
    correctness = [p["result"] for n, p in parts.items() if "correctness" in n]
    assert {(r["dtype"], r["cuda_graphs"]) for r in correctness} == {
        ("float32", True),
        ("bfloat16", True),
    }
    for r in correctness:
        assert r["positions"] > 0 and r["within_margin"] >= r["exact"] > 0.5
        assert r["prefix_cache_hit_tokens"] > 0  # the second wave hit the first's prefixes
        assert r["steps"] > 0
    attention = parts["decode attention tiny"]["result"]
    assert [(r["batch"], r["context"]) for r in attention] == [(1, 32), (2, 32)]
    speed = parts["tiny: engine speed"]["result"]
    assert [r["batch"] for r in speed["rows"]] == [1, 2]
    for row in speed["rows"]:
        assert row["tokens_per_s"] > 0 and row["roofline_ms"] > 0
        assert row["transformers_tokens_per_s"] > 0
    assert speed["profile"]["top"] and speed["profile"]["wall_ms"] > 0
    assert "| correctness |" in proc.stdout and "| engine |" in proc.stdout


def test_the_carried_tokenizer_is_the_embedded_models():
    sys.path.insert(0, str(REPO / "benchmarks"))
    from slipstream.worker.model import loader
    from slipstream_bench.gpu_models import load_tokenizer

    embedded = loader.load_tokenizer(loader.resolve_model_path("default"))
    carried = load_tokenizer()
    text = "The capital of France is Paris. <|im_start|>user\nDéjà vu: 12345 ✓<|im_end|>"
    assert carried(text)["input_ids"] == embedded(text)["input_ids"]
    assert carried.eos_token == embedded.eos_token and len(carried) == len(embedded)
