"""`slipstream serve` as a vLLM user types it, on a real tritonserver: the model positional, vLLM's
engine flags, --served-model-name and --port; its start-up talks: each phase the engine logs
(read back from Triton's log, where the stub's handler put it) is printed with its time before
"ready"."""

import re
import subprocess
import sys

import pytest

from support import need_tritonserver, tiny_model_dir

pytestmark = [pytest.mark.server, pytest.mark.slow]


def test_serve_with_vllm_flags_prints_each_startup_phase_and_serves_the_renamed_model(tmp_path):
    need_tritonserver()
    log = tmp_path / "triton.log"
    cmd = [sys.executable, "-m", "slipstream.server", str(tiny_model_dir("llama"))]
    cmd += ["--max-model-len", "256", "--max-num-seqs", "4", "--enforce-eager"]
    cmd += ["--kv-cache-memory-bytes", "8000000", "--served-model-name", "tiny", "--port", "0"]
    cmd += ["--http-port", "0", "--grpc-port", "0", "--metrics-port", "0", "--log-file", str(log)]
    cmd += ["--prompt", "Hello", "--raw-prompt", "--max-tokens", "4", "--exit-after-prompt"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    text = out.stdout
    assert out.returncode == 0, text + out.stderr
    ready = text.index("ready in")
    phases = {
        m.group(1)
        for m in re.finditer(r"^  (weight load|packing|KV allocation) +[\d.]+ s", text, re.M)
    }
    assert phases == {"weight load", "packing", "KV allocation"}, text
    assert max(text.index(f"  {p} ") for p in phases) < ready  # printed as they happened
    assert re.search(r"KV allocation +[\d.]+ s  \(\d+ blocks of 16 tokens", text)
    assert "models   tiny" in text and "OpenAI   http://" in text
    assert "[4 tokens" in text or "tokens, finish_reason" in text
    # the engine's lines went through pb_utils.Logger into Triton's own log
    assert "slipstream: slipstream phase" in log.read_text()
