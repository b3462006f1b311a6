"""What a replica runs: Slipstream (``slipstream serve``: Triton + Slipstream with the OpenAI
API) or vLLM's own OpenAI server (from the peers' virtualenv, ``scripts/setup_peers.py``).
Both serve the same converted SmolLM2 weights under the model name ``slipstream`` with the
same KV block size and KV cache bytes, prefix caching on, vLLM's ``sha256_cbor`` block hashes,
KV events in vLLM's format published into the replica's relay, and vLLM's render API (what
vllm-router's ``kv_aware`` asks each worker for a prompt's token ids), pinned to one core with
one thread each.

vLLM 0.32 serves ``/v1/chat/completions/render`` only with ``--enable-scale-out``: without it
the route answers 403, vllm-router's ``kv_aware`` gets no token ids for any request
(``missing_tokens``) and routes by load alone, whatever the KV events say."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Optional

MODEL_NAME = "slipstream"  # what every replica serves the model as


class Engine(str, Enum):
    SLIPSTREAM = "slipstream"
    VLLM = "vllm"


@dataclass(frozen=True)
class EngineOptions:
    """What every replica of a run shares, whichever engine it runs."""

    block_size: int
    kv_cache_bytes: int
    model_dir: str  # the HF directory both engines load (and the tokenizer)
    slipstream_settings: dict = field(default_factory=dict)  # more ``--set KEY=VALUE``
    vllm_args: tuple[str, ...] = ()  # more vLLM server arguments
    vllm_python: Optional[str] = None  # the peers' interpreter (None: found by vllm_python())
    vllm_render: bool = True  # --enable-scale-out (off: what a plain `vllm serve` does)


@dataclass(frozen=True)
class ReplicaPorts:
    openai: int
    metrics: int  # Slipstream's metrics port (vLLM serves /metrics on its OpenAI port)
    kv_in: int  # the relay's input: where the replica's publisher connects
    log_path: Path


def vllm_python(explicit: Optional[str] = None) -> str:
    """The vLLM virtualenv's interpreter: ``explicit``, else the one ``peers.json`` names,
    else ``<cache>/peers/venv/bin/python``."""
    if explicit:
        return explicit
    from slipstream.cache_dir import cache_root

    peers = cache_root() / "peers"
    manifest = peers / "peers.json"
    if manifest.exists():
        python = json.loads(manifest.read_text()).get("vllm", {}).get("python")
        if python and Path(python).exists():
            return str(python)
    python = peers / "venv" / "bin" / "python"
    if not python.exists():
        raise FileNotFoundError(
            f"no vLLM virtualenv at {python.parent.parent}: install it with "
            "scripts/setup_peers.py (or pass --vllm-python)"
        )
    return str(python)


def command(engine: Engine, ports: ReplicaPorts, options: EngineOptions) -> list[str]:
    kv = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{ports.kv_in}",
    }
    if engine is Engine.SLIPSTREAM:
        return _slipstream_command(ports, options, kv)
    return _vllm_command(ports, options, kv)


def _slipstream_command(ports: ReplicaPorts, options: EngineOptions, kv: dict) -> list[str]:
    settings = {
        "kv_events_config": json.dumps(kv),
        "block_size": options.block_size,
        "kv_cache_memory_bytes": options.kv_cache_bytes,
        "metric_families": "slipstream,vllm",
        "metrics_interval_ms": 200,
        **options.slipstream_settings,
    }
    cmd = [
        sys.executable,
        "-m",
        "slipstream.server",
        "--http-port",
        "0",
        "--grpc-port",
        "0",
        "--metrics-port",
        str(ports.metrics),
        "--openai-port",
        str(ports.openai),
        "--log-file",
        str(ports.log_path) + ".triton",
    ]
    for key, value in settings.items():
        cmd += ["--set", f"{key}={value}"]
    return cmd


def _vllm_command(ports: ReplicaPorts, options: EngineOptions, kv: dict) -> list[str]:
    return [
        vllm_python(options.vllm_python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        options.model_dir,
        "--served-model-name",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(ports.openai),
        "--dtype",
        "float32",  # Slipstream's CPU default
        "--block-size",
        str(options.block_size),
        "--kv-cache-memory-bytes",
        str(options.kv_cache_bytes),
        "--enable-prefix-caching",
        "--prefix-caching-hash-algo",
        "sha256_cbor",
        "--kv-events-config",
        json.dumps(kv),
        "--disable-uvicorn-access-log",
        # the render API kv_aware needs (403 without it)
        *(["--enable-scale-out"] if options.vllm_render else []),
        *options.vllm_args,
    ]


def environment(engine: Engine, core: Optional[int]) -> dict:
    """The replica's environment: one thread on its core."""
    env = dict(os.environ)
    if core is not None:
        env["OMP_NUM_THREADS"] = "1"
    if engine is Engine.VLLM:
        env.pop("PYTHONPATH", None)  # the peer's interpreter sees only its own packages
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
        env["LC_ALL"] = "C.UTF-8"
        if core is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = str(core)
    return env


def metrics_url(engine: Engine, ports: ReplicaPorts) -> str:
    if engine is Engine.SLIPSTREAM:
        return f"http://127.0.0.1:{ports.metrics}/metrics"
    return f"http://127.0.0.1:{ports.openai}/metrics"
