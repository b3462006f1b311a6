"""``python -m router_bench``: N replicas on this machine behind each router policy in turn,
one shared-prefix multi-turn workload, one table and one plot.

Per policy the replicas start fresh (empty caches), are warmed with one unrelated request
each, the router starts, the workload runs through it, and the replicas' prefix-cache
counters are read. ``single`` serves the same workload from one replica given the fleet's
whole KV budget: the hit rate a perfect router could reach.

    PYTHONPATH=backend:benchmarks .venv/bin/python -m router_bench --out /tmp/router-bench
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from router_bench import client, conversations, replicas as fleet, report, routers
from slipstream.server.launch.launcher import free_port
from slipstream_bench.runner import cpu_info

DEFAULT_ROUTERS = (
    Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream")) / "routers"
)
MODEL_NAME = "slipstream"


def log(message: str) -> None:
    print(f"[router_bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    spec = conversations.WorkloadSpec()
    p = argparse.ArgumentParser(
        prog="python -m router_bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", required=True, help="directory for results.json, table.md, plot")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument(
        "--cores",
        default=",".join(str(c) for c in sorted(os.sched_getaffinity(0))),
        help="cores to pin replicas to, one each, round robin ('' = no pinning)",
    )
    p.add_argument(
        "--policies",
        default="single,vllm-rr,vllm-cache,vllm-kv,sglang-cache",
        help=f"comma-separated, from {', '.join(routers.SPECS)}",
    )
    p.add_argument(
        "--routers-dir",
        type=Path,
        default=DEFAULT_ROUTERS,
        help="where scripts/setup_routers.sh installed the routers",
    )
    p.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=150_000_000,
        help="KV cache per replica (single: times --replicas)",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more engine settings for every replica",
    )
    for name, value in spec.as_dict().items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on one policy's run")
    return p.parse_args(argv)


def workload_spec(args) -> conversations.WorkloadSpec:
    fields = conversations.WorkloadSpec().as_dict()
    return conversations.WorkloadSpec(**{k: getattr(args, k) for k in fields})


def run_policy(key: str, args, convs: list, max_tokens: int, out: Path, tokenizer_dir: str) -> dict:
    spec = routers.SPECS[key]
    count = spec.replicas or args.replicas
    kv_bytes = args.kv_cache_bytes * (args.replicas if spec.replicas == 1 else 1)
    settings = {"kv_cache_memory_bytes": kv_bytes, **dict(s.split("=", 1) for s in args.set)}
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    log_dir = out / key
    log_dir.mkdir(parents=True, exist_ok=True)
    replicas = fleet.start_ready(count, settings, log_dir, cores)
    router = None
    try:
        for r in replicas:  # compile, allocate, first-step costs: out of the measurement
            client.run_workload(
                r.url + "/v1",
                MODEL_NAME,
                [conversations.Conversation("warm", -1, "Warm up.", ["Say hello."], 0.0, 0.0)],
                4,
            )
        time.sleep(0.5)
        for r in replicas:
            r.baseline = fleet.prefix_cache_counters(r)
        if spec.router == "direct":
            base = replicas[0].url
        else:
            router, port = _start_router(spec, args, replicas, tokenizer_dir, log_dir)
            base = f"http://127.0.0.1:{port}"
        log(f"{spec.name}: {count} replica(s) ready, running {len(convs)} conversations")
        records, wall = client.run_workload(
            base + "/v1", MODEL_NAME, convs, max_tokens, args.timeout
        )
        time.sleep(1.0)  # the metrics refresh (200 ms) catches up
        counters = {"queries": 0.0, "hits": 0.0}
        for r in replicas:
            now = fleet.prefix_cache_counters(r)
            for k in counters:
                counters[k] += now[k] - r.baseline.get(k, 0.0)
        row = report.summarize(spec.name, records, wall, counters)
        row["replicas"] = count
        row["kv_cache_bytes_per_replica"] = kv_bytes
        (log_dir / "turns.json").write_text(json.dumps([r.as_dict() for r in records], indent=1))
        log(f"{spec.name}: {json.dumps(row)}")
        return row
    finally:
        routers.stop_router(router)
        fleet.stop_replicas(replicas)


def _start_router(
    spec, args, replicas: list, tokenizer_dir: str, log_dir: Path, attempts: int = 3
) -> tuple:
    """The router and its port; a port taken between being picked and bound: another one."""
    for attempt in range(attempts):
        port = free_port()
        try:
            return routers.start_router(
                spec, args.routers_dir, port, replicas, tokenizer_dir, log_dir / "router.log"
            ), port
        except RuntimeError:
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def main(argv=None) -> int:
    args = parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from slipstream.worker.model.gguf import default_model_dir
    from slipstream.worker.model.loader import load_tokenizer

    tokenizer_dir = str(default_model_dir())
    tokenizer = load_tokenizer(tokenizer_dir, None)
    spec = workload_spec(args)
    convs = conversations.make_conversations(tokenizer, spec)
    rows = [
        run_policy(key, args, convs, spec.max_tokens, out, tokenizer_dir)
        for key in args.policies.split(",")
        if key
    ]
    cpu = cpu_info()["cpu_model"] or "unknown CPU"
    title = (
        f"{args.replicas} Slipstream replicas (1 core each) behind each router; "
        f"{spec.describe()}; {cpu}"
    )
    results = {
        "workload": spec.as_dict(),
        "description": spec.describe(),
        "cpu": cpu,
        "replicas": args.replicas,
        "cores": args.cores,
        "kv_cache_bytes_per_replica": args.kv_cache_bytes,
        "rows": rows,
    }
    (out / "results.json").write_text(json.dumps(results, indent=1))
    (out / "table.md").write_text(report.table(rows) + "\n")
    report.plot(rows, out / "router_bench.png", title)  # report.replot redraws it
    print(report.table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
