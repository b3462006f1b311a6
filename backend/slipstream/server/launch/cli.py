"""``slipstream`` command line.

Subcommands live in ``COMMANDS``: name -> (help, add_args(parser), run(args) -> exit code), or
name -> "module.path" of a module defining ``HELP``, ``add_args`` and ``run`` (imported only
when that subcommand is used). Add one with ``register_command`` or an entry in the dict.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Union

from slipstream import __version__
from slipstream.core.config import EngineConfig
from slipstream.server.launch.engine_flags import add_engine_flags, engine_overrides
from slipstream.server.launch.launcher import TritonServer
from slipstream.server.launch.prompt_client import stream_prompt
from slipstream.server.launch.repository import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_REPOSITORY,
    check_models,
    find_models,
    rename_model,
    render_model_repository,
)
from slipstream.server.launch.startup_report import StartupReport
from slipstream.server.launch.triton_install import TritonServerError

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


SERVE_EXAMPLES = """\
examples:
  slipstream serve                       # the embedded SmolLM2-135M-Instruct on CPU
  slipstream serve /models/Qwen2.5-0.5B-Instruct --max-model-len 4096 --port 9000
  slipstream serve --dtype bfloat16 --quantization int8 --max-num-seqs 32
  slipstream serve --lora-modules sql=/adapters/sql --served-model-name base
  slipstream serve --model-repository samples/model_repository
  slipstream serve --set tpot_target_ms=50 --prompt "Hello" --exit-after-prompt

Engine flags are vLLM's engine arguments; --set NAME=VALUE takes the same names (and
Slipstream's own setting names). Every setting: docs/configuration.md.
"""
PHASE_HANDLER = "slipstream serve: start-up phases"
# Triton's ports when not given (an OpenAI port given on one of them moves it to a free one).
TRITON_PORTS = {"http_port": 8000, "grpc_port": 8001, "metrics_port": 8002}


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default in its help (where it has one the help does not already say), and
    the examples laid out as written."""

    def _get_help_string(self, action: argparse.Action) -> Optional[str]:
        help_text = action.help or ""
        if "(default" in help_text or action.default in (None, False, [], argparse.SUPPRESS):
            return help_text
        return f"{help_text} (default: {action.default})"


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.formatter_class = HelpFormatter
    p.epilog = SERVE_EXAMPLES
    p.add_argument(
        "model_positional",
        nargs="?",
        metavar="MODEL",
        help="'default' (the embedded SmolLM2-135M-Instruct) or a Hugging Face model "
        "directory; the same as --model / --set model=...",
    )
    p.add_argument("--model", help="the model, as the positional MODEL")
    add_engine_flags(
        p.add_argument_group("engine (vLLM's engine arguments)"), shipped_engine_config()
    )
    add_server_flags(p.add_argument_group("server"))
    add_openai_flags(p.add_argument_group("OpenAI-compatible API"))
    add_prompt_flags(p.add_argument_group("a prompt once ready"))


def shipped_engine_config() -> Optional[EngineConfig]:
    """The engine configuration of the shipped model (what flags left out mean), or None when
    it cannot be read (a broken install: help still works)."""
    try:
        settings = check_models(find_models(DEFAULT_MODEL_REPOSITORY))[DEFAULT_MODEL_NAME]
        return EngineConfig.from_dict(settings.engine)
    except (OSError, ValueError, KeyError, ImportError):
        return None


def add_server_flags(p) -> None:
    p.add_argument(
        "--model-repository",
        default=os.environ.get("SLIPSTREAM_MODEL_REPOSITORY", str(DEFAULT_MODEL_REPOSITORY)),
        help="Triton model repository to serve, rendered with the overrides applied "
        "(default: env SLIPSTREAM_MODEL_REPOSITORY, else model_repository/ of the project)",
    )
    p.add_argument(
        "--set",
        action="append",
        metavar="NAME=VALUE",
        default=[],
        help="set a config.pbtxt parameter of every model, repeatable: an engine argument by "
        "vLLM's name (enforce_eager=true) or Slipstream's own (enable_cuda_graphs=false), "
        "or a server setting (default_max_tokens=64)",
    )
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--http-port", type=int, help="Triton's HTTP port (8000; 0 = any free port)")
    p.add_argument("--grpc-port", type=int, help="Triton's gRPC port (8001; 0 = any free port)")
    p.add_argument("--metrics-port", type=int, help="Triton's metrics (8002; 0 = any free port)")
    p.add_argument(
        "--startup-timeout", type=float, default=600.0, help="seconds the model has to load"
    )
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
    add_parallel_args(p)
    p.add_argument(
        "--allow-model-control",
        action="store_true",
        help="open Triton's model-repository API (/v2/repository: load, unload, "
        "index) to every client that reaches the HTTP or gRPC port. Off by "
        "default: only the launcher, with a random key, may use it (loading a "
        "Python-backend model runs its code; an unload takes the model away)",
    )
    add_openai_args(p)


# --------------------------------------------------------------------------- OpenAI API flags
# vLLM's names for what its OpenAI server takes; they shape the API on --openai-port.
def add_openai_args(p: argparse.ArgumentParser) -> None:
    keys = os.environ.get("SLIPSTREAM_API_KEY") or os.environ.get("VLLM_API_KEY")
    p.add_argument(
        "--api-key",
        nargs="+",
        default=[keys] if keys else [],
        metavar="KEY",
        help="requests to /v1/... must send 'Authorization: Bearer KEY' (one of the keys); "
        "/health, /metrics, /tokenize stay open (env SLIPSTREAM_API_KEY or VLLM_API_KEY)",
    )
    p.add_argument(
        "--tool-call-parser",
        help="how the model writes tool calls: hermes, llama3_json, mistral, pythonic",
    )
    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": calls read from the output by --tool-call-parser',
    )
    p.add_argument(
        "--reasoning-parser",
        help="split the model's reasoning into reasoning_content: deepseek_r1, qwen3, glm45",
    )
    p.add_argument(
        "--pooler-config",
        type=json.loads,
        default=None,
        metavar="JSON",
        help='/v1/embeddings pooling: {"pooling_type": "LAST"|"MEAN"|"CLS", '
        '"normalize": true|false} (default last token, normalised)',
    )


def check_openai_args(args: argparse.Namespace, names: list[str]) -> None:
    """Refuse, before anything starts, OpenAI flags that cannot apply."""
    openai_settings(args)


def openai_settings(args: argparse.Namespace):
    """The OpenAI API's settings from the flags (a bad value fails at start)."""
    from slipstream.core.pooling_params import PoolingParams
    from slipstream.server.openai.api_settings import ApiSettings

    try:
        settings = ApiSettings(
            api_keys=tuple(args.api_key),
            tool_call_parser=args.tool_call_parser,
            enable_auto_tool_choice=args.enable_auto_tool_choice,
            reasoning_parser=args.reasoning_parser,
        )
        PoolingParams.from_dict(args.pooler_config or {})
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    return settings


def add_openai_flags(p) -> None:
    openai_port = os.environ.get("SLIPSTREAM_OPENAI_PORT")
    p.add_argument(
        "--port",
        "--openai-port",
        dest="openai_port",
        type=int,
        default=int(openai_port) if openai_port else None,
        help="serve the OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/models, /health, /metrics) on this port, through Triton; 0 = any free port "
        "(printed); off when not given (env SLIPSTREAM_OPENAI_PORT)",
    )


def add_prompt_flags(p) -> None:
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


def triton_ports(args: argparse.Namespace) -> dict[str, int]:
    """Triton's ports: as given, else 8000/8001/8002, except that one the OpenAI port takes
    (``--port 8000``, as vLLM users type it) becomes a free one."""
    ports = {}
    for name, default in TRITON_PORTS.items():
        given = getattr(args, name)
        if given is not None:
            if given and given == args.openai_port:
                raise SystemExit(f"--{name.replace('_', '-')} {given} is also the OpenAI port")
            ports[name] = given
        else:
            ports[name] = 0 if default == args.openai_port else default
    return ports


def serve_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config parameters this command line sets: the model, the engine flags, then --set
    (the last word: a --set after a flag wins)."""
    overrides = {}
    models = {m for m in (args.model_positional, args.model) if m}
    if len(models) > 1:
        raise SystemExit(f"two models given: {' and '.join(sorted(models))}")
    if models:
        overrides["model"] = models.pop()
    overrides.update(engine_overrides(args))
    overrides.update(parallel_overrides(args))
    overrides.update(parse_sets(args.set))
    return overrides


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "")
    return int(value) if value.strip() else default


def add_parallel_args(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism across machines, named as vLLM's serve names it (the size is an
    engine flag, ``--tensor-parallel-size``); LeaderWorkerSet's
    environment gives the defaults (``LWS_LEADER_ADDRESS``, ``LWS_GROUP_SIZE``,
    ``LWS_WORKER_INDEX``)."""
    p.add_argument(
        "--nnodes",
        type=int,
        default=_env_int("LWS_GROUP_SIZE", 1),
        help="machines the ranks span (env LWS_GROUP_SIZE)",
    )
    p.add_argument(
        "--node-rank",
        type=int,
        default=_env_int("LWS_WORKER_INDEX", 0),
        help="this machine's place: 0 serves (Triton), the others run their ranks headless "
        "(env LWS_WORKER_INDEX)",
    )
    p.add_argument(
        "--master-addr",
        default=os.environ.get("LWS_LEADER_ADDRESS") or "127.0.0.1",
        help="rank 0's address as the other machines reach it (env LWS_LEADER_ADDRESS)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        help=f"rank 0's rendezvous port (default: any free one on one machine, "
        f"{DEFAULT_MASTER_PORT} across machines)",
    )


DEFAULT_MASTER_PORT = 29500  # torch.distributed's


def parallel_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The engine settings the multi-machine flags set (those given, or implied by nnodes);
    ``--tensor-parallel-size`` is an engine flag of its own."""
    out: dict[str, str] = {}
    port = args.master_port
    if args.nnodes > 1:
        out.update(nnodes=str(args.nnodes), master_addr=args.master_addr)
        port = DEFAULT_MASTER_PORT if port is None else port
    if port is not None:
        out["master_port"] = str(port)
    return out


def run_headless(args: argparse.Namespace) -> int:
    """``serve --node-rank K`` (K > 0): this machine's ranks of rank 0's group, no Triton."""
    import logging
    import threading

    from slipstream.engine.executor.headless import HeadlessNode

    logging.basicConfig(level=logging.INFO, format="[slipstream headless] %(message)s")
    try:
        node = HeadlessNode(
            args.node_rank,
            args.nnodes,
            args.master_addr,
            args.master_port or DEFAULT_MASTER_PORT,
            parse_sets(args.set).get("cpu_threads_bind"),
        )
    except ValueError as e:
        raise SystemExit(f"invalid parallel setting: {e}")
    stop = threading.Event()
    old = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    print(
        f"machine {args.node_rank} of {args.nnodes}: serving ranks for rank 0 at "
        f"{args.master_addr}:{node.master_port} (no Triton here); Ctrl-C to stop",
        flush=True,
    )
    try:
        node.serve(stop)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    return 0


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


def serve_until_stopped(server: TritonServer, max_restarts: int) -> int:
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


def start_first(server: TritonServer) -> bool:
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
    served_names: list[str]  # --served-model-name: the model's names (the first is Triton's)


@dataclass
class _Session:
    server: TritonServer
    openai_api: Optional["OpenAIFrontend"] = None  # once started


def run_serve(args: argparse.Namespace) -> int:
    if args.node_rank > 0:
        return run_headless(args)
    extra_args = server_args(args.server_arg)
    report = StartupReport()
    report_phases_of_this_process(report)
    ports = triton_ports(args)
    plan = _plan_serve(args)
    check_openai_args(args, plan.names)
    session = _Session(
        TritonServer(
            plan.repo,
            host=args.host,
            http_port=ports["http_port"],
            grpc_port=ports["grpc_port"],
            metrics_port=ports["metrics_port"],
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
    session.server.on_wait = lambda: report.poll(session.server.log)
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
    overrides = serve_overrides(args)
    served_names = served_model_names(overrides.pop("served_model_name", None))
    work = Path(tempfile.mkdtemp(prefix="slipstream-serve-"))
    repo = render_model_repository(args.model_repository, work / "model_repository", overrides)
    aliases = ["vllm"] if args.vllm_alias else []
    if served_names:
        _rename_the_model(repo, aliases, served_names[0])
    engines = _validate(repo, aliases)
    names = list(engines)
    prompt_model = DEFAULT_MODEL_NAME if DEFAULT_MODEL_NAME in engines else names[0]
    if any(e.get("model", "default") in ("", "default") for e in engines.values()):
        # convert the GGUF once, here, with a progress bar (and its phase reported)
        from slipstream.worker.model.gguf import default_model_dir

        default_model_dir()
    if any(_runs_on_cpu(e) for e in engines.values()):
        # Compile the CPU kernels (once per machine) here, before Triton starts, as the model
        # is converted: the start-up timeout then covers only the model's load.
        from slipstream.worker import kernels

        kernels.load()
    return _ServePlan(work, repo, aliases, names, prompt_model, engines[prompt_model], served_names)


def report_phases_of_this_process(report: StartupReport) -> None:
    """Phases serve runs itself (converting the default model) are shown as the server's are."""
    logger = logging.getLogger("slipstream")
    for old in [h for h in logger.handlers if h.get_name() == PHASE_HANDLER]:
        logger.removeHandler(old)  # an earlier serve in this process (tests)
    handler = report.handler()
    handler.set_name(PHASE_HANDLER)
    logger.addHandler(handler)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.INFO)


def _runs_on_cpu(engine: dict) -> bool:
    from slipstream.worker.device import resolve_device

    return resolve_device(str(engine.get("device") or "auto")).type == "cpu"


def served_model_names(value: Optional[str]) -> list[str]:
    """``--served-model-name A B`` (a JSON list) or ``--set served_model_name=A``: the names."""
    if not value:
        return []
    names = json.loads(value) if value.lstrip().startswith("[") else [value]
    return [str(n) for n in names if str(n).strip()]


def _rename_the_model(repo: Path, aliases: list[str], name: str) -> None:
    """--served-model-name: Triton names a model by its directory, so the one Slipstream model
    of the rendered repository is renamed (clients, the OpenAI API's model list and the
    metrics' model label then say ``name``)."""
    models = find_models(repo, aliases)
    if len(models) != 1:
        raise SystemExit(
            f"--served-model-name names one model; {repo} holds {len(models)} Slipstream models"
        )
    try:
        rename_model(repo, models[0].name, name)
    except ValueError as e:
        raise SystemExit(f"--served-model-name: {e}")


def _serve(args: argparse.Namespace, plan: _ServePlan, session: _Session) -> int:
    """Start, announce, answer --prompt, then serve until stopped: the exit code."""
    server = session.server
    print(
        f"starting tritonserver (model {plan.engine.get('model', 'default')}; log "
        f"{server.log_path or 'on stdout'}) ...",
        flush=True,
    )
    t0 = time.monotonic()
    if not start_first(server):
        return serve_until_stopped(server, args.max_restarts)
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
        session.openai_api = _start_openai(args, plan, server)
    if args.prompt:
        _answer_prompt(args, server, plan.prompt_model)
        if args.exit_after_prompt:
            return 0
    print("serving; Ctrl-C to stop", flush=True)
    return serve_until_stopped(server, args.max_restarts)


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
    args: argparse.Namespace, plan: _ServePlan, server: TritonServer
) -> "OpenAIFrontend":
    """The OpenAI-compatible API on a thread of this process, talking to ``server`` over
    gRPC (it keeps its ports across restarts, so the API outlives them)."""
    from slipstream.server.openai.frontend import OpenAIFrontend

    api = OpenAIFrontend.for_repository(
        plan.repo,
        server.grpc_url,
        plan.aliases,
        plan.served_names,
        metrics_url=server.metrics_url,
        host=args.host,
        port=args.openai_port,
        settings=openai_settings(args),
        pooling=args.pooler_config,
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
    from slipstream.server.launch.triton_install import BACKEND_NAME, backend_model_py

    for name in [BACKEND_NAME, *args.alias]:
        target = Path(args.backend_directory) / name
        target.mkdir(parents=True, exist_ok=True)
        (target / "model.py").write_text(backend_model_py())
        print(f"installed {target / 'model.py'}")
    return 0


# --------------------------------------------------------------------------- build-kernels
def add_build_kernels_args(p: argparse.ArgumentParser) -> None:
    p.epilog = (
        "The kernels go to $SLIPSTREAM_CACHE/kernels/<key> (default ~/.cache/slipstream); the "
        "key covers the sources, torch, the compiler and this CPU's flags (-march=native), so "
        "a build made at docker build serves nodes with the same CPU, and a cache kept on a "
        "volume builds once per kind of CPU."
    )


def run_build_kernels(args: argparse.Namespace) -> int:
    """Build (or find) the CPU kernels, so that a server started later loads them at once."""
    from slipstream.worker.kernels import build

    report_phases_of_this_process(StartupReport())
    started = time.monotonic()
    if not build.load():
        print(f"CPU kernels unavailable: {build.unavailable_reason()}", file=sys.stderr)
        return 1
    cxx = build.compiler()
    assert cxx is not None  # load() found one
    print(f"CPU kernels ready in {build.build_dir(cxx)} ({time.monotonic() - started:.1f} s)")
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
    "build-kernels": (
        "compile the CPU kernels into the cache now (docker build), not at the first start",
        add_build_kernels_args,
        run_build_kernels,
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
    parser.add_argument("--version", action="version", version=f"slipstream {__version__}")
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
