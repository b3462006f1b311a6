"""The multi-replica router benchmark's pieces that need no router or server: the workload
shares each system prompt among its users and is reproducible, the router commands wire
every replica (and, for kv_aware, its KV event source), the table reads its rows."""

from pathlib import Path

import pytest

from router_bench import conversations, report, routers
from router_bench.client import TurnRecord
from router_bench.replicas import Replica

SPEC = conversations.WorkloadSpec(
    num_systems=2, system_tokens=60, num_users=5, turns=3, user_tokens=8, user_rate=2.0
)


def test_users_share_their_system_prompt_and_the_workload_is_reproducible(tokenizer):
    convs = conversations.make_conversations(tokenizer, SPEC)
    again = conversations.make_conversations(tokenizer, SPEC)
    assert [c.user_messages for c in convs] == [c.user_messages for c in again]
    assert len({c.system for c in convs}) == SPEC.num_systems
    assert all(len(c.user_messages) == SPEC.turns for c in convs)
    starts = [c.start_s for c in convs]
    assert starts == sorted(starts) and starts[0] > 0  # users arrive over time
    assert len({m for c in convs for m in c.user_messages}) == SPEC.num_users * SPEC.turns


def replicas(n: int) -> list:
    return [
        Replica(i, i, 9000 + i, 9100 + i, 9200 + i, 9300 + i, Path(f"/tmp/r{i}.log"))
        for i in range(n)
    ]


def test_kv_aware_router_subscribes_to_every_replicas_events():
    cmd = routers.SPECS["vllm-kv"].command(Path("/r"), 30000, replicas(2), "/model")
    assert cmd[0] == "/r/vllm-router/bin/vllm-router"
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == [
        "http://127.0.0.1:9000=tcp://127.0.0.1:9300",
        "http://127.0.0.1:9001=tcp://127.0.0.1:9301",
    ]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == "16"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_sglang_router_talks_openai_to_every_replica_on_loopback():
    cmd = routers.SPECS["sglang-cache"].command(Path("/r"), 30000, replicas(2), "/model")
    assert cmd[cmd.index("--backend") + 1] == "openai"
    start = cmd.index("--worker-urls") + 1
    assert cmd[start : start + 2] == ["http://127.0.0.1:9000", "http://127.0.0.1:9001"]
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_table_reports_ttft_percentiles_throughput_and_hit_rate():
    records = [TurnRecord("u0", 0, k, 0.0, 0.1 * (k + 1), 1.0, 10) for k in range(3)]
    records.append(TurnRecord("u1", 0, 0, 0.0, None, None, 0, "APIError: boom"))
    row = report.summarize("x", records, 2.0, {"queries": 100.0, "hits": 80.0})
    assert row["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert row["errors"] == 1 and row["output_tokens_per_s"] == pytest.approx(15.0)
    assert row["prefix_cache_hit_rate"] == pytest.approx(0.8)
    assert "| x | 200 | 280 | 1.50 | 15.0 | 80.0% | 4 (1) |" in report.table([row])
