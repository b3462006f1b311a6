"""An engine fault a real-server test can switch on while a file says so (the stub reads
``SLIPSTREAM_FAULT_FILE`` from its environment): ``raise`` (the forward raises on every step),
``block`` (it never returns), ``sampler`` (the sampler raises on every step), ``poison N``
(the forward raises whenever a request with a prompt of N tokens or more is in the batch: one
request that alone breaks the forward), ``slow S`` (every step takes S seconds more: a request
that must outlive a deadline, whatever the machine's speed)."""

from __future__ import annotations

from pathlib import Path

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.repository import render_model_repository

FAULT_MODEL_PY = """
import os
import sys
import threading
import time

for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401
from slipstream.worker.model_runner import ModelRunner  # noqa: E402
from slipstream.worker.sample.sampler import Sampler  # noqa: E402


def _fault():
    try:
        with open(os.environ["SLIPSTREAM_FAULT_FILE"]) as f:
            return f.read().split()
    except OSError:
        return []


def _poisoned(sched, min_tokens):
    return any(item.request.num_prompt_tokens >= min_tokens for item in sched.scheduled)


def _faulty(method):
    def run(self, sched, *args, **kwargs):
        kind = _fault()
        if kind == ["raise"]:
            raise RuntimeError("injected fault: the device is lost")
        if kind == ["block"]:
            threading.Event().wait()  # a kernel that never returns
        if kind[:1] == ["slow"]:
            time.sleep(float(kind[1]))
        if kind[:1] == ["poison"] and _poisoned(sched, int(kind[1])):
            raise RuntimeError("injected fault: this request breaks the forward")
        return method(self, sched, *args, **kwargs)
    return run


def _faulty_sampler(method):
    def run(self, *args, **kwargs):
        if _fault() == ["sampler"]:
            raise RuntimeError("injected fault: the sampler's kernel failed")
        return method(self, *args, **kwargs)
    return run


ModelRunner.execute = _faulty(ModelRunner.execute)
ModelRunner.execute_with_prompt_logits = _faulty(ModelRunner.execute_with_prompt_logits)
Sampler._sample = _faulty_sampler(Sampler._sample)
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
