"""``python -m router_bench``: N replicas on this machine behind each router policy in turn,
one shared-prefix workload, one table and one plot.

Per policy (and per engine: ``--engines slipstream,vllm`` puts Slipstream's replicas and
vLLM's own side by side, each policy running on both before the next) the replicas start
fresh (empty caches), are warmed with one unrelated request each, the router starts, the
workload runs through it, and the replicas' prefix-cache counters and the router's own count
of its ``kv_aware`` decisions are read. ``single`` serves the same workload from one replica
given the fleet's whole KV budget: the hit rate a perfect router could reach.

Workloads: ``conversations`` (multi-turn users behind a few long system prompts, this
package's own client) or ``prefix`` (vLLM's benchmark client, ``prefix_repetition``).

    PYTHONPATH=backend:benchmarks .venv/bin/python -m router_bench --out /tmp/router-bench
    PYTHONPATH=backend:benchmarks .venv/bin/python -m router_bench --out /tmp/side-by-side \\
        --workload prefix --engines slipstream,vllm
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from router_bench import client, conversations, prefix_client, replicas as fleet, report, routers
from router_bench.engines import MODEL_NAME, Engine, EngineOptions, vllm_python
from slipstream.server.launch.launcher import free_port
from slipstream_bench.runner import cpu_info

DEFAULT_ROUTERS = (
    Path(os.environ.get("SLIPSTREAM_CACHE", Path.home() / ".cache" / "slipstream")) / "routers"
)
WORKLOADS = ("conversations", "prefix")
# per workload: policies, KV cache bytes per replica
DEFAULT_POLICIES = {
    "conversations": "single,vllm-rr,vllm-cache,vllm-kv,sglang-cache",
    "prefix": "vllm-rr,vllm-cache,vllm-kv",
}
# conversations: too small for every system prompt and live conversation, enough for half;
# prefix: ~23,000 tokens of SmolLM2 fp32, a bit more than half the 24 prefixes with their
# suffixes (what one replica holds when each prefix is routed to one replica)
DEFAULT_KV_BYTES = {"conversations": 150_000_000, "prefix": 1 << 30}
# vLLM's CPU attention needs a multiple of 32 (16 is refused); both engines get the same
DEFAULT_BLOCK_SIZE = 32


def log(message: str) -> None:
    print(f"[router_bench] {message}", file=sys.stderr, flush=True)


def parse_args(argv=None) -> argparse.Namespace:
    spec = conversations.WorkloadSpec()
    prefix = prefix_client.PrefixSpec()
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
    p.add_argument("--engines", default="slipstream", help="comma-separated: slipstream, vllm")
    p.add_argument("--workload", choices=WORKLOADS, default="conversations")
    p.add_argument(
        "--policies",
        default=None,
        help=f"comma-separated, from {', '.join(routers.SPECS)} (default: {DEFAULT_POLICIES})",
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
        default=None,
        help=f"KV cache per replica (single: times --replicas; default {DEFAULT_KV_BYTES})",
    )
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE)
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more engine settings for every Slipstream replica",
    )
    p.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="more vLLM server arguments (e.g. --vllm-arg=--enforce-eager)",
    )
    p.add_argument("--vllm-python", default=None, help="the vLLM virtualenv's interpreter")
    p.add_argument(
        "--no-vllm-render",
        dest="vllm_render",
        action="store_false",
        help="vLLM without --enable-scale-out: its render API answers 403 and kv_aware "
        "routes its replicas by load alone (a plain `vllm serve`)",
    )
    p.add_argument("--router-log-level", default=None, help="e.g. debug: its decisions logged")
    for name, value in spec.as_dict().items():
        p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    for name, value in prefix.as_dict().items():
        if name != "seed":  # shared with the conversations workload
            p.add_argument("--" + name.replace("_", "-"), type=type(value), default=value)
    p.add_argument("--timeout", type=float, default=900.0, help="bound on one policy's run")
    args = p.parse_args(argv)
    args.policies = args.policies or DEFAULT_POLICIES[args.workload]
    if args.kv_cache_bytes is None:
        args.kv_cache_bytes = DEFAULT_KV_BYTES[args.workload]
    args.engine_list = [Engine(e.strip()) for e in args.engines.split(",") if e.strip()]
    return args


def workload_spec(args) -> conversations.WorkloadSpec:
    fields = conversations.WorkloadSpec().as_dict()
    return conversations.WorkloadSpec(**{k: getattr(args, k) for k in fields})


def prefix_spec(args) -> prefix_client.PrefixSpec:
    fields = prefix_client.PrefixSpec().as_dict()
    return prefix_client.PrefixSpec(**{k: getattr(args, k) for k in fields})


def engine_options(args, model_dir: str, kv_bytes: int) -> EngineOptions:
    return EngineOptions(
        block_size=args.block_size,
        kv_cache_bytes=kv_bytes,
        model_dir=model_dir,
        slipstream_settings=dict(s.split("=", 1) for s in args.set),
        vllm_args=tuple(args.vllm_arg),
        vllm_python=args.vllm_python,
        vllm_render=args.vllm_render,
    )


def run_policy(key: str, engine: Engine, args, workload, out: Path, model_dir: str) -> dict:
    spec = routers.SPECS[key]
    count = spec.replicas or args.replicas
    kv_bytes = args.kv_cache_bytes * (args.replicas if spec.replicas == 1 else 1)
    cores = [int(c) for c in args.cores.split(",") if c.strip()]
    log_dir = out / engine.value / key
    log_dir.mkdir(parents=True, exist_ok=True)
    options = engine_options(args, model_dir, kv_bytes)
    replicas = fleet.start_ready(engine, count, options, log_dir, cores)
    router, router_port = None, None
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
            router, router_port = _start_router(spec, args, replicas, model_dir, log_dir)
            base = f"http://127.0.0.1:{router_port}"
        log(f"{engine.value} {spec.name}: {count} replica(s) ready, running the workload")
        records, wall = _run_workload(args, workload, base, model_dir, log_dir)
        time.sleep(1.0)  # the metrics refresh (200 ms) catches up
        per_replica = []
        for r in replicas:
            now = fleet.prefix_cache_counters(r)
            per_replica.append({k: now[k] - r.baseline.get(k, 0.0) for k in now})
        counters = {k: sum(c[k] for c in per_replica) for k in ("queries", "hits")}
        row = report.summarize(spec.name, records, wall, counters)
        row.update(
            engine=engine.value,
            policy=key,
            replicas=count,
            kv_cache_bytes_per_replica=kv_bytes,
            block_size=args.block_size,
            per_replica_prefix_cache=per_replica,
        )
        if spec.policy == "kv_aware" and router_port is not None:
            row["router_kv_decisions"] = routers.kv_decisions(router_port + 1)
        (log_dir / "turns.json").write_text(json.dumps([r.as_dict() for r in records], indent=1))
        log(f"{engine.value} {spec.name}: {json.dumps(row)}")
        return row
    finally:
        routers.stop_router(router)
        fleet.stop_replicas(replicas)


def run_or_record(key: str, engine: Engine, args, workload, out: Path, model_dir: str) -> dict:
    """``run_policy``'s row, or a row saying why it has none (a timeout, a replica that did
    not start): one failed combination does not cost the window's others."""
    try:
        return run_policy(key, engine, args, workload, out, model_dir)
    except Exception as e:  # noqa: BLE001 - recorded in the table, the run goes on
        log(f"{engine.value} {key} failed: {type(e).__name__}: {e}"[:2000])
        row = report.summarize(routers.SPECS[key].name, [], 0.0, {})
        row.update(engine=engine.value, policy=key, first_error=f"{type(e).__name__}: {e}"[:300])
        return row


def _run_workload(args, workload, base: str, model_dir: str, log_dir: Path) -> tuple:
    if args.workload == "prefix":
        return prefix_client.run(
            vllm_python(args.vllm_python),
            base,
            model_dir,
            workload,
            log_dir / "client.json",
            args.timeout,
            log_dir / "client.log",
        )
    return client.run_workload(base + "/v1", MODEL_NAME, workload, args.max_tokens, args.timeout)


def _start_router(
    spec, args, replicas: list, tokenizer_dir: str, log_dir: Path, attempts: int = 3
) -> tuple:
    """The router and its port; a port taken between being picked and bound: another one."""
    for attempt in range(attempts):
        port = free_port()
        try:
            return routers.start_router(
                spec,
                args.routers_dir,
                port,
                replicas,
                tokenizer_dir,
                args.block_size,
                log_dir / "router.log",
                args.router_log_level,
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

    model_dir = str(default_model_dir())
    spec: "prefix_client.PrefixSpec | conversations.WorkloadSpec"
    if args.workload == "prefix":
        spec = prefix_spec(args)
        workload: object = spec
    else:
        spec = workload_spec(args)
        workload = conversations.make_conversations(load_tokenizer(model_dir, None), spec)
    description = spec.describe()
    rows = [
        run_or_record(key, engine, args, workload, out, model_dir)
        for key in args.policies.split(",")
        if key
        for engine in args.engine_list
    ]
    cpu = cpu_info()["cpu_model"] or "unknown CPU"
    engines = " and ".join(e.value for e in args.engine_list)
    title = (
        f"{args.replicas} {engines} replicas (1 core each) behind each router; "
        f"{description}; KV block {args.block_size}; {cpu}"
    )
    results = {
        "workload": spec.as_dict(),
        "workload_kind": args.workload,
        "description": description,
        "title": title,
        "cpu": cpu,
        "engines": [e.value for e in args.engine_list],
        "replicas": args.replicas,
        "cores": args.cores,
        "block_size": args.block_size,
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
