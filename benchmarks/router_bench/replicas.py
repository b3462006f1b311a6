"""N replicas on this machine (``slipstream serve`` or vLLM's OpenAI server, router_bench/
engines.py), each pinned to its own core with one thread, each with the OpenAI API and KV events.

Everything listens on 127.0.0.1. A router's KV subscriber connects to ``tcp://HOST:PORT``, and
by vLLM's rule a publisher given ``tcp://127.0.0.1:PORT`` connects rather than binds (it binds
``tcp://*:PORT``, every interface; ``tcp://[::1]:PORT`` binds loopback, but vllm-router's SUB
socket does not speak IPv6). So each replica publishes into a relay (an XSUB/XPUB proxy, both
sides bound on 127.0.0.1) and the router subscribes to the relay: the same bytes, loopback only."""

from __future__ import annotations

import os
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import zmq

from router_bench.engines import (
    Engine,
    EngineOptions,
    ReplicaPorts,
    command,
    environment,
    metrics_url as engine_metrics_url,
)
from slipstream.server.launch.launcher import free_port


@dataclass
class Replica:
    index: int
    core: Optional[int]
    openai_port: int
    metrics_port: int
    kv_port: int  # where the replica's publisher connects (the relay's input)
    relay_port: int  # where subscribers connect (the relay's output)
    log_path: Path
    engine: Engine = Engine.SLIPSTREAM
    process: Optional[subprocess.Popen] = None
    relay: Optional["EventRelay"] = None
    baseline: dict = field(default_factory=dict)  # prefix-cache counters before the workload

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def ports(self) -> ReplicaPorts:
        return ReplicaPorts(self.openai_port, self.metrics_port, self.kv_port, self.log_path)

    @property
    def metrics_url(self) -> str:
        return engine_metrics_url(self.engine, self.ports)

    @property
    def kv_endpoint(self) -> str:
        """Where a router subscribes to this replica's KV events."""
        return f"tcp://127.0.0.1:{self.relay_port}"


class EventRelay:
    """XSUB (bound, publishers connect) -> XPUB (bound, subscribers connect), on a thread."""

    def __init__(self, in_port: int, out_port: int) -> None:
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.XSUB)
        self._out = self._ctx.socket(zmq.XPUB)
        self._in.bind(f"tcp://127.0.0.1:{in_port}")
        self._out.bind(f"tcp://127.0.0.1:{out_port}")
        self._control = self._ctx.socket(zmq.PAIR)
        self._control.bind("inproc://relay-control")
        self._stop = self._ctx.socket(zmq.PAIR)
        self._stop.connect("inproc://relay-control")
        self._thread = threading.Thread(
            target=zmq.proxy_steerable,
            args=(self._in, self._out, None, self._control),
            name="kv-event-relay",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Idempotent: a replica stopped alone may be stopped again with its fleet."""
        if self._ctx.closed:
            return
        self._stop.send(b"TERMINATE")
        self._thread.join(5)
        for sock in (self._in, self._out, self._control, self._stop):
            sock.close(linger=0)
        self._ctx.term()


def start_replicas(
    engine: Engine, count: int, options: EngineOptions, log_dir: Path, cores: list
) -> list[Replica]:
    return [
        _start(engine, i, cores[i % len(cores)] if cores else None, options, log_dir)
        for i in range(count)
    ]


def _start(
    engine: Engine, index: int, core: Optional[int], options: EngineOptions, log_dir: Path
) -> Replica:
    replica = Replica(
        index,
        core,
        free_port(),
        free_port(),
        free_port(),
        free_port(),
        log_dir / f"replica{index}.log",
        engine,
    )
    replica.relay = EventRelay(replica.kv_port, replica.relay_port)
    replica.process = _launch(replica, options)
    return replica


def start_ready(
    engine: Engine,
    count: int,
    options: EngineOptions,
    log_dir: Path,
    cores: list,
    attempts: int = 3,
) -> list[Replica]:
    """Started and answering /health. A free port can be taken by another process between
    being picked and bound (a busy machine): such a replica is started again on new ports."""
    replicas = start_replicas(engine, count, options, log_dir, cores)
    for i in range(count):
        for attempt in range(attempts):
            try:
                wait_ready([replicas[i]])
                break
            except RuntimeError:
                stop_replicas([replicas[i]])
                if attempt == attempts - 1:
                    stop_replicas(replicas)
                    raise
                replicas[i] = _start(engine, i, replicas[i].core, options, log_dir)
    return replicas


def _launch(replica: Replica, options: EngineOptions) -> subprocess.Popen:
    core = replica.core

    def pin() -> None:
        if core is not None:
            os.sched_setaffinity(0, {core})

    log = open(replica.log_path, "w")
    return subprocess.Popen(
        command(replica.engine, replica.ports, options),
        stdout=log,
        stderr=subprocess.STDOUT,
        env=environment(replica.engine, core),
        preexec_fn=pin,
        start_new_session=True,
    )


# vLLM compiles its model with torch.compile on a first start (minutes on a busy core; cached
# in ~/.cache/vllm afterwards)
def wait_ready(replicas: list[Replica], timeout_s: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout_s
    for replica in replicas:
        while not _healthy(replica.url + "/health"):
            if replica.process.poll() is not None:
                raise RuntimeError(f"replica {replica.index} exited: see {replica.log_path}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"replica {replica.index} not ready: see {replica.log_path}")
            time.sleep(0.5)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def stop_replicas(replicas: list[Replica], timeout_s: float = 60.0) -> None:
    for replica in replicas:
        if replica.process is not None and replica.process.poll() is None:
            replica.process.terminate()
    for replica in replicas:
        if replica.process is None:
            continue
        try:
            replica.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(replica.process.pid, 9)
            replica.process.wait()
        if replica.relay is not None:
            replica.relay.close()


def prefix_cache_counters(replica: Replica) -> dict:
    """Prompt tokens looked up in / served from the prefix cache (vLLM's counters)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(replica.metrics_url, timeout=10) as r:
        text = r.read().decode()
    totals = {"queries": 0.0, "hits": 0.0}
    for family in text_string_to_metric_families(text):
        for key in totals:
            if family.name == f"vllm:prefix_cache_{key}":
                totals[key] += sum(s.value for s in family.samples if s.name.endswith("_total"))
    return totals
