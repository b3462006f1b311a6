"""Memory under repeated load: waves of concurrent gRPC and HTTP requests against a real
tritonserver leave no per-request Python objects behind in the stub, and its heap levels off
(``benchmarks/memory_waves.py`` is the full measurement, docs/robustness.md its figures)."""

import json
import os
import sys

import pytest

pytest.importorskip("tritonclient.grpc")

from support import ROOT  # noqa: E402

# benchmarks/memory_waves.py is a script beside the benchmark packages, not an installed module
sys.path.insert(0, str(ROOT / "benchmarks"))
import memory_waves  # noqa: E402

pytestmark = [
    pytest.mark.server,
    pytest.mark.skipif(
        os.environ.get("SLIPSTREAM_SKIP_SERVER_TESTS") == "1",
        reason="SLIPSTREAM_SKIP_SERVER_TESTS=1",
    ),
]
CONCURRENCY = 40


@pytest.mark.slow
def test_waves_of_requests_leave_no_objects_behind_and_the_heap_levels_off(tmp_path):
    out = tmp_path / "figures.json"
    assert (
        memory_waves.main(
            ["--waves", "4", "--concurrency", str(CONCURRENCY), "--trim", "--out", str(out)]
        )
        == 0
    )
    figures = json.loads(out.read_text())
    assert figures["errors"] == [0, 0, 0, 0]
    # After the first wave (imports, caches warming) fewer new Python objects than requests
    # survive a wave: nothing is kept per request.
    assert all(grown < CONCURRENCY for grown in figures["objects_grown"][1:]), figures
    # The heap as the server holds it: after malloc_trim the figure climbs towards this one
    # while glibc's free lists fragment (a fill, not a leak), so it is not the one to watch.
    heap = [m["RssAnon"] for m in figures["memory_mb"]]
    assert max(heap[2:]) - heap[1] < 10, heap  # MB over two waves of 40 requests
