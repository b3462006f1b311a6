"""Triton's model-repository API (load, unload, index) is closed by default: a client that
reaches the HTTP or gRPC port cannot take the model away or load code, the launcher (which
alone knows the key) still unloads for its clean stop, and an operator may open it."""

import json
import os
import urllib.error
import urllib.request

import pytest

grpcclient = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

from slipstream.server.launch.launcher import TritonServer  # noqa: E402
from slipstream.server.launch.repository import render_model_repository  # noqa: E402
from slipstream.server.launch.repository_api import MODEL_CONTROL_HEADER  # noqa: E402
from server_support import OVERRIDES, REPO, run_stream, text_inputs, texts  # noqa: E402
from support import ROOT  # noqa: E402

pytestmark = pytest.mark.skipif(
    os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1", reason="SLIPSTREAM_SKIP_SERVER_TESTS=1"
)


def post(server, path, body=b"", headers=None):
    req = urllib.request.Request(
        f"http://{server.http_url}{path}", data=body, method="POST", headers=headers or {}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


@pytest.mark.server
@pytest.mark.slow
def test_unauthenticated_load_and_unload_are_refused_and_the_launcher_still_stops_cleanly(
    tiny_model, tmp_path
):
    """Before: POST .../unload answered 200 and the model went not ready for everyone, and a
    load with a config override pointing at /etc was accepted."""
    repo = render_model_repository(REPO, tmp_path / "repo", {"model": str(tiny_model), **OVERRIDES})
    server = TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300, exit_timeout=10
    ).start()
    try:
        evil = json.dumps(
            {
                "parameters": {
                    "config": json.dumps(
                        {"backend": "python", "parameters": {"model": {"string_value": "/etc"}}}
                    )
                }
            }
        ).encode()
        for path, body in [
            ("/v2/repository/models/slipstream/unload", b""),
            ("/v2/repository/models/slipstream/load", evil),
            ("/v2/repository/models/intruder/load", evil),
            ("/v2/repository/index", b""),
        ]:
            status, text = post(server, path, body)
            assert status == 403 and "restricted" in text.lower(), (path, status, text)
            wrong = post(server, path, body, {MODEL_CONTROL_HEADER: "guess"})
            assert wrong[0] == 403, (path, wrong)
        with grpcclient.InferenceServerClient(server.grpc_url) as client:
            for call in (
                lambda: client.unload_model("slipstream"),
                lambda: client.load_model("slipstream"),
                lambda: client.get_model_repository_index(),
            ):
                with pytest.raises(InferenceServerException, match="(?i)restricted"):
                    call()
            assert client.is_model_ready("slipstream")
        assert server.is_ready()
        results, error = run_stream(
            server, text_inputs("still here", sampling={"temperature": 0, "max_tokens": 3})
        )
        assert error is None and texts(results)
        assert server.model_states() == {"slipstream": "READY"}  # the launcher has the key
        code = server.stop()
    finally:
        server.kill()
    assert code == 0 and server.last_stop.models_unloaded and not server.last_stop.killed
    assert "slipstream: finalize" in server.log_path.read_text()


def test_the_api_is_restricted_unless_the_operator_opens_it():
    closed = TritonServer(REPO, http_port=1, grpc_port=2, metrics_port=3)
    opened = TritonServer(REPO, http_port=1, grpc_port=2, metrics_port=3, open_model_control=True)
    for server in (closed, opened):
        server.install = type("I", (), {"binary": "tritonserver", "backend_dir": None})()
    cmd = closed.command()
    key = closed.model_control_key
    assert key and len(key) >= 32 and key != TritonServer(REPO).model_control_key
    for flag in ("--http-restricted-api", "--grpc-restricted-protocol"):
        assert f"{flag}=model-repository:{MODEL_CONTROL_HEADER}={key}" in cmd
    assert not any("restricted" in arg for arg in opened.command())
    from slipstream.server.launch.cli import build_parser

    args = build_parser().parse_args(["serve", "--allow-model-control"])
    assert args.allow_model_control
    assert not build_parser().parse_args(["serve"]).allow_model_control


def test_the_container_and_manifests_do_not_open_the_model_control_api():
    shipped = [
        ROOT / "Dockerfile",
        ROOT / "deploy" / "serve.sh",
        *sorted((ROOT / "deploy").rglob("*.yaml")),
    ]
    assert len(shipped) > 3
    for path in shipped:
        text = path.read_text()
        assert "--allow-model-control" not in text, path
        assert "restricted-" not in text, path  # the launcher sets it, with its own key
    serve = (ROOT / "deploy" / "serve.sh").read_text()
    assert "exec slipstream serve" in serve  # the launcher, which restricts by default
