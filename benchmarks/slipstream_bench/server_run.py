"""One server mode: render the repository with overrides, start tritonserver, warm up,
run the workload over gRPC, read the engine's counters, stop, read the step trace back.

The engine counts its steps from its start; the warm-up requests' steps are told apart from
the measured ones by the ``engine_steps_total`` counter read between the two.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Mapping, Optional, Sequence

from slipstream.server.launch.config_pbtxt import read_parameters
from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.repository import DEFAULT_MODEL_REPOSITORY, render_model_repository
from slipstream.server.launch.scrape import scrape as scrape_samples
from slipstream.server.stub.model_config import SERVER_PARAMETERS, split_parameters
from slipstream_bench import loadgen, timeline
from slipstream_bench.metrics import records_to_json, summarize
from slipstream_bench.workload import Workload

# the shipped default: measure what users run
METRICS_INTERVAL_MS = int(SERVER_PARAMETERS["metrics_interval_ms"])


def render(overrides: Mapping[str, object], work: Path, source=DEFAULT_MODEL_REPOSITORY) -> Path:
    settings = {"metrics_interval_ms": METRICS_INTERVAL_MS, **overrides}
    return render_model_repository(source, work / "model_repository", settings)


def engine_settings(repo: Path) -> dict:
    """The engine part of a rendered repository's parameters (what the model would load)."""
    params = read_parameters((repo / loadgen.MODEL_NAME / "config.pbtxt").read_text())
    return split_parameters(params)[0]


def rendered_settings(overrides: Mapping[str, object]) -> dict:
    """The engine settings the shipped model would load with ``overrides`` (the in-process
    runs use exactly what the server runs get)."""
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-") as work:
        return engine_settings(render(overrides, Path(work)))


def scrape(metrics_url: str) -> dict:
    """slipstream_* values of the metrics endpoint (labels dropped; one model served)."""
    return {
        s.name: float(s.value)
        for s in scrape_samples(metrics_url)
        if s.name.startswith("slipstream_") and not s.name.endswith("_bucket")
    }


def settled(
    metrics_url: str, name: str = "slipstream_engine_steps_total", timeout: float = 15.0
) -> dict:
    """Metrics once ``name`` stopped moving (they refresh every METRICS_INTERVAL_MS)."""
    pause = 2 * METRICS_INTERVAL_MS / 1000
    deadline = time.monotonic() + timeout
    last = scrape(metrics_url)
    while time.monotonic() < deadline:
        time.sleep(pause)
        now = scrape(metrics_url)
        if now.get(name) == last.get(name):
            return now
        last = now
    return last


def run_mode(
    label: str,
    overrides: Mapping[str, object],
    workload: Workload,
    offsets: Sequence[float],
    warmup: Optional[Workload],
    out_dir: Path,
    *,
    progress: bool = True,
    source=DEFAULT_MODEL_REPOSITORY,
) -> dict:
    """Everything about one server mode, as the results JSON holds it."""
    with tempfile.TemporaryDirectory(prefix=f"slipstream-bench-{label}-") as work:
        return _run_server(
            label, overrides, workload, offsets, warmup, out_dir, Path(work), progress, source
        )


def _run_server(
    label, overrides, workload, offsets, warmup, out_dir, work, progress, source
) -> dict:
    trace_path = (out_dir / f"trace_{label}.json").resolve()
    repo = render({**overrides, "trace_file": str(trace_path)}, work, source)
    server = TritonServer(
        repo,
        http_port=0,
        grpc_port=0,
        metrics_port=0,
        log_path=out_dir / f"tritonserver_{label}.log",
        startup_timeout=600,
    )
    t0 = time.perf_counter()
    with server:
        startup = time.perf_counter() - t0
        if warmup is not None:
            loadgen.warm_up(server.grpc_url, warmup)
        before = settled(server.metrics_url)
        records = loadgen.run_triton(
            server.grpc_url, workload, offsets, label=label, progress=progress
        )
        after = settled(server.metrics_url)
    steps = (
        timeline.after(
            timeline.load(trace_path), int(before.get("slipstream_engine_steps_total", 0))
        )
        if trace_path.exists()
        else []
    )
    return {
        "label": label,
        "kind": "triton",
        "settings": engine_settings(repo),
        "startup_s": startup,
        "summary": summarize(records),
        "engine": counter_deltas(before, after),
        "steps": timeline.summary(steps),
        "batch_sizes": timeline.batch_size_histogram(steps),
        "records": records_to_json(records),
        "timeline": timeline.to_json(steps),
        "trace_file": str(trace_path) if trace_path.exists() else None,
    }


def counter_deltas(before: dict, after: dict) -> dict:
    """What the measured run did: counters as differences, gauges as read at the end."""
    from slipstream.server.stub.metrics import COUNTERS

    out = {}
    for name, value in after.items():
        short = name[len("slipstream_") :]
        if short in COUNTERS or short.endswith("_count") or short.endswith("_sum"):
            out[short] = value - before.get(name, 0.0)
        else:  # gauges
            out[short] = value
    return out
