"""The multi-replica router benchmark's pieces that need no router or server: the workload
shares each system prompt among its users and is reproducible, the router commands wire
every replica (and, for kv_aware, its KV event source), the table reads its rows."""

import json
from pathlib import Path

import pytest

from router_bench import conversations, prefix_client, report, routers
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
    cmd = routers.SPECS["vllm-kv"].command(Path("/r"), 30000, replicas(2), "/model", 32)
    assert cmd[0] == "/r/vllm-router/bin/vllm-router"
    assert cmd[cmd.index("--policy") + 1] == "kv_aware"
    sources = [cmd[i + 1] for i, a in enumerate(cmd) if a == "--kv-event-source"]
    assert sources == [
        "http://127.0.0.1:9000=tcp://127.0.0.1:9300",
        "http://127.0.0.1:9001=tcp://127.0.0.1:9301",
    ]
    assert cmd[cmd.index("--kv-event-block-size") + 1] == "32"
    assert cmd[cmd.index("--host") + 1] == "127.0.0.1"


def test_sglang_router_talks_openai_to_every_replica_on_loopback():
    cmd = routers.SPECS["sglang-cache"].command(Path("/r"), 30000, replicas(2), "/model", 32)
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
    assert "| x | 200 | 280 | - | 1.50 | 15.0 | 80.0% | - | 4 (1) |" in report.table([row])


def test_both_engines_get_the_same_block_size_kv_bytes_hashes_and_event_endpoint():
    from router_bench.engines import Engine, EngineOptions, ReplicaPorts, command

    ports = ReplicaPorts(8000, 8001, 8002, Path("/tmp/r0.log"))
    options = EngineOptions(32, 1 << 30, "/model", vllm_python="/peer/bin/python")
    vllm = command(Engine.VLLM, ports, options)
    assert vllm[:3] == ["/peer/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert vllm[vllm.index("--block-size") + 1] == "32"
    assert vllm[vllm.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    assert vllm[vllm.index("--prefix-caching-hash-algo") + 1] == "sha256_cbor"
    assert "--enable-scale-out" in vllm  # its render API, which kv_aware asks for token ids
    events = json.loads(vllm[vllm.index("--kv-events-config") + 1])
    assert events["endpoint"] == "tcp://127.0.0.1:8002" and events["enable_kv_cache_events"]
    ours = command(Engine.SLIPSTREAM, ports, options)
    sets = dict(ours[i + 1].split("=", 1) for i, a in enumerate(ours) if a == "--set")
    assert sets["block_size"] == "32" and sets["kv_cache_memory_bytes"] == str(1 << 30)
    assert json.loads(sets["kv_events_config"])["endpoint"] == "tcp://127.0.0.1:8002"
    plain = EngineOptions(32, 1 << 30, "/model", vllm_python="/p", vllm_render=False)
    assert "--enable-scale-out" not in command(Engine.VLLM, ports, plain)


def test_prefix_workload_asks_vllms_client_for_the_shared_prefix_dataset(tmp_path):
    spec = prefix_client.PrefixSpec(num_prefixes=24, prefix_len=1500, num_prompts=96)
    cmd = prefix_client.command("/peer/python", "http://r:1", "/model", spec, tmp_path / "x.json")
    flag = lambda name: cmd[cmd.index(name) + 1]  # noqa: E731
    assert flag("--dataset-name") == "prefix_repetition"
    assert flag("--prefix-repetition-prefix-len") == "1500"
    assert flag("--prefix-repetition-num-prefixes") == "24"
    assert flag("--num-prompts") == "96" and flag("--request-rate") == "0.7"
    assert flag("--base-url") == "http://r:1" and flag("--endpoint") == "/v1/chat/completions"
    assert flag("--ready-check-timeout-sec") == "0"  # no workload prompt sent before the run


def test_prefix_client_results_become_records_with_errors_kept():
    saved = {
        "ttfts": [0.5, 0.0],
        "latencies": [2.0, 0.0],
        "output_lens": [128, 0],
        "errors": ["", "HTTP 500"],
        "start_times": [10.0, 11.5],
    }
    ok, failed = prefix_client.records(saved)
    assert (ok.ttft_s, ok.latency_s, ok.output_tokens, ok.error) == (0.5, 2.0, 128, None)
    assert failed.ttft_s is None and failed.error == "HTTP 500" and failed.sent_s == 1.5


def test_side_by_side_table_compares_each_engine_with_its_own_round_robin():
    def row(engine, policy, p50, decisions=None, found=0):
        records = [TurnRecord("u0", 0, 0, 0.0, p50 / 1000, 1.0, 10)]
        r = report.summarize(policy, records, 1.0, {"queries": 10.0, "hits": 5.0})
        r.update(engine=engine, policy=policy)
        if decisions:
            r["router_kv_decisions"] = {
                "prefix_routing_decisions": decisions,
                "kv_placement_lookups": {"hit": found, "miss": 1},
            }
        return r

    rows = [
        row("slipstream", "vllm-rr", 9000),
        row("vllm", "vllm-rr", 6000),
        row("slipstream", "vllm-kv", 1000, {"prefix_cost": 95, "missing_tokens": 5}, 60),
        row("vllm", "vllm-kv", 3000, {"missing_tokens": 96}),
    ]
    text = report.table(rows)
    assert "| slipstream | vllm-kv | 1000 | 1000 | 9.00x |" in text
    assert "| vllm | vllm-kv | 3000 | 3000 | 2.00x |" in text
    assert "| 95/100, 60 |" in text and "| 0/96, 0 |" in text
