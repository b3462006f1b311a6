"""llama.cpp's ``llama-server`` as a benchmark peer, on the default model's GGUF: the shipped
Q4_1 and its Q8_0, BF16 and F32 requantizations.

``scripts/setup_llamacpp.sh`` builds it (~6 minutes on 2 cores; not in CI) and writes
``<peers>/llamacpp/llamacpp.json``; without that file the modes are skipped. The server gets
one slot per request of the workload (continuous batching across slots), the benchmark's
threads, and each request streams from ``/completion`` with ``n_predict`` tokens, EOS ignored,
greedy, no prompt cache: the same exact lengths the Triton runs ask for. Every streamed event
carries one token and is stamped on arrival.
"""

from __future__ import annotations

import json
import socket
import subprocess
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

from slipstream_bench.driver import Progress, send_on_schedule
from slipstream_bench.metrics import RequestRecord, records_to_json, summarize
from slipstream_bench.workload import Workload

# mode -> the GGUF's type; BF16 and F32 are requantized from the shipped Q4_1: the same values
# Slipstream serves as bf16 and fp32
MODES = {
    "llamacpp_q8_0": "q8_0",
    "llamacpp_q4_1": "q4_1",
    "llamacpp_bf16": "bf16",
    "llamacpp_f32": "f32",
}
SETUP_HINT = "run scripts/setup_llamacpp.sh (~6 min on 2 cores)"


class PeerUnavailable(RuntimeError):
    pass


@dataclass
class LlamaCppPeer:
    server: Path
    gguf: dict  # quantization -> GGUF path


def load_peer(peers_dir: Path) -> LlamaCppPeer:
    path = Path(peers_dir) / "llamacpp" / "llamacpp.json"
    if not path.is_file():
        raise PeerUnavailable(f"no llama.cpp peer at {path}; {SETUP_HINT}")
    info = json.loads(path.read_text())
    peer = LlamaCppPeer(Path(info["server"]), {k: Path(v) for k, v in info["gguf"].items()})
    missing = [str(p) for p in [peer.server, *peer.gguf.values()] if not p.exists()]
    if missing:
        raise PeerUnavailable(f"llama.cpp peer incomplete (missing {missing}); {SETUP_HINT}")
    return peer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Server:
    def __init__(
        self,
        peer: LlamaCppPeer,
        quant: str,
        slots: int,
        ctx_per_slot: int,
        threads: int,
        log_path: Path,
    ) -> None:
        self.port = _free_port()
        self.cmd = [
            str(peer.server),
            "-m",
            str(peer.gguf[quant]),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "-np",
            str(slots),
            "-c",
            str(slots * ctx_per_slot),
            "-t",
            str(threads),
            "-tb",
            str(threads),
            "--cont-batching",
        ]
        self.log_path = log_path
        self.proc: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "_Server":
        log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"llama-server exited ({self.proc.returncode}); see {self.log_path}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if resp.status == 200:
                        return self
            except OSError:  # refused while it starts, or 503 while it loads the model
                pass
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError("llama-server not healthy after 300 s")

    def __exit__(self, *exc) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _stream(url: str, prompt: str, record: RequestRecord, bar: Progress) -> None:
    body = {
        "prompt": prompt,
        "n_predict": record.max_tokens,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "cache_prompt": False,
    }
    try:
        request = urllib.request.Request(
            url + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=3600) as resp:
            for raw in resp:  # server-sent events, a line as it arrives
                line = raw.decode().strip()
                if not line.startswith("data: "):
                    continue
                event = json.loads(line[6:])
                if event.get("content") or event.get("tokens"):
                    record.add_tokens(time.perf_counter(), 1)
                    record.text += event.get("content") or ""
                    bar.update(1)
                if event.get("stop"):
                    break
    except Exception as e:  # one failed request is counted, not fatal
        record.error = repr(e)


def run(
    peer: LlamaCppPeer,
    mode: str,
    workload: Workload,
    offsets: Sequence[float],
    out_dir: Path,
    threads: int,
    progress: bool = True,
) -> dict:
    quant = MODES[mode]
    longest = max(r.prompt_len + r.max_tokens for r in workload.requests) + 64
    records = [RequestRecord(r.id, r.prompt_len, r.max_tokens) for r in workload.requests]
    bar = Progress(mode, workload.total_output_tokens, progress)
    workers: list[threading.Thread] = []
    t0 = time.perf_counter()
    with _Server(
        peer,
        quant,
        len(workload.requests),
        longest,
        threads,
        Path(out_dir) / f"llama_server_{mode}.log",
    ) as server:
        startup = time.perf_counter() - t0

        def send(i: int) -> None:
            records[i].send_time = time.perf_counter()
            worker = threading.Thread(
                target=_stream,
                daemon=True,
                args=(server.url, workload.requests[i].prompt, records[i], bar),
            )
            worker.start()
            workers.append(worker)

        send_on_schedule(offsets, send, records=records)
        for worker in workers:
            worker.join()
    bar.close()
    return {
        "label": mode,
        "kind": "peer_llamacpp",
        "settings": {"gguf": str(peer.gguf[quant])},
        "peer": f"llama.cpp llama-server {quant.upper()}",
        "startup_s": startup,
        "summary": summarize(records),
        "engine": {},
        "steps": {},
        "batch_sizes": {},
        "records": records_to_json(records),
        "timeline": [],
    }
