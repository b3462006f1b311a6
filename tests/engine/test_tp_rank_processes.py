"""How rank 0 starts the other ranks: with the environment's Python (inside Triton's stub
``sys.executable`` is the stub binary), this very package first on their path."""

import os
import sys
from pathlib import Path

import slipstream
from slipstream.engine.executor import rank_processes


def test_inside_the_stub_the_environments_python_is_found_beside_its_prefix(monkeypatch, tmp_path):
    stub = tmp_path / "triton_python_backend_stub"
    stub.write_text("#!/bin/sh\n")
    stub.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(stub))
    python = Path(rank_processes.environment_python())
    assert python.name.startswith("python") and os.access(python, os.X_OK)
    assert python.parent == Path(sys.prefix) / "bin"


def test_outside_the_stub_it_is_this_interpreter():
    assert rank_processes.environment_python() == sys.executable


def test_the_ranks_import_the_package_rank_0_runs():
    assert Path(rank_processes.package_root()) / "slipstream" == Path(slipstream.__file__).parent
