"""vLLM as the benchmark's peer: Triton + Triton's own vLLM backend on the same
``tritonserver`` and gRPC client as the Slipstream modes, and vLLM offline (``LLM.generate``).

Both run from the vLLM virtualenv that ``scripts/setup_peers.py`` installs (its
``peers.json`` says where everything is); without it these modes are skipped with a message
saying how to install it. vLLM's own defaults are kept (its token budget, its batch size,
torch.compile), as a user replacing it would have run it, except the limits that must match
the Slipstream server's for a side-by-side run: the model (the same converted SmolLM2
weights), fp32, ``max_model_len``, ``max_num_seqs``, ``max_num_batched_tokens``, the seed
and, when the benchmark sets it, prefix caching. Its environment gets the KV space and both
cores for the model's threads (vLLM's default keeps one core for its scheduler process: on 2
cores the model would get 1).

vllm_backend asks vLLM for the OpenAI server's batch defaults, ``max_num_seqs`` 128 on CPU: a
burst of 64 then runs in shapes vLLM compiled for 128 rows; with 64 (what the independent
harness measured at 171-176 tokens/s) it runs as fast as it can, and ONE short warm-up
request (not the engine modes' two) is what that harness sent before timing.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.triton_install import find_tritonserver
from slipstream_bench import loadgen
from slipstream_bench.metrics import RequestRecord, records_to_json, summarize
from slipstream_bench.workload import Workload, scaled

MODEL_NAME = "vllm_model"
SETUP_HINT = (
    "install it with: .venv/bin/python scripts/setup_peers.py --vllm-backend-src "
    "<a clone of github.com/triton-inference-server/vllm_backend>"
)
PEER_MODES = ("vllm_triton", "vllm_triton_bf16", "vllm_offline")


class PeerUnavailable(RuntimeError):
    """The peer is not installed: the mode is skipped, not failed."""


@dataclass
class VllmPeer:
    python: Path  # the vLLM venv's interpreter
    backend_dir: Path  # python/ and vllm/ for tritonserver
    libpython_dir: str
    model_dir: str
    version: str

    @property
    def bin_dir(self) -> Path:
        return self.python.parent


def default_peers_dir() -> Path:
    from slipstream.cache_dir import cache_root

    return cache_root() / "peers"


def load_peer(peers_dir: Optional[Path] = None) -> VllmPeer:
    """The installed peer, or ``PeerUnavailable`` saying what is missing and how to fix it."""
    path = Path(peers_dir or default_peers_dir()) / "peers.json"
    if not path.exists():
        raise PeerUnavailable(f"vLLM peer not installed ({path} missing); {SETUP_HINT}")
    manifest = json.loads(path.read_text())
    v = manifest.get("vllm") or {}
    peer = VllmPeer(
        Path(v.get("python", "")),
        Path(v.get("backend_dir", "")),
        v.get("libpython_dir", ""),
        manifest.get("model_dir", ""),
        v.get("version", "?"),
    )
    missing = [
        str(p)
        for p in (
            peer.python,
            peer.backend_dir / "vllm" / "model.py",
            Path(peer.model_dir) / "config.json",
        )
        if not p.exists()
    ]
    if missing:
        raise PeerUnavailable(f"vLLM peer incomplete (missing {', '.join(missing)}); {SETUP_HINT}")
    return peer


def engine_args(
    peer: VllmPeer,
    model: str,
    max_model_len: int,
    seed: int,
    *,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int = 2048,
    prefix_caching: Optional[bool] = None,
    dtype: str = "float32",
) -> dict:
    """vLLM's engine arguments (model.json); ``prefix_caching`` None keeps vLLM's default;
    ``dtype`` bfloat16 is vLLM's best on a CPU with AVX512-BF16."""
    if model not in ("default", "", None):
        model_dir = str(Path(model).resolve())
    else:
        model_dir = peer.model_dir
    args = {
        "model": model_dir,
        "dtype": dtype,
        "max_model_len": max_model_len,
        "max_num_seqs": max_num_seqs,
        "max_num_batched_tokens": max_num_batched_tokens,
        "enforce_eager": False,
        "seed": seed,
    }
    if prefix_caching is not None:
        args["enable_prefix_caching"] = prefix_caching
    return args


def peer_env(peer: VllmPeer, threads: int) -> dict:
    """vLLM's CPU settings: KV space (GiB) and the model's threads bound to every core."""
    cores = f"0-{threads - 1}" if threads > 1 else "0"
    return {
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", cores),
        "LC_ALL": "C.UTF-8",
    }


# ------------------------------------------------------------------ Triton + vllm_backend
def write_repository(root: Path, args: dict) -> Path:
    model = root / MODEL_NAME
    (model / "1").mkdir(parents=True)
    (model / "config.pbtxt").write_text(
        'backend: "vllm"\ninstance_group [ { count: 1, kind: KIND_MODEL } ]\n'
    )
    (model / "1" / "model.json").write_text(json.dumps(args, indent=1))
    return root


class PeerTritonServer(TritonServer):
    """The same tritonserver binary, with the peer's backend directory (``python/`` with the
    stub for the vLLM venv's Python, ``vllm/``) and the vLLM venv first on PATH."""

    def __init__(self, repo: Path, peer: VllmPeer, threads: int, **kw) -> None:
        install = find_tritonserver()
        env = {
            **os.environ,
            **peer_env(peer, threads),
            "PATH": os.pathsep.join([str(peer.bin_dir), os.environ.get("PATH", "")]),
            "VIRTUAL_ENV": str(peer.python.parent.parent),
            "LD_LIBRARY_PATH": os.pathsep.join(
                install.lib_dirs + [peer.libpython_dir, os.environ.get("LD_LIBRARY_PATH", "")]
            ),
        }
        super().__init__(repo, models=(MODEL_NAME,), env=env, **kw)
        self.peer = peer

    def command(self) -> list:
        cmd = super().command()
        if "--backend-directory" in cmd:
            i = cmd.index("--backend-directory")
            del cmd[i : i + 2]
        return cmd + ["--backend-directory", str(self.peer.backend_dir)]


def run_triton(
    peer: VllmPeer,
    args: dict,
    workload: Workload,
    offsets: Sequence[float],
    warmup: Optional[Workload],
    out_dir: Path,
    threads: int,
    label: str,
    progress: bool = True,
) -> dict:
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-vllm-") as work:
        repo = write_repository(Path(work) / "model_repository", args)
        server = PeerTritonServer(
            repo,
            peer,
            threads,
            http_port=0,
            grpc_port=0,
            metrics_port=0,
            log_path=out_dir / f"tritonserver_{label}.log",
            startup_timeout=1800,
        )
        t0 = time.perf_counter()
        with server:
            startup = time.perf_counter() - t0
            if warmup is not None:
                loadgen.warm_up(server.grpc_url, scaled(warmup, 1), model=MODEL_NAME)
            records = loadgen.run_triton(
                server.grpc_url, workload, offsets, label=label, progress=progress, model=MODEL_NAME
            )
    return {
        "label": label,
        "kind": "peer_triton",
        "settings": args,
        "peer": f"vLLM {peer.version}",
        "startup_s": startup,
        "summary": summarize(records),
        "engine": {},
        "steps": {},
        "batch_sizes": {},
        "records": records_to_json(records),
        "timeline": [],
    }


# ------------------------------------------------------------------ vLLM offline
def run_offline(
    peer: VllmPeer,
    args: dict,
    workload: Workload,
    warmup: Optional[Workload],
    threads: int,
    label: str,
) -> dict:
    """``LLM.generate`` on the whole workload at once, in the vLLM venv (a subprocess).
    Offline has no arrival schedule and no streaming: every request is sent at the start
    and its tokens count at the end, so only tokens/s and E2E are meaningful."""
    job = {
        "engine_args": args,
        "prompts": [r.prompt for r in workload.requests],
        "max_tokens": [r.max_tokens for r in workload.requests],
        "sampling": [r.sampling for r in workload.requests],
        "warmup": [r.prompt for r in warmup.requests] if warmup else [],
    }
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-vllm-offline-") as work:
        job_path, result_path = Path(work) / "job.json", Path(work) / "result.json"
        job_path.write_text(json.dumps(job))
        env = {**os.environ, **peer_env(peer, threads)}
        env.pop("PYTHONPATH", None)  # the peer's interpreter sees only its own packages
        script = Path(__file__).with_name("vllm_offline.py")
        proc = subprocess.run(
            [str(peer.python), str(script), str(job_path), str(result_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=7200,
        )
        if proc.returncode != 0 or not result_path.exists():
            raise RuntimeError(
                f"vLLM offline failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        result = json.loads(result_path.read_text())
    records = []
    for req, n in zip(workload.requests, result["output_tokens"]):
        rec = RequestRecord(req.id, req.prompt_len, req.max_tokens, send_time=0.0)
        rec.add_tokens(result["makespan_s"], n)
        records.append(rec)
    summary = summarize(records)
    for key in ("ttft_ms", "itl_ms", "tpot_ms"):  # not observable offline
        summary.pop(key, None)
    return {
        "label": label,
        "kind": "peer_offline",
        "settings": args,
        "peer": f"vLLM {peer.version}",
        "startup_s": result["load_s"],
        "summary": summary,
        "engine": {},
        "steps": {},
        "batch_sizes": {},
        "records": records_to_json(records),
        "timeline": [],
        "output_token_ids": result["token_ids"],
    }
