"""An engine fault a real-server test can switch on: the model's forward raises or never
returns while a file says so (the stub reads ``SLIPSTREAM_FAULT_FILE`` from its environment)."""

from __future__ import annotations

from pathlib import Path

from slipstream.server.launch.launcher import TritonServer, render_model_repository

FAULT_MODEL_PY = """
import os
import sys
import threading

for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401
from slipstream.worker.model_runner import ModelRunner  # noqa: E402


def _fault():
    try:
        with open(os.environ["SLIPSTREAM_FAULT_FILE"]) as f:
            return f.read().strip()
    except OSError:
        return ""


def _faulty(method):
    def run(self, *args, **kwargs):
        kind = _fault()
        if kind == "raise":
            raise RuntimeError("injected fault: the device is lost")
        if kind == "block":
            threading.Event().wait()  # a kernel that never returns
        return method(self, *args, **kwargs)
    return run


ModelRunner.execute = _faulty(ModelRunner.execute)
ModelRunner.execute_with_prompt_logits = _faulty(ModelRunner.execute_with_prompt_logits)
"""


def faulty_server(
    repo_src: Path, model: Path, tmp_path: Path, overrides: dict, **server_kwargs
) -> tuple[TritonServer, Path]:
    """A started server whose model can be made to fail; (server, the fault file)."""
    repo = render_model_repository(repo_src, tmp_path / "repo", {"model": str(model), **overrides})
    (repo / "slipstream" / "1" / "model.py").write_text(FAULT_MODEL_PY)
    fault = tmp_path / "fault"
    server = TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        startup_timeout=300,
        env={"SLIPSTREAM_FAULT_FILE": str(fault)},
        **server_kwargs,
    )
    return server.start(), fault
