"""``slipstream`` command line.

Subcommands live in ``COMMANDS``: name -> (help, add_args(parser), run(args) -> exit code), or
name -> "module.path" of a module defining ``HELP``, ``add_args`` and ``run`` (imported only
when that subcommand is used). Add one with ``register_command`` or an entry in the dict.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import queue
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from slipstream.server.launch.launcher import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_REPOSITORY,
    TritonServer,
    TritonServerError,
    render_model_repository,
)

if TYPE_CHECKING:
    from slipstream.server.openai.frontend import OpenAIFrontend

DEMO_PROMPT = "What is the capital of France?"
# tritonserver options `serve` sets from its own flags: --server-arg may not repeat them.
OWNED_SERVER_OPTIONS = (
    "--model-repository",
    "--model-store",
    "--http-address",
    "--http-port",
    "--grpc-address",
    "--grpc-port",
    "--metrics-address",
    "--metrics-port",
    "--model-control-mode",
    "--load-model",
    "--exit-timeout-secs",
    "--backend-directory",
    "--log-verbose",
    "--log-file",
)


# --------------------------------------------------------------------------- streaming client
@dataclass
class _StreamedAnswer:
    """What the responses of one streamed prompt added up to so far."""

    start: float  # time.monotonic() when the request went out
    parts: list[str] = field(default_factory=list)
    finish_reason: Optional[str] = None
    num_output_tokens: int = 0
    ttft_s: Optional[float] = None

    def take(self, result, on_text: Optional[Callable[[str], None]]) -> bool:
        """Add one response; True when it was the final one."""
        text = result.as_numpy("text_output")
        if text is not None and text.size:
            piece = text.reshape(-1)[0].decode("utf-8")
            if piece and self.ttft_s is None:
                self.ttft_s = time.monotonic() - self.start
            self.parts.append(piece)
            if on_text:
                on_text(piece)
        reason = result.as_numpy("finish_reason")
        if reason is not None and reason.size and reason.reshape(-1)[0]:
            self.finish_reason = reason.reshape(-1)[0].decode()
        count = result.as_numpy("num_output_tokens")
        if count is not None and count.size:
            self.num_output_tokens += int(count.reshape(-1)[0])
        return result.get_response().parameters["triton_final_response"].bool_param

    def summary(self) -> dict:
        return {
            "text": "".join(self.parts),
            "finish_reason": self.finish_reason,
            "ttft_s": self.ttft_s,
            "seconds": time.monotonic() - self.start,
            "num_output_tokens": self.num_output_tokens,
        }


def _prompt_inputs(prompt: str, max_tokens: int, temperature: float, chat: bool) -> list:
    import numpy as np
    import tritonclient.grpc as grpcclient

    def tensor(name, value, dtype):
        t = grpcclient.InferInput(name, list(value.shape), dtype)
        t.set_data_from_numpy(value)
        return t

    sampling = json.dumps({"max_tokens": max_tokens, "temperature": temperature}).encode()
    return [
        tensor("text_input", np.array([prompt.encode("utf-8")], dtype=np.object_), "BYTES"),
        tensor("stream", np.array([True]), "BOOL"),
        tensor("sampling_parameters", np.array([sampling], dtype=np.object_), "BYTES"),
        tensor("apply_chat_template", np.array([chat]), "BOOL"),
        tensor("return_finish_reason", np.array([True]), "BOOL"),
        tensor("return_num_output_tokens", np.array([True]), "BOOL"),
    ]


def stream_prompt(
    grpc_url: str,
    prompt: str,
    *,
    model: str = DEFAULT_MODEL_NAME,
    max_tokens: int = 128,
    temperature: float = 0.0,
    chat: bool = True,
    on_text: Optional[Callable[[str], None]] = None,
    timeout: float = 600.0,
) -> dict:
    """Stream one answer over gRPC; returns {"text", "finish_reason", "ttft_s", "seconds",
    "num_output_tokens"}. Raises RuntimeError with the server's message on an error."""
    import tritonclient.grpc as grpcclient

    inputs = _prompt_inputs(prompt, max_tokens, temperature, chat)
    responses: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(grpc_url)
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    answer = _StreamedAnswer(start=time.monotonic())
    try:
        client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        while True:
            result, error = responses.get(timeout=timeout)
            if error is not None:
                raise RuntimeError(f"server error: {error}")
            if answer.take(result, on_text):
                break
    finally:
        client.stop_stream()
        client.close()
    return answer.summary()


# --------------------------------------------------------------------------- serve
def parse_sets(items: Optional[list[str]]) -> dict[str, str]:
    """`--set KEY=VALUE` items as a dict (also the bench's --set and --variant)."""
    out = {}
    for item in items or []:
        if "=" not in item:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        help="'default' (embedded SmolLM2-135M-Instruct) or a Hugging Face "
        "model directory; same as --set model=...",
    )
    p.add_argument(
        "--quantization",
        choices=("int8", "gguf", "awq", "gptq"),
        help="int8: quantize the weights at load; gguf / awq / gptq: serve a 4-bit "
        "checkpoint's blocks as they ship (with --model default, the embedded model's own "
        "Q4_1 GGUF), CPU; same as --set quantization=...",
    )
    p.add_argument(
        "--model-repository",
        default=os.environ.get("SLIPSTREAM_MODEL_REPOSITORY", str(DEFAULT_MODEL_REPOSITORY)),
        help="Triton model repository to serve (copied with the overrides applied)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--http-port", type=int, default=8000, help="0 = any free port")
    p.add_argument("--grpc-port", type=int, default=8001, help="0 = any free port")
    p.add_argument("--metrics-port", type=int, default=8002, help="0 = any free port")
    openai_port = os.environ.get("SLIPSTREAM_OPENAI_PORT")
    p.add_argument(
        "--openai-port",
        type=int,
        default=int(openai_port) if openai_port else None,
        help="also serve the OpenAI-compatible API (/v1/chat/completions, "
        "/v1/completions, /v1/models, /health) on this port, through Triton; "
        "0 = any free port (printed); off by default "
        "(env SLIPSTREAM_OPENAI_PORT)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="KEY=VALUE",
        default=[],
        help="override a config.pbtxt parameter (engine setting), repeatable",
    )
    p.add_argument("--prompt", help="once ready, stream the answer to this prompt over gRPC")
    p.add_argument("--max-tokens", type=int, default=128, help="max_tokens for --prompt")
    p.add_argument(
        "--raw-prompt",
        action="store_true",
        help="send --prompt as is, without the model's chat template",
    )
    p.add_argument(
        "--exit-after-prompt", action="store_true", help="stop the server after answering --prompt"
    )
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument(
        "--exit-timeout",
        type=float,
        default=30.0,
        help="on Ctrl-C/SIGTERM, seconds in-flight requests get to finish",
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=5,
        help="restart tritonserver when it dies (e.g. its model's stub was killed), "
        "at most this many times in 10 minutes; 0 = exit instead",
    )
    p.add_argument(
        "--log-file", help="tritonserver log (default: a temp file; '-': stdout, as in a container)"
    )
    p.add_argument("--log-verbose", type=int, default=0, help="tritonserver --log-verbose level")
    p.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="--OPTION=VALUE",
        help="pass an option to tritonserver as is (repeatable), e.g. "
        "--server-arg=--log-format=ISO8601; the options serve sets itself "
        f"({', '.join(OWNED_SERVER_OPTIONS)}) are refused",
    )
    p.add_argument(
        "--vllm-alias",
        action="store_true",
        help="also install the slipstream backend under the name 'vllm': a repository "
        'written for Triton\'s vLLM backend (backend: "vllm", 1/model.json) '
        "loads unchanged, and tools that look for backend 'vllm' (Triton's "
        "OpenAI frontend) treat its models as vLLM ones",
    )
    p.add_argument(
        "--allow-model-control",
        action="store_true",
        help="open Triton's model-repository API (/v2/repository: load, unload, "
        "index) to every client that reaches the HTTP or gRPC port. Off by "
        "default: only the launcher, with a random key, may use it (loading a "
        "Python-backend model runs its code; an unload takes the model away)",
    )


def server_args(values: list[str]) -> list[str]:
    """``--server-arg`` values, checked: each one ``--option[=value]``, none that serve owns
    (ports and addresses come from its own flags; the model-control mode is how it stops
    Triton cleanly)."""
    for value in values:
        name = value.split("=", 1)[0]
        if not name.startswith("--"):
            raise SystemExit(
                f"--server-arg {value!r}: give tritonserver options as --server-arg=--name=value"
            )
        if name in OWNED_SERVER_OPTIONS:
            raise SystemExit(
                f"--server-arg {name}: set by slipstream serve itself; use its "
                "own flags (--host, --http-port, --model-repository, ...)"
            )
    return list(values)


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop(signal.Signals(signum).name)


def _validate(repo: Path, aliases=()) -> dict:
    """Check every Slipstream model of the rendered repository (config.pbtxt parameters and
    1/model.json) in-process, before a server is started: name -> engine settings."""
    from slipstream.server.launch.repository import check_models, find_models

    try:
        checked = check_models(find_models(repo, aliases))
    except ValueError as e:
        raise SystemExit(f"invalid engine setting: {e}")
    if not checked:
        raise SystemExit(
            f"{repo} holds no model served by the slipstream backend"
            + ("" if aliases else ' (backend "vllm" models need --vllm-alias)')
        )
    return {name: settings.engine for name, settings in checked.items()}


RESTART_WINDOW_S = 600.0


def _serve_until_stopped(server: TritonServer, max_restarts: int) -> int:
    """Watch tritonserver; when it dies, clean up after it and start it again (at most
    ``max_restarts`` times in ``RESTART_WINDOW_S``). Returns the exit code once it gives up."""
    restarts: list = []
    while True:
        while server.running:
            time.sleep(0.5)
        code = server.process.returncode if server.process is not None else None
        server.kill()  # its process group and shared-memory regions
        now = time.monotonic()
        restarts = [t for t in restarts if now - t < RESTART_WINDOW_S]
        print(
            f"tritonserver exited unexpectedly (code {code}); log {server.log_path}:\n"
            f"{server.log_tail(2000)}",
            file=sys.stderr,
            flush=True,
        )
        if len(restarts) >= max_restarts:
            print(
                f"not restarting: {len(restarts)} restarts in the last "
                f"{RESTART_WINDOW_S / 60:.0f} minutes",
                file=sys.stderr,
                flush=True,
            )
            return 1
        restarts.append(now)
        print(
            f"restarting tritonserver ({len(restarts)} of at most {max_restarts} in "
            f"{RESTART_WINDOW_S / 60:.0f} minutes) ...",
            flush=True,
        )
        t0 = time.monotonic()
        try:
            server.start()
        except TritonServerError as e:  # died or hung before ready: clean up, try again
            print(f"restart failed: {e}", file=sys.stderr, flush=True)
            server.kill()
            continue
        print(f"ready again in {time.monotonic() - t0:.1f} s", flush=True)


def _start_first(server: TritonServer) -> bool:
    """Start tritonserver: True once it is ready, False when it came up and then died before
    we saw it ready (a stub killed in that window), which the restart loop handles like any
    crash. A server that never came up (a bad setting, a model that fails to load) raises:
    starting it again would fail the same way."""
    try:
        server.start()
    except TritonServerError as e:
        if not server.came_up():
            raise
        print(f"tritonserver died as it came up: {e}", file=sys.stderr, flush=True)
        return False
    return True


@dataclass
class _ServePlan:
    """What ``serve`` prepared before starting anything: a rendered, checked repository."""

    work: Path  # removed at the end
    repo: Path
    aliases: list[str]
    names: list[str]  # the Slipstream models
    prompt_model: str  # the one --prompt asks
    engine: dict[str, str]  # its engine settings


@dataclass
class _Session:
    server: TritonServer
    openai_api: Optional["OpenAIFrontend"] = None  # once started


def run_serve(args: argparse.Namespace) -> int:
    extra_args = server_args(args.server_arg)
    plan = _plan_serve(args)
    session = _Session(
        TritonServer(
            plan.repo,
            host=args.host,
            http_port=args.http_port,
            grpc_port=args.grpc_port,
            metrics_port=args.metrics_port,
            startup_timeout=args.startup_timeout,
            log_path=args.log_file,
            log_verbose=args.log_verbose,
            exit_timeout=args.exit_timeout,
            models=plan.names,
            backend_aliases=plan.aliases,
            open_model_control=args.allow_model_control,
            extra_args=extra_args,
        )
    )
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    code = 0
    try:
        code = _serve(args, plan, session)
    except _Stop as e:
        print(
            f"\n{e}: stopping; in-flight requests may finish (up to {args.exit_timeout:.0f} s), "
            "Ctrl-C again to kill",
            flush=True,
        )
    except (TritonServerError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        code = 1
    finally:
        _stop_session(session)
        for s, h in old.items():
            signal.signal(s, h)
        import shutil

        shutil.rmtree(plan.work, ignore_errors=True)
    return code


def _plan_serve(args: argparse.Namespace) -> _ServePlan:
    overrides = parse_sets(args.set)
    if args.model:
        overrides["model"] = args.model
    if args.quantization:
        overrides["quantization"] = args.quantization
    work = Path(tempfile.mkdtemp(prefix="slipstream-serve-"))
    repo = render_model_repository(args.model_repository, work / "model_repository", overrides)
    aliases = ["vllm"] if args.vllm_alias else []
    engines = _validate(repo, aliases)
    names = list(engines)
    prompt_model = DEFAULT_MODEL_NAME if DEFAULT_MODEL_NAME in engines else names[0]
    if any(e.get("model", "default") in ("", "default") for e in engines.values()):
        # convert the GGUF once, here, with a progress bar
        from slipstream.worker.model.gguf import default_model_dir

        default_model_dir()
    return _ServePlan(work, repo, aliases, names, prompt_model, engines[prompt_model])


def _serve(args: argparse.Namespace, plan: _ServePlan, session: _Session) -> int:
    """Start, announce, answer --prompt, then serve until stopped: the exit code."""
    server = session.server
    print(
        f"starting tritonserver (model {plan.engine.get('model', 'default')}; log "
        f"{server.log_path or 'on stdout'}) ...",
        flush=True,
    )
    t0 = time.monotonic()
    if not _start_first(server):
        return _serve_until_stopped(server, args.max_restarts)
    print(
        f"ready in {time.monotonic() - t0:.1f} s\n"
        f"  models   {', '.join(plan.names)}\n"
        f"  HTTP     http://{server.http_url}  (POST /v2/models/{plan.prompt_model}/generate, "
        f"/generate_stream)\n"
        f"  gRPC     {server.grpc_url}\n"
        f"  metrics  {server.metrics_url}",
        flush=True,
    )
    if args.openai_port is not None:
        session.openai_api = _start_openai(args, plan.repo, plan.aliases, server)
    if args.prompt:
        _answer_prompt(args, server, plan.prompt_model)
        if args.exit_after_prompt:
            return 0
    print("serving; Ctrl-C to stop", flush=True)
    return _serve_until_stopped(server, args.max_restarts)


def _echo(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _answer_prompt(args: argparse.Namespace, server: TritonServer, model: str) -> None:
    print(f"\n>>> {args.prompt}", flush=True)
    result = stream_prompt(
        server.grpc_url,
        args.prompt,
        model=model,
        max_tokens=args.max_tokens,
        chat=not args.raw_prompt,
        on_text=_echo,
    )
    rate = result["num_output_tokens"] / result["seconds"] if result["seconds"] else 0.0
    ttft = result["ttft_s"] or 0.0
    print(
        f"\n[{result['num_output_tokens']} tokens, finish_reason="
        f"{result['finish_reason']}, first token {ttft * 1000:.0f} ms, "
        f"{rate:.1f} tokens/s]",
        flush=True,
    )


def _stop_session(session: _Session) -> None:
    try:
        session.server.stop()  # first: Triton drains at once; the API relays what is in flight
    except _Stop:  # a second Ctrl-C: do not wait for in-flight requests
        print("killing tritonserver", flush=True)
        session.server.kill()
    finally:
        if session.openai_api is not None:
            session.openai_api.stop()


def _start_openai(
    args: argparse.Namespace, repo: Path, aliases: list[str], server: TritonServer
) -> "OpenAIFrontend":
    """The OpenAI-compatible API on a thread of this process, talking to ``server`` over
    gRPC (it keeps its ports across restarts, so the API outlives them)."""
    from slipstream.server.openai.frontend import OpenAIFrontend

    api = OpenAIFrontend.for_repository(
        repo,
        server.grpc_url,
        aliases,
        metrics_url=server.metrics_url,
        host=args.host,
        port=args.openai_port,
    ).start()
    print(
        f"  OpenAI   {api.url}/v1  (chat/completions, completions, models; {api.url}/health)",
        flush=True,
    )
    return api


# --------------------------------------------------------------------------- install-backend
def add_install_backend_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--backend-directory",
        default="/opt/tritonserver/backends",
        help="Triton's backend directory (default /opt/tritonserver/backends)",
    )
    p.add_argument(
        "--alias",
        action="append",
        default=[],
        metavar="NAME",
        help="also install it under this backend name (e.g. vllm), repeatable",
    )


def run_install_backend(args: argparse.Namespace) -> int:
    """Write <dir>/slipstream/model.py (and one per alias): what a Triton installation needs
    for ``backend: "slipstream"`` models, besides this package importable by its Python."""
    from slipstream.server.launch.launcher import BACKEND_NAME, backend_model_py

    for name in [BACKEND_NAME, *args.alias]:
        target = Path(args.backend_directory) / name
        target.mkdir(parents=True, exist_ok=True)
        (target / "model.py").write_text(backend_model_py())
        print(f"installed {target / 'model.py'}")
    return 0


# --------------------------------------------------------------------------- the table
Command = Union[tuple, str]
COMMANDS: dict = {
    "serve": (
        "start tritonserver with the slipstream model (optionally answer --prompt)",
        add_serve_args,
        run_serve,
    ),
    "install-backend": (
        "install the slipstream Python-based backend into a Triton backend directory",
        add_install_backend_args,
        run_install_backend,
    ),
    "bench": "slipstream_bench.cli",
}


def register_command(name: str, help: str, add_args: Callable, run: Callable) -> None:
    COMMANDS[name] = (help, add_args, run)


def _resolve(entry: Command) -> tuple:
    if isinstance(entry, str):
        module = importlib.import_module(entry)
        return module.HELP, module.add_args, module.run
    return entry


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, entry in COMMANDS.items():
        if isinstance(entry, str):  # lazily imported: do not import it for --help of others
            p = sub.add_parser(name, help=f"(see slipstream {name} --help)", add_help=False)
            p.add_argument("rest", nargs=argparse.REMAINDER)
            continue
        help_text, add_args, run = entry
        p = sub.add_parser(name, help=help_text, description=help_text)
        add_args(p)
        p.set_defaults(_run=run)
    return parser


def main(argv: Optional[list] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and isinstance(COMMANDS.get(argv[0]), str):  # lazy subcommand: its own parser
        help_text, add_args, run = _resolve(COMMANDS[argv[0]])
        p = argparse.ArgumentParser(prog=f"slipstream {argv[0]}", description=help_text)
        add_args(p)
        return int(run(p.parse_args(argv[1:])) or 0)
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
