"""Does the model's stub grow under repeated load? Waves of concurrent requests against a real
tritonserver (tiny random model): the stub's RSS after each wave and, with ``--trace``, the
Python allocations that grew from one wave to the next (tracemalloc inside the stub).

    PYTHONPATH=backend:benchmarks python benchmarks/memory_waves.py --waves 5 --concurrency 150

Half the requests are gRPC streams, half non-streaming HTTP ``generate``; each wave waits
until every request has its final response, then the stub settles for a second.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import numpy as np
import tritonclient.grpc as grpcclient

from slipstream.cache_dir import cache_root
from slipstream.server.launch.launcher import TritonServer, stub_pids
from slipstream.server.launch.repository import DEFAULT_MODEL_REPOSITORY, render_model_repository
from slipstream.testing import make_tiny_model_dir

SETTINGS = {
    "kv_cache_memory_bytes": 8 * 1024 * 1024,
    "max_model_len": 512,
    "max_num_seqs": 32,
    "metrics_interval_ms": 200,
    "max_queue_size": 0,
}
SAMPLING = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
# A model.py that traces the stub's allocations from the first snapshot on (tracing the
# imports would take minutes): a snapshot is written whenever the trigger file appears.
TRACING_MODEL_PY = """
import os, sys, threading, time, tracemalloc
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)
from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401

def _snapshots(trigger, out):
    n = 0
    while True:
        time.sleep(0.2)
        if os.path.exists(trigger):
            import gc
            gc.collect()
            if os.environ.get("SLIPSTREAM_TRACE_TRIM"):  # what free memory glibc holds back
                import ctypes
                ctypes.CDLL("libc.so.6").malloc_trim(0)
                import collections, json
                counts = collections.Counter(type(o).__name__ for o in gc.get_objects())
                with open(f"{out}.{n}.tmp", "w") as f:
                    json.dump(counts, f)
            else:
                if not tracemalloc.is_tracing():  # from the first snapshot on: imports untraced
                    tracemalloc.start(6)
                tracemalloc.take_snapshot().dump(f"{out}.{n}.tmp")
            os.rename(f"{out}.{n}.tmp", f"{out}.{n}")
            os.unlink(trigger)
            n += 1

threading.Thread(target=_snapshots, args=(os.environ["SLIPSTREAM_TRACE_TRIGGER"],
                 os.environ["SLIPSTREAM_TRACE_OUT"]), daemon=True).start()
"""


def stub_memory_mb(server: TritonServer) -> dict[str, float]:
    """The stub's VmRSS and its parts (RssAnon: heap; RssShmem: the shared-memory pool)."""
    pids = stub_pids(server.shm_prefix)
    out = {}
    for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines():
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = round(int(line.split()[1]) / 1024, 1)
    return out


def grpc_requests(server: TritonServer, count: int, seed: int, errors: list) -> None:
    done = threading.Semaphore(0)

    def callback(result, error):
        if error is not None:
            errors.append(str(error))
            done.release()
        elif result.get_response().parameters["triton_final_response"].bool_param:
            done.release()

    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=callback)
    for i in range(count):
        ins = []
        for name, value, dtype in (
            ("text_input", f"wave {seed} request {i}".encode(), "BYTES"),
            ("sampling_parameters", json.dumps(SAMPLING).encode(), "BYTES"),
        ):
            t = grpcclient.InferInput(name, [1], dtype)
            t.set_data_from_numpy(np.array([value], dtype=object))
            ins.append(t)
        stream = grpcclient.InferInput("stream", [1], "BOOL")
        stream.set_data_from_numpy(np.array([True]))
        client.async_stream_infer("slipstream", ins + [stream], enable_empty_final_response=True)
    for _ in range(count):
        done.acquire(timeout=600)
    client.stop_stream()
    client.close()


def http_request(server: TritonServer, i: int, seed: int, errors: list) -> None:
    body = {"text_input": f"wave {seed} http {i}", "parameters": SAMPLING}
    req = urllib.request.Request(
        f"http://{server.http_url}/v2/models/slipstream/generate", data=json.dumps(body).encode()
    )
    try:
        urllib.request.urlopen(req, timeout=600).read()
    except Exception as exc:  # noqa: BLE001 - counted
        errors.append(str(exc))


def wave(server: TritonServer, concurrency: int, seed: int) -> list:
    errors: list = []
    grpc_count = concurrency // 2
    threads = [
        threading.Thread(
            target=grpc_requests, args=(server, grpc_count // 5, seed, errors), daemon=True
        )
        for _ in range(5)
    ]
    threads += [
        threading.Thread(target=http_request, args=(server, i, seed, errors), daemon=True)
        for i in range(concurrency - 5 * (grpc_count // 5))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def top_growth(before: Path, after: Path, limit: int = 8) -> list:
    import tracemalloc

    old, new = tracemalloc.Snapshot.load(str(before)), tracemalloc.Snapshot.load(str(after))
    stats = new.compare_to(old, "lineno")
    return [
        f"{s.size_diff / 1024:+.0f} KiB {s.count_diff:+d} blocks "
        f"{s.traceback[0].filename.split('site-packages/')[-1]}:{s.traceback[0].lineno}"
        for s in stats[:limit]
    ]


def snapshot(trigger: Path, out: Path, n: int) -> Path:
    trigger.touch()
    path = Path(f"{out}.{n}")
    deadline = time.monotonic() + 120
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--concurrency", type=int, default=150)
    p.add_argument("--trace", action="store_true", help="tracemalloc in the stub (slower)")
    p.add_argument(
        "--trim",
        action="store_true",
        help="after each wave also measure once glibc's malloc_trim(0) has run in "
        "the stub (no tracing): what is free memory held back, not a leak",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a model config parameter (e.g. cpu_linear=stock)",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="memory-waves-"))
    tiny = make_tiny_model_dir(cache_root() / "test-models" / "tiny-llama", "llama")
    repo = render_model_repository(
        DEFAULT_MODEL_REPOSITORY,
        work / "repo",
        {"model": str(tiny), **SETTINGS, **dict(item.split("=", 1) for item in args.set)},
    )
    env = {}
    if args.trace or args.trim:
        (repo / "slipstream" / "1" / "model.py").write_text(TRACING_MODEL_PY)
        env = {
            "SLIPSTREAM_TRACE_TRIGGER": str(work / "trigger"),
            "SLIPSTREAM_TRACE_OUT": str(work / "snapshot"),
        }
        if args.trim:
            env["SLIPSTREAM_TRACE_TRIM"] = "1"
    figures = {"concurrency": args.concurrency, "memory_mb": [], "errors": [], "growth": []}
    with TritonServer(
        repo, http_port=0, grpc_port=0, metrics_port=0, startup_timeout=300, env=env
    ) as server:
        figures["memory_mb_idle"] = stub_memory_mb(server)
        snaps = [snapshot(work / "trigger", work / "snapshot", 0)] if args.trace else []
        for n in range(args.waves):
            started = time.monotonic()
            errors = wave(server, args.concurrency, n)
            time.sleep(1.0)
            memory = stub_memory_mb(server)
            figures["memory_mb"].append(memory)
            figures["errors"].append(len(errors))
            line = (
                f"wave {n + 1}: {time.monotonic() - started:.1f} s, {len(errors)} errors, "
                f"stub {memory} MB"
            )
            if args.trim:
                snapshot(work / "trigger", work / "snapshot", n)
                counts = json.loads(Path(f"{work / 'snapshot'}.{n}").read_text())
                if n:
                    before = json.loads(Path(f"{work / 'snapshot'}.{n - 1}").read_text())
                    grown = sorted(
                        ((counts[k] - before.get(k, 0), k) for k in counts), reverse=True
                    )[:6]
                    line += f"\n    Python objects that grew: {grown}"
                    figures.setdefault("objects_grown", []).append(
                        sum(max(counts[k] - before.get(k, 0), 0) for k in counts)
                    )
                trimmed = stub_memory_mb(server)
                figures.setdefault("memory_mb_trimmed", []).append(trimmed)
                line += f"\n    after malloc_trim: {trimmed} MB"
            if args.trace:
                snaps.append(snapshot(work / "trigger", work / "snapshot", n + 1))
                growth = top_growth(snaps[-2], snaps[-1])
                figures["growth"].append(growth)
                line += "\n    " + "\n    ".join(growth)
            print(line, flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=2))
    print(json.dumps({k: v for k, v in figures.items() if k != "growth"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
