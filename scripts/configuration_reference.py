#!/usr/bin/env python3
"""Write docs/configuration.md from the code: `slipstream serve`'s options (its parser), the
config parameters (EngineConfig's fields with the shipped config's values, the server
settings) and every vLLM engine argument with what Slipstream does with it (the table in
server/stub/engine_args.py against vLLM's own list, scripts/data/vllm_engine_arguments.json).

    python scripts/configuration_reference.py            # rewrite docs/configuration.md
    python scripts/configuration_reference.py --check    # exit 1 if it is stale (a test runs this)
    python scripts/configuration_reference.py --vllm-python /path/to/vllm/venv/bin/python
                                                         # refresh vLLM's list from an install
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import MISSING, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "backend"), str(ROOT / "benchmarks")]

from slipstream.core.config import EngineConfig  # noqa: E402
from slipstream.server.launch.cli import add_serve_args  # noqa: E402
from slipstream.server.launch.config_pbtxt import read_parameters  # noqa: E402
from slipstream.server.launch.repository import DEFAULT_MODEL_REPOSITORY  # noqa: E402
from slipstream.server.stub.engine_args import ENGINE_ARGUMENTS, Effect  # noqa: E402
from slipstream.server.stub.model_config import SERVER_PARAMETERS  # noqa: E402
from slipstream.server.stub.settings_help import ENGINE_SETTINGS, SERVER_SETTINGS  # noqa: E402

OUT = ROOT / "docs" / "configuration.md"
VLLM_ARGS = ROOT / "scripts" / "data" / "vllm_engine_arguments.json"
SHIPPED = DEFAULT_MODEL_REPOSITORY / "slipstream" / "config.pbtxt"
DEFAULT_RE = re.compile(r"\s*\(default: (.*)\)$", re.S)
DUMP_VLLM = """
import json, vllm
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser
p = FlexibleArgumentParser()
AsyncEngineArgs.add_cli_args(p)
group = {a.dest: g.title for g in p._action_groups for a in g._group_actions}
def flag(a):
    return max((s for s in a.option_strings if not s.startswith("--no-")), key=len)
rows = [{"name": a.dest, "flag": flag(a), "group": group.get(a.dest)}
        for a in p._actions if a.option_strings and a.dest != "help"]
print(json.dumps({"vllm_version": vllm.__version__, "arguments": rows}))
"""


def cell(text: object) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def serve_options() -> list[str]:
    parser = argparse.ArgumentParser(prog="slipstream serve")
    saved = {k: os.environ.pop(k) for k in list(os.environ) if k.startswith("SLIPSTREAM_")}
    try:
        add_serve_args(parser)
    finally:
        os.environ.update(saved)
    out = ["## `slipstream serve`", "", "`slipstream serve [MODEL] [options]`, options by group:"]
    for group in parser._action_groups:
        actions = [a for a in group._group_actions if a.dest != "help"]
        if not actions:
            continue
        out += [
            "",
            f"### {group.title}",
            "",
            "| option | default | meaning |",
            "| --- | --- | --- |",
        ]
        for action in actions:
            names = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.metavar}`"
            help_text = action.help or ""
            found = DEFAULT_RE.search(help_text)
            default = found.group(1) if found else action.default
            help_text = DEFAULT_RE.sub("", help_text)
            shown = "" if default in (None, False, [], argparse.SUPPRESS) else f"`{default}`"
            out.append(f"| {names} | {cell(shown)} | {cell(help_text)} |")
    out += ["", "```", parser.epilog.rstrip(), "```"]
    return out


def engine_parameters() -> list[str]:
    shipped = read_parameters(SHIPPED.read_text())
    by_setting: dict[str, list] = {}
    for argument in ENGINE_ARGUMENTS:
        for setting in argument.settings:
            by_setting.setdefault(setting, []).append(argument)
    out = [
        "### Engine settings",
        "",
        "Each `EngineConfig` field (`backend/slipstream/core/config.py`), with the vLLM engine "
        "argument that sets it where there is one (either name works; two names for one "
        "setting in one config are refused). *shipped*: the value in "
        "`model_repository/slipstream/config.pbtxt`; *engine*: the default when a config "
        "leaves it out (empty: unset).",
        "",
        "| parameter | vLLM argument | shipped | engine | meaning |",
        "| --- | --- | --- | --- | --- |",
    ]
    for f in fields(EngineConfig):
        default = f.default if f.default is not MISSING else f.default_factory()  # type: ignore[misc]
        arguments = by_setting.get(f.name, [])
        same = [a for a in arguments if a.name == f.name]
        meaning = ENGINE_SETTINGS.get(f.name) or (same[0].help if same else "")
        if not meaning:
            raise SystemExit(f"setting {f.name} has no description (settings_help.py)")
        vllm = ", ".join(f"`{a.name}`" for a in arguments)
        ship = f"`{shipped[f.name]}`" if shipped.get(f.name) else ""
        engine = "" if default is None or default == {} else f"`{default}`"
        out.append(f"| `{f.name}` | {vllm} | {cell(ship)} | {cell(engine)} | {cell(meaning)} |")
    return out


def server_parameters() -> list[str]:
    out = [
        "### Server settings",
        "",
        "Settings of the Triton model around the engine (`model_config.SERVER_PARAMETERS`).",
        "",
        "| parameter | default | meaning |",
        "| --- | --- | --- |",
    ]
    for name, default in SERVER_PARAMETERS.items():
        if name not in SERVER_SETTINGS:
            raise SystemExit(f"server setting {name} has no description (settings_help.py)")
        shown = f"`{default}`" if default else ""
        out.append(f"| `{name}` | {shown} | {cell(SERVER_SETTINGS[name])} |")
    return out


def what_slipstream_does(name: str) -> str:
    by_name = {a.name: a for a in ENGINE_ARGUMENTS}
    argument = by_name.get(name)
    if argument is None:
        return "refused: not supported (a `model.json` or `--set` naming it fails the load)"
    if argument.effect is Effect.SETS:
        settings = ", ".join(f"`{s}`" for s in argument.settings)
        return f"sets {settings}: {argument.help}"
    if argument.effect is Effect.ONLY_AT:
        return f"accepted only at `{json.dumps(argument.only)}`: {argument.help}"
    if argument.effect is Effect.SERVER:
        return f"server option: {argument.help}"
    if argument.effect is Effect.NO_EFFECT:
        return f"accepted, no effect: {argument.help}"
    return f"accepted with a warning, no effect: {argument.help}"


def vllm_arguments() -> list[str]:
    data = json.loads(VLLM_ARGS.read_text())
    flags = {a.name for a in ENGINE_ARGUMENTS if a.effect in (Effect.SETS, Effect.ONLY_AT)}
    flags |= {a.name for a in ENGINE_ARGUMENTS if a.effect is Effect.SERVER}
    flags |= {"served_model_name", "model"}
    known = {row["name"] for row in data["arguments"]}
    supported = sum(
        1 for row in data["arguments"] if row["name"] in {a.name for a in ENGINE_ARGUMENTS}
    )
    out = [
        "## vLLM's engine arguments",
        "",
        f"Every engine argument of vLLM {data['vllm_version']} (`vllm serve --help`, "
        "`AsyncEngineArgs`), what Slipstream does with it in `1/model.json`, a config "
        "parameter or `--set`, and whether `slipstream serve` takes it as a flag. "
        f"{supported} of {len(known)} are understood; the rest are refused by name, as vLLM "
        "refuses an argument it does not know, rather than ignored.",
    ]
    groups: dict[str, list] = {}
    for row in data["arguments"]:
        groups.setdefault(row["group"] or "other", []).append(row)
    for group, rows in groups.items():
        out += [
            "",
            f"### {group}",
            "",
            "| vLLM argument | serve flag | Slipstream |",
            "| --- | --- | --- |",
        ]
        for row in rows:
            flag = "yes" if row["name"] in flags else ""
            out.append(f"| `{row['flag']}` | {flag} | {cell(what_slipstream_does(row['name']))} |")
    extra = [a for a in ENGINE_ARGUMENTS if a.name not in known]
    if extra:
        out += [
            "",
            "### Accepted beyond that list",
            "",
            "Names vLLM had or has elsewhere (its OpenAI server, older releases) that model.json "
            "files still carry.",
            "",
            "| argument | Slipstream |",
            "| --- | --- |",
        ]
        out += [f"| `{a.name}` | {cell(what_slipstream_does(a.name))} |" for a in extra]
    return out


# The environment the package reads (a test checks each is read somewhere in the code).
ENVIRONMENT = {
    "SLIPSTREAM_CACHE": "where the converted default model, the compiled CPU kernels and the "
    "assembled Triton backend directory go (default `$XDG_CACHE_HOME/slipstream`, else "
    "`~/.cache/slipstream`). Keep it on a volume and a new pod neither converts nor compiles "
    "again (the kernels are keyed by the CPU's flags: each kind of CPU compiles once)",
    "SLIPSTREAM_CPU_KERNELS": "`0` turns the compiled CPU kernels off (the torch path runs)",
    "SLIPSTREAM_TRITONSERVER": "the `tritonserver` binary to run (default: `PATH`, then the "
    "`nvidia-pytriton` wheel's)",
    "SLIPSTREAM_MODEL_REPOSITORY": "`slipstream serve --model-repository`'s default",
    "SLIPSTREAM_OPENAI_PORT": "`slipstream serve --port`'s default (the OpenAI API)",
}


def environment() -> list[str]:
    out = ["## Environment", "", "| variable | meaning |", "| --- | --- |"]
    return out + [f"| `{name}` | {cell(text)} |" for name, text in ENVIRONMENT.items()]


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        "Generated from the code by `scripts/configuration_reference.py` (a test fails when it "
        "is stale): `slipstream serve`'s options, the config parameters of a model "
        "(`config.pbtxt` `parameters`, `slipstream serve --set NAME=VALUE`) and every vLLM "
        "engine argument with what Slipstream does with it. A `1/model.json` beside a model's "
        "config takes vLLM's names; config parameters take the same names and Slipstream's own, "
        "and win over model.json.",
        "",
        "- [`slipstream serve`](#slipstream-serve)",
        "- [Config parameters](#config-parameters)",
        "- [vLLM's engine arguments](#vllms-engine-arguments)",
        "- [Environment](#environment)",
        "",
    ]
    lines += serve_options()
    lines += ["", "## Config parameters", ""]
    lines += engine_parameters() + [""] + server_parameters() + [""] + vllm_arguments()
    lines += [""] + environment()
    return "\n".join(lines) + "\n"


def refresh_vllm_list(python: str) -> None:
    dumped = json.loads(
        subprocess.run([python, "-c", DUMP_VLLM], check=True, capture_output=True, text=True)
        .stdout.strip()
        .splitlines()[-1]
    )
    dumped["source"] = json.loads(VLLM_ARGS.read_text())["source"]
    VLLM_ARGS.write_text(json.dumps(dumped, indent=1) + "\n")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the file is stale")
    p.add_argument("--vllm-python", help="refresh vLLM's argument list from this interpreter")
    args = p.parse_args()
    if args.vllm_python:
        refresh_vllm_list(args.vllm_python)
    text = render()
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} is stale: run python scripts/configuration_reference.py")
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
