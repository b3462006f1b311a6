"""Run a real ``tritonserver`` on a model repository: locate it, prepare it, start, wait, stop.

Two installations are supported:

* a Triton container (``tritonserver`` on ``PATH``, backends in ``/opt/tritonserver/backends``):
  the binary is used as it is;
* the ``nvidia-pytriton`` wheel, which ships ``tritonserver``, the Python backend and a backend
  stub for each Python version. The backend directory Triton wants (``python/`` holding
  ``libtriton_python.so``, ``triton_python_backend_utils.py`` and the stub built for the running
  Python) is assembled once in a cache directory, and the process gets the wheel's shared
  libraries and this interpreter's ``libpython`` on ``LD_LIBRARY_PATH`` and this environment's
  ``bin/`` first on ``PATH`` (so the stub's embedded Python sees the same site-packages).

Either way the backend directory holds the Python-based backend ``slipstream/model.py``
(``triton_backends/slipstream`` of this repository), so ``backend: "slipstream"`` models load; a
container that lacks it gets a cache directory linking its own backends plus this one. Aliases
(``vllm``) install the same backend under another name, for repositories written for Triton's
vLLM backend and for tools that look at a model's backend name.

``TritonServer`` is a context manager used by the tests and by ``slipstream serve``;
``render_model_repository`` copies a model repository with config parameters replaced, so engine
settings can change at launch without editing ``config.pbtxt``.

Stopping (``TritonServer.stop``) does not rely on Triton's own signal handling alone, which in
2.51 waits on every open HTTP connection (idle keep-alive ones too) before it even starts to
unload models, and exits with code 1 (or crashes) when its exit timeout runs out with requests
in flight or a model still loaded. Models are loaded in explicit mode and unloaded first, over
the repository API, while the server is fully up: the model lets in-flight requests finish
(up to the exit timeout) and ends the rest with an error, then finalizes. Only then is
``tritonserver`` signalled, and killed if it lingers; its process group (backend stubs and
their watchdogs) and its Python-backend shared-memory regions are always removed.

The model-repository API is restricted (``--http-restricted-api`` /
``--grpc-restricted-protocol``) to a random key this object alone holds and sends with its own
repository calls, unless ``open_model_control``: with the Python backend a loadable model
directory is code execution, and an unload takes the model away from every client.
"""

from __future__ import annotations

import glob
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

REPO_ROOT = Path(__file__).resolve().parents[4]
# An unloading model with nothing in flight for this long will not finalize (see unload_models).
STUCK_UNLOAD_S = 3.0
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL_NAME = "slipstream"
# The header (HTTP) / metadata key (gRPC) that unlocks Triton's model-repository API (load,
# unload, index) when it is restricted: its value is a random key only the launcher knows.
MODEL_CONTROL_HEADER = "slipstream-model-control-key"
BACKEND_NAME = "slipstream"
BACKEND_SOURCE = REPO_ROOT / "triton_backends" / BACKEND_NAME / "model.py"
# What triton_backends/slipstream/model.py says, for installs without the repository's files.
BACKEND_MODEL_PY = "from slipstream.server.triton_model import TritonPythonModel  # noqa: F401\n"


class TritonServerError(RuntimeError):
    """tritonserver could not be found, did not start, or did not become ready."""


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


# --------------------------------------------------------------------------- locating
@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Optional[Path]  # None: the binary's built-in default (a Triton container)
    lib_dirs: list = field(default_factory=list)
    source: str = "path"  # "path" (container / system install) or "pytriton" (the wheel)


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_root() -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def cache_dir() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream"
    )
    return Path(root)


def find_tritonserver(prefer: str = "auto", backend_aliases: Sequence[str] = ()) -> TritonInstall:
    """``prefer``: ``auto`` (PATH first, then the nvidia-pytriton wheel), ``path`` or ``pytriton``.

    ``SLIPSTREAM_TRITONSERVER=/path/to/tritonserver`` forces a binary (a container layout is
    assumed: its backends next to it in ``../backends``). ``backend_aliases``: other names the
    slipstream backend is installed under (``vllm``).
    """
    forced = os.environ.get("SLIPSTREAM_TRITONSERVER")
    found = forced or (shutil.which("tritonserver") if prefer in ("auto", "path") else None)
    if forced and not Path(forced).exists():
        raise TritonServerError(f"SLIPSTREAM_TRITONSERVER={forced} does not exist")
    if found:
        backends = Path(found).resolve().parent.parent / "backends"
        return TritonInstall(
            Path(found),
            overlay_backend_dir(backends if backends.is_dir() else None, backend_aliases),
            [],
            "path",
        )
    if prefer in ("auto", "path"):
        if prefer == "path":
            raise TritonServerError("tritonserver is not on PATH")
    root = _pytriton_root()
    if root is None:
        raise TritonServerError(
            "tritonserver not found: run inside a Triton container (tritonserver on PATH) or "
            "install the nvidia-pytriton wheel (pip install -e '.[server]')"
        )
    libs = root.parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR")
    lib_dirs = [str(p) for p in (libs, libdir) if p and Path(p).is_dir()]
    return TritonInstall(
        root / "bin" / "tritonserver",
        prepare_backend_dir(root, backend_aliases),
        lib_dirs,
        "pytriton",
    )


def backend_model_py() -> str:
    """The slipstream backend's ``model.py``: the repository's, else its one line."""
    return BACKEND_SOURCE.read_text() if BACKEND_SOURCE.is_file() else BACKEND_MODEL_PY


def prepare_backend_dir(pytriton_root: Path, aliases: Sequence[str] = ()) -> Path:
    """Assemble ``<cache>/triton_backends/<key>/`` for the running Python (once): ``python/``
    from the wheel, ``slipstream/model.py`` and one copy per alias."""
    stub = pytriton_root / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonServerError(
            f"nvidia-pytriton ships no Python backend stub for Python "
            f"{_python_tag()} (looked for {stub})"
        )
    src = pytriton_root / "backends" / "python"
    files = {
        "libtriton_python.so": src / "libtriton_python.so",
        "triton_python_backend_utils.py": src / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    model_py = backend_model_py()
    names = [BACKEND_NAME, *sorted(set(aliases) - {BACKEND_NAME})]
    stamp = json.dumps(
        {
            "files": {
                n: [str(p), p.stat().st_size, int(p.stat().st_mtime)]
                for n, p in sorted(files.items())
            },
            "backends": names,
            "model.py": model_py,
        },
        sort_keys=True,
    )
    key = f"py{_python_tag()}-{uuid.uuid5(uuid.NAMESPACE_URL, stamp).hex[:12]}"

    def fill(tmp: Path) -> None:
        (tmp / "python").mkdir()
        for name, path in files.items():
            shutil.copy2(path, tmp / "python" / name)
        os.chmod(tmp / "python" / "triton_python_backend_stub", 0o755)
        for name in names:
            (tmp / name).mkdir(exist_ok=True)
            (tmp / name / "model.py").write_text(model_py)

    return _cached_dir(key, stamp, fill)


def overlay_backend_dir(backends: Optional[Path], aliases: Sequence[str] = ()) -> Optional[Path]:
    """A container's backend directory as it is when it already holds ``slipstream`` (and no
    alias is asked for); otherwise a cache directory linking its backends, plus ours."""
    names = [BACKEND_NAME, *sorted(set(aliases) - {BACKEND_NAME})]
    if backends is None:  # no backends next to the binary: it knows where its own are
        return None
    if (backends / BACKEND_NAME).is_dir() and names == [BACKEND_NAME]:
        return backends
    model_py = backend_model_py()
    entries = sorted(p.name for p in backends.iterdir())
    stamp = json.dumps(
        {"source": str(backends), "entries": entries, "backends": names, "model.py": model_py},
        sort_keys=True,
    )
    key = f"overlay-{uuid.uuid5(uuid.NAMESPACE_URL, stamp).hex[:12]}"

    def fill(tmp: Path) -> None:
        for entry in entries:
            if entry not in names:
                os.symlink(backends / entry, tmp / entry)
        for name in names:
            (tmp / name).mkdir()
            (tmp / name / "model.py").write_text(model_py)

    return _cached_dir(key, stamp, fill)


def _cached_dir(key: str, stamp: str, fill) -> Path:
    """``<cache>/triton_backends/<key>``, built once by ``fill(tmp)`` and renamed into place."""
    target = cache_dir() / "triton_backends" / key
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".tmp", dir=target.parent))
    fill(tmp)
    (tmp / ".complete").write_text(stamp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / ".complete").exists():
            raise
    return target


def server_env(install: TritonInstall, base: Optional[Mapping[str, str]] = None) -> dict:
    env = dict(os.environ if base is None else base)
    if install.lib_dirs:
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(install.lib_dirs + ([old] if old else []))
    # This interpreter's bin/ first: the stub's embedded Python then resolves this environment.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(
        [bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    )
    if sys.prefix != sys.base_prefix:
        env.setdefault("VIRTUAL_ENV", sys.prefix)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --------------------------------------------------------------------------- repository
_PARAM_RE = re.compile(
    r'parameters\s*:?\s*\{\s*key\s*:\s*"(?P<key>[^"]+)"\s*value\s*:?\s*\{\s*'
    r'string_value\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*\}\s*\}',
    re.S,
)


def _pbtxt_escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _pbtxt_unescape(value: str) -> str:
    return re.sub(r"\\(.)", lambda m: {"n": "\n"}.get(m.group(1), m.group(1)), value)


def read_parameters(config_pbtxt: str) -> dict:
    """The ``parameters`` of a config.pbtxt as a dict of strings."""
    return {
        m.group("key"): _pbtxt_unescape(m.group("value")) for m in _PARAM_RE.finditer(config_pbtxt)
    }


def set_parameters(config_pbtxt: str, overrides: Mapping[str, object]) -> str:
    """Replace (or append) ``parameters`` entries; values are written as strings."""
    values = {
        k: ("" if v is None else str(v).lower() if isinstance(v, bool) else str(v))
        for k, v in overrides.items()
    }
    seen = set()

    def repl(m: re.Match) -> str:
        key = m.group("key")
        if key not in values:
            return m.group(0)
        seen.add(key)
        start, end = m.span("value")
        text = m.group(0)
        off = m.start()
        return text[: start - off] + _pbtxt_escape(values[key]) + text[end - off :]

    out = _PARAM_RE.sub(repl, config_pbtxt)
    extra = [k for k in values if k not in seen]
    if extra:
        out = (
            out.rstrip("\n")
            + "\n"
            + "".join(
                f'parameters: {{\n  key: "{k}"\n'
                f'  value: {{ string_value: "{_pbtxt_escape(values[k])}" }}\n}}\n'
                for k in extra
            )
        )
    return out


def render_model_repository(
    src,
    dst,
    overrides: Optional[Mapping[str, object]] = None,
    models: Optional[Sequence[str]] = None,
) -> Path:
    """Mirror model repository ``src`` at ``dst`` with config ``parameters`` replaced.

    Files below ``LINK_FROM_BYTES`` (configs, ``model.py``, ``model.json``) are copied, so a
    rendering is a private copy its caller may edit (tests write their own ``model.py``);
    larger files are symbolic links to their source, so weights in the repository cost no
    space where it is rendered (a container's /tmp is small). ``overrides`` apply to every
    model of the repository (or only to ``models``). A ``model`` override that names an existing
    directory is made absolute.
    """
    src, dst = Path(src).resolve(), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"model repository {src} does not exist")
    overrides = dict(overrides or {})
    model = overrides.get("model")
    if (
        isinstance(model, (str, Path))
        and str(model) not in ("", "default")
        and Path(model).is_dir()
    ):
        overrides["model"] = str(Path(model).resolve())
    if dst.exists():
        shutil.rmtree(dst)
    _mirror(src, dst)
    for config in sorted(dst.glob("*/config.pbtxt")):
        if models is not None and config.parent.name not in models:
            continue
        if overrides:
            config.write_text(set_parameters(config.read_text(), overrides))
    return dst


LINK_FROM_BYTES = 1 << 20  # files this large or larger are linked, not copied


def _mirror(src: Path, dst: Path) -> None:
    """Directories recreated, small files copied, large ones linked."""
    for here, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(here).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".pyc"):
                continue
            source = Path(here) / name
            if source.stat().st_size < LINK_FROM_BYTES:
                shutil.copyfile(source, dst / rel / name)
            else:
                (dst / rel / name).symlink_to(source.resolve())


# --------------------------------------------------------------------------- the server
STDOUT_LOG = "-"  # log_path that sends Triton's log to this process's stdout (containers)


def gpu_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA GPU is visible (the device plugin and ``docker --gpus`` mount /dev/nvidiaN)."""
    return any(dev.glob("nvidia[0-9]*"))


def stub_pids(shm_prefix: str) -> list[int]:
    """The Python backend stubs of the server whose shared-memory regions start with
    ``shm_prefix`` (each stub's command line names its region)."""
    found = subprocess.run(
        ["pgrep", "-f", f"triton_python_backend_stub.*{shm_prefix}"],
        capture_output=True,
        text=True,
    ).stdout.split()
    return [int(pid) for pid in found]


def _log_file(log_path) -> Optional[Path]:
    """Where Triton's log goes: None for stdout (STDOUT_LOG), a temp file when none is given."""
    if log_path == STDOUT_LOG:
        return None
    return (
        Path(log_path)
        if log_path
        else Path(tempfile.mkstemp(prefix="tritonserver-", suffix=".log")[1])
    )


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
        self._own_log = log_path is None
        self.log_path = _log_file(log_path)
        self.process: Optional[subprocess.Popen] = None
        self.install: Optional[TritonInstall] = None
        self._log_start = 0

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
        self._log = open(self.log_path, "ab", buffering=0) if self.log_path else None
        self._log_start = self._log.tell() if self._log is not None else 0  # this run's lines
        # Own session: Ctrl-C in the terminal reaches our handler only; we stop Triton ourselves.
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
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

    def log_tail(self, chars: int = 6000) -> str:
        if self.log_path is None:
            return "(the log went to stdout)"
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return text[-chars:]

    def came_up(self) -> bool:
        """Whether this run's tritonserver got as far as listening (its log says so): one that
        dies after that crashed while serving, one that dies before failed to start. Unknown
        (False) with the log on stdout."""
        if self.log_path is None:
            return False
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_start)
                text = f.read()
        except OSError:
            return False
        return b"Started GRPCInferenceService" in text and b"Started HTTPService" in text

    def load_errors(self) -> list:
        """(model, reason) for each model Triton failed to load, from its log (the reason's
        first line: a model's own error, e.g. a refused setting)."""
        if self.log_path is None:
            return []
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return []
        found = re.findall(
            r"failed to load '([^']+)' version \d+: (?:Internal: )?([^\n]*?)(?:\\n|\"$)", text, re.M
        )
        return list(dict.fromkeys(found))

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
                reasons = "".join(f"\n  {name}: {why}" for name, why in self.load_errors())
                raise TritonServerError(
                    f"tritonserver exited with code {code} before it was ready{reasons}\nlog "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
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

    def _post(self, path: str, timeout: float = 10.0) -> tuple:
        headers = (
            {MODEL_CONTROL_HEADER: self.model_control_key}
            if self.model_control_key is not None
            else {}
        )
        req = urllib.request.Request(
            f"http://{self.http_url}{path}", data=b"", method="POST", headers=headers
        )
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except (urllib.error.URLError, OSError) as e:
            return 0, str(e)

    def model_states(self) -> dict:
        """name -> state ("READY", "UNLOADING", "UNAVAILABLE", ...) from the repository index."""
        status, body = self._post("/v2/repository/index")
        if status != 200:
            return {}
        return {m["name"]: m.get("state", "") for m in json.loads(body)}

    def unload_models(self, deadline: float) -> str:
        """Unload every loaded model and wait: "unloaded" once each has finalized, "stuck"
        when one will not (below), "timeout" at the deadline."""
        log = self.log_path
        log_start = log.stat().st_size if log is not None and log.exists() else 0
        for name, state in self.model_states().items():
            if state in ("READY", "LOADING"):
                self._post(
                    f"/v2/repository/models/{name}/unload",
                    timeout=max(deadline - time.monotonic(), 1.0),
                )
        idle_since = None
        while time.monotonic() < deadline and self.running:
            states = self.model_states()
            if states and all(
                state not in ("READY", "LOADING", "UNLOADING") for state in states.values()
            ):
                return "unloaded"
            # Triton 2.51 can keep a model referenced for ever after a gRPC stream was
            # cancelled (a race fixed upstream in 25.05): nothing left to finish, yet no
            # finalize. Waiting for the deadline would only delay the kill.
            idle = self._requests_in_flight() == 0 and not self._finalizing(log_start)
            idle_since = (idle_since or time.monotonic()) if idle else None
            if idle_since is not None and time.monotonic() - idle_since > STUCK_UNLOAD_S:
                return "stuck"
            time.sleep(0.1)
        return "timeout"

    def _finalizing(self, log_start: int) -> bool:
        """Whether a slipstream model has begun its finalize since ``log_start`` (its log).
        With the log on stdout there is no telling: assume it has, so stop waits its deadline."""
        if self.log_path is None:
            return True
        try:
            with open(self.log_path, "rb") as f:
                f.seek(log_start)
                return b"slipstream: finalize" in f.read()
        except OSError:
            return False

    def _requests_in_flight(self) -> Optional[float]:
        """Running + waiting requests of the slipstream models (their metrics); None if unknown."""
        try:
            with urllib.request.urlopen(self.metrics_url, timeout=2) as r:
                text = r.read().decode()
        except (urllib.error.URLError, OSError):
            return None
        values = [
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("slipstream_requests_running", "slipstream_requests_waiting"))
        ]
        return sum(values) if values else None

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
        if self._log is not None:
            self._log.close()
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
