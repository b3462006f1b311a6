"""``slipstream serve``'s deployment-facing options: the rendered repository links what it
does not rewrite (weights in the repository must not fill a small /tmp), ``--server-arg``
passes tritonserver options through (refusing those serve sets itself), and deploy/serve.sh
turns SLIPSTREAM_SERVER_ARGS into them."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.server.launch.cli import OWNED_SERVER_OPTIONS, server_args
from slipstream.server.launch.config_pbtxt import read_parameters
from slipstream.server.launch.repository import LINK_FROM_BYTES, render_model_repository
from support import ROOT, need_tritonserver


def write_repo(root: Path) -> Path:
    model = root / "repo" / "llm"
    (model / "1" / "weights").mkdir(parents=True)
    (model / "config.pbtxt").write_text('name: "llm"\nbackend: "slipstream"\n')
    (model / "1" / "model.json").write_text('{"model": "./weights"}')
    (model / "1" / "weights" / "model.safetensors").write_bytes(b"\0" * LINK_FROM_BYTES)
    (model / "1" / "model.py").write_text("# the source's model.py\n")
    return root / "repo"


def test_render_copies_small_files_and_links_large_ones(tmp_path):
    src = write_repo(tmp_path)
    out = render_model_repository(src, tmp_path / "out", {"max_num_seqs": 4})
    config = out / "llm" / "config.pbtxt"
    assert not config.is_symlink() and read_parameters(config.read_text()) == {"max_num_seqs": "4"}
    weights = out / "llm" / "1" / "weights" / "model.safetensors"
    assert (
        weights.is_symlink()
        and weights.resolve() == (src / "llm" / "1" / "weights" / "model.safetensors").resolve()
    )
    assert not (out / "llm" / "1" / "model.json").is_symlink()
    assert (out / "llm" / "1" / "weights").is_dir() and not (
        out / "llm" / "1" / "weights"
    ).is_symlink()
    # the source is left as it was
    assert read_parameters((src / "llm" / "config.pbtxt").read_text()) == {}


def test_render_again_replaces_the_previous_rendering_not_the_source(tmp_path):
    src = write_repo(tmp_path)
    render_model_repository(src, tmp_path / "out", {"max_num_seqs": 4})
    render_model_repository(src, tmp_path / "out", {"max_num_seqs": 8})
    assert (src / "llm" / "1" / "weights" / "model.safetensors").stat().st_size == LINK_FROM_BYTES
    assert read_parameters((tmp_path / "out" / "llm" / "config.pbtxt").read_text()) == {
        "max_num_seqs": "8"
    }


def test_writing_a_file_of_a_rendering_leaves_the_source_as_it_was(tmp_path):
    # tests and benchmarks write their own model.py into a rendered repository
    src = write_repo(tmp_path)
    out = render_model_repository(src, tmp_path / "out", {"max_num_seqs": 4})
    (out / "llm" / "1" / "model.py").write_text("# a test's fault-injecting model.py\n")
    assert (src / "llm" / "1" / "model.py").read_text() == "# the source's model.py\n"


def test_server_args_pass_options_and_refuse_what_serve_sets():
    assert server_args(["--log-format=ISO8601", "--http-thread-count=4"]) == [
        "--log-format=ISO8601",
        "--http-thread-count=4",
    ]
    for owned in ("--http-port=1", "--model-control-mode=poll", "--model-repository=/x"):
        assert owned.split("=")[0] in OWNED_SERVER_OPTIONS
        with pytest.raises(SystemExit, match="set by slipstream serve"):
            server_args([owned])
    with pytest.raises(SystemExit, match="--name=value"):
        server_args(["log-format=ISO8601"])


def test_serve_sh_turns_slipstream_server_args_into_server_arg_options(tmp_path):
    """deploy/serve.sh with a stand-in `slipstream` that prints its arguments."""
    fake = tmp_path / "bin" / "slipstream"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    fake.chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}",
        "SLIPSTREAM_SERVER_ARGS": "--log-format=ISO8601  --trace-config=rate=100",
    }
    out = subprocess.run(
        [str(ROOT / "deploy" / "serve.sh"), "--set", "max_num_seqs=2"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    args = out.stdout.split("\n")
    assert args[0] == "serve"
    assert "--server-arg=--log-format=ISO8601" in args
    assert "--server-arg=--trace-config=rate=100" in args
    sets = [args[i + 1] for i, a in enumerate(args) if a == "--set"]
    assert "max_num_seqs=2" in sets  # the caller's own serve options still arrive


@pytest.mark.server
@pytest.mark.slow
def test_serve_passes_server_args_to_the_real_tritonserver_and_answers_a_prompt(tmp_path):
    """ISO 8601 log lines prove Triton got the option; --prompt streams over gRPC (the
    client extra)."""
    need_tritonserver()
    from support import tiny_model_dir

    log = tmp_path / "triton.log"
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--model",
        str(tiny_model_dir("llama")),
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        "0",
        "--set",
        "max_model_len=256",
        "--set",
        "kv_cache_memory_bytes=8000000",
        "--server-arg=--log-format=ISO8601",
        "--log-file",
        str(log),
        "--prompt",
        "Hello",
        "--raw-prompt",
        "--max-tokens",
        "4",
        "--exit-after-prompt",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "finish_reason" in out.stdout
    first = next(line for line in log.read_text().splitlines() if line.strip())
    assert first[:4].isdigit() and first[4] == "-" and "T" in first[:20], first
