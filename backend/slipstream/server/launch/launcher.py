"""Run a real ``tritonserver`` on a model repository: start, wait until ready, stop, clean up.

``TritonServer`` is a context manager used by the tests and by ``slipstream serve``. Where the
binary and its backends come from is ``triton_install``; the repository it serves is prepared
by ``repository`` (rendered with ``--set`` overrides, its models checked); its log is read
through ``server_log``; stopping goes through Triton's model-repository API
(``repository_api``).

Stopping (``TritonServer.stop``) does not rely on Triton's own signal handling alone, which in
2.51 waits on every open HTTP connection (idle keep-alive ones too) before it even starts to
unload models, and exits with code 1 (or crashes) when its exit timeout runs out with requests
in flight or a model still loaded. Models are loaded in explicit mode and unloaded first, over
the repository API, while the server is fully up: the model lets in-flight requests finish
(up to the exit timeout) and ends the rest with an error, then finalizes. Only then is
``tritonserver`` signalled, and killed if it lingers; its process group (backend stubs and
their watchdogs) and its Python-backend shared-memory regions are always removed.
"""

from __future__ import annotations

import glob
import os
import secrets
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Optional, Sequence

from slipstream.server.launch.repository import DEFAULT_MODEL_NAME, DEFAULT_MODEL_REPOSITORY
from slipstream.server.launch.repository_api import MODEL_CONTROL_HEADER, RepositoryAPI
from slipstream.server.launch.server_log import ServerLog, log_file
from slipstream.server.launch.triton_install import (
    TritonInstall,
    TritonServerError,
    find_tritonserver,
    gpu_present,
    server_env,
)


@dataclass
class StopReport:
    """How a server ended: whether its models unloaded (finalized) before it was signalled,
    its exit code, and what had to be cleaned up after it."""

    models_unloaded: bool = False
    unload: str = ""  # "unloaded", "stuck" (will never finalize), "timeout" or "not tried"
    exit_code: Optional[int] = None
    killed: bool = False  # it did not exit by itself after the unload (or never unloaded)
    shm_regions_removed: list[str] = field(default_factory=list)

    @property
    def clean(self) -> bool:
        return self.models_unloaded and not self.shm_regions_removed


def stub_pids(shm_prefix: str) -> list[int]:
    """The Python backend stubs of the server whose shared-memory regions start with
    ``shm_prefix`` (each stub's command line names its region)."""
    found = subprocess.run(
        ["pgrep", "-f", f"triton_python_backend_stub.*{shm_prefix}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return [int(pid) for pid in found]


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class TritonServer:
    """A ``tritonserver`` process: ``with TritonServer(repo) as server: server.grpc_url ...``.

    Ports given as 0 are picked free. The server log goes to ``log_path`` (a temp file unless
    given; ``"-"``: this process's stdout, where a container's log is collected); start-up
    failures raise ``TritonServerError`` with the log's tail. Triton's GPU metrics are on where
    a GPU is present (``gpu_metrics=None``), since DCGM has nothing to report without one.
    """

    def __init__(
        self,
        model_repository=DEFAULT_MODEL_REPOSITORY,
        *,
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        host: str = "127.0.0.1",
        models: Sequence[str] = (DEFAULT_MODEL_NAME,),
        startup_timeout: float = 600.0,
        log_path=None,
        log_verbose: int = 0,
        extra_args: Sequence[str] = (),
        env: Optional[Mapping[str, str]] = None,
        prefer: str = "auto",
        exit_timeout: float = 30.0,
        gpu_metrics: Optional[bool] = None,
        backend_aliases: Sequence[str] = (),
        model_control: str = "explicit",
        open_model_control: bool = False,
    ) -> None:
        """``model_control="explicit"`` (the default) loads every model of the repository at
        start and lets ``stop`` unload them before signalling; "none" is Triton's default.

        Triton's model-repository API (``/v2/repository/...``: load, unload, index) is
        restricted to the launcher's own random key unless ``open_model_control``: with the
        Python backend, loading a model directory runs its code, and an unload takes the
        model away from every client."""
        self.model_repository = Path(model_repository).resolve()
        self.host = host
        self.http_port = http_port or free_port(host)
        self.grpc_port = grpc_port or free_port(host)
        self.metrics_port = metrics_port or free_port(host)
        self.models = list(models)
        self.startup_timeout = startup_timeout
        self.log_verbose = log_verbose
        self.extra_args = list(extra_args)
        self.extra_env = dict(env or {})
        self.prefer = prefer
        self.exit_timeout = exit_timeout
        self.gpu_metrics = gpu_present() if gpu_metrics is None else gpu_metrics
        self.backend_aliases = list(backend_aliases)
        self.model_control = model_control
        # None: the API is open to anyone who reaches the ports (an operator's explicit choice)
        self.model_control_key: Optional[str] = (
            None if open_model_control else secrets.token_hex(24)
        )
        self.last_stop: Optional[StopReport] = None
        self.log = ServerLog(log_file(log_path))
        self.process: Optional[subprocess.Popen] = None
        self.install: Optional[TritonInstall] = None
        # called while waiting for the server to be ready (slipstream serve reports progress)
        self.on_wait: Optional[Callable[[], None]] = None

    # endpoints
    @property
    def http_url(self) -> str:
        return f"{self.host}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self.host}:{self.metrics_port}/metrics"

    @property
    def shm_prefix(self) -> str:
        """The Python backend's shared-memory regions of this server start with this."""
        return f"slipstream_{os.getpid()}_{self.grpc_port}_"

    def command(self) -> list:
        assert self.install is not None
        cmd = [
            str(self.install.binary),
            "--model-repository",
            str(self.model_repository),
            "--http-address",
            self.host,
            "--http-port",
            str(self.http_port),
            "--grpc-address",
            self.host,
            "--grpc-port",
            str(self.grpc_port),
            "--metrics-address",
            self.host,
            "--metrics-port",
            str(self.metrics_port),
            "--allow-gpu-metrics",
            "true" if self.gpu_metrics else "false",
            "--log-verbose",
            str(self.log_verbose),
            "--exit-timeout-secs",
            str(int(self.exit_timeout)),
            # Several servers on one machine (tests run beside a dev server) must not share
            # the Python backend's shared-memory regions.
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
        ]
        if self.model_control == "explicit" and not any(
            a.startswith("--model-control-mode") for a in self.extra_args
        ):
            cmd += ["--model-control-mode=explicit", "--load-model=*"]
        if self.model_control_key is not None:
            restriction = f"model-repository:{MODEL_CONTROL_HEADER}={self.model_control_key}"
            cmd += [
                f"--http-restricted-api={restriction}",
                f"--grpc-restricted-protocol={restriction}",
            ]
        if self.install.backend_dir is not None:
            cmd += ["--backend-directory", str(self.install.backend_dir)]
        return cmd + self.extra_args

    def start(self, wait: bool = True) -> "TritonServer":
        if self.process is not None:
            raise TritonServerError("server already started")
        self.install = find_tritonserver(self.prefer, self.backend_aliases)
        env = server_env(self.install)
        env.update(self.extra_env)
        sink = self.log.open()
        # Own session: Ctrl-C in the terminal reaches our handler only; we stop Triton ourselves.
        self.process = subprocess.Popen(
            self.command(),
            stdout=sink,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        if wait:
            try:
                self.wait_ready()
            except BaseException:
                self.stop()
                raise
        return self

    @property
    def log_path(self) -> Optional[Path]:
        return self.log.path

    def log_tail(self, chars: int = 6000) -> str:
        return self.log.tail(chars)

    def came_up(self) -> bool:
        """Whether this run got as far as listening (``ServerLog.came_up``)."""
        return self.log.came_up()

    def _get(self, path: str, timeout: float = 2.0) -> int:
        try:
            with urllib.request.urlopen(f"http://{self.http_url}{path}", timeout=timeout) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except (urllib.error.URLError, OSError):
            return 0

    def is_ready(self) -> bool:
        if self._get("/v2/health/ready") != 200:
            return False
        return all(self._get(f"/v2/models/{m}/ready") == 200 for m in self.models)

    def wait_ready(self, timeout: Optional[float] = None) -> None:
        deadline = time.monotonic() + (self.startup_timeout if timeout is None else timeout)
        while True:
            if self.process is None:
                raise TritonServerError("server not started")
            code = self.process.poll()
            if code is not None:
                reasons = "".join(f"\n  {name}: {why}" for name, why in self.log.load_errors())
                raise TritonServerError(
                    f"tritonserver exited with code {code} before it was ready{reasons}\nlog "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            if self.on_wait is not None:
                self.on_wait()
            if self.is_ready():
                return
            if time.monotonic() > deadline:
                raise TritonServerError(
                    f"tritonserver not ready after {self.startup_timeout:.0f} s; log "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def stop(self, timeout: Optional[float] = None) -> Optional[int]:
        """Unload the models (in-flight requests finish or end with an error, each model
        finalizes), then SIGINT; SIGKILL if it lingers. Returns tritonserver's exit code;
        ``last_stop`` says how it went."""
        proc = self.process
        if proc is None:
            return None
        timeout = self.exit_timeout + 15 if timeout is None else timeout
        deadline = time.monotonic() + timeout
        outcome = "not tried"
        if proc.poll() is None and self.model_control == "explicit":
            outcome = self.unload_models(deadline)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            # Once nothing is left to finish (models gone, or stuck with nothing in flight),
            # an idle keep-alive connection (which Triton waits on for its whole exit
            # timeout) is not waited for.
            wait = {"unloaded": min(3.0, timeout), "stuck": 0.0}.get(
                outcome, max(deadline - time.monotonic(), 1.0)
            )
            try:
                proc.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass
        code = self.kill()
        report = self.last_stop
        assert report is not None, "kill() records how a running server ended"
        report.models_unloaded = outcome == "unloaded"
        report.unload = outcome
        return code

    @property
    def repository_api(self) -> RepositoryAPI:
        return RepositoryAPI(self.http_url, self.metrics_url, self.model_control_key)

    def model_states(self) -> dict[str, str]:
        """name -> state ("READY", "UNLOADING", "UNAVAILABLE", ...) from the repository index."""
        return self.repository_api.model_states()

    def unload_models(self, deadline: float) -> str:
        """Unload every model and wait for each to finalize (``RepositoryAPI.unload_all``)."""
        log_start = self.log.size()
        return self.repository_api.unload_all(
            deadline, lambda: self.running, lambda: self.log.finalizing_since(log_start)
        )

    def kill(self) -> Optional[int]:
        """SIGKILL Triton and its backend stubs (our own session), now, and remove the
        shared-memory regions they leave."""
        proc, self.process = self.process, None
        if proc is None:
            return None
        killed = proc.poll() is None
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # also stubs left behind by a crash
        except (ProcessLookupError, PermissionError):
            pass
        proc.wait()
        self.log.close()
        self.last_stop = StopReport(
            exit_code=proc.returncode, killed=killed, shm_regions_removed=self.remove_shm_regions()
        )
        return proc.returncode

    def remove_shm_regions(self) -> list[str]:
        """Remove this server's Python-backend shared-memory regions (a stub or Triton that
        died without unloading leaves them in /dev/shm)."""
        removed = []
        for path in glob.glob(os.path.join("/dev/shm", glob.escape(self.shm_prefix) + "*")):
            try:
                os.unlink(path)
                removed.append(os.path.basename(path))
            except OSError:
                pass
        return removed

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def __enter__(self) -> "TritonServer":
        if self.process is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
