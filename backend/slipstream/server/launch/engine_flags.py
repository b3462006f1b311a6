"""``slipstream serve``'s engine flags, generated from the one table of vLLM's engine arguments
(``server.stub.engine_args.ENGINE_ARGUMENTS``): ``--max-num-seqs``, ``--enforce-eager``,
``--tensor-parallel-size`` ... Each flag given becomes a config parameter override under
vLLM's name, exactly as ``--set max_num_seqs=8`` would, so a flag, ``--set``, config.pbtxt
and ``model.json`` share one vocabulary and one validation: a value the engine cannot honour
is refused, before Triton starts, with the engine's own message."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any, Optional

from slipstream.core.config import EngineConfig
from slipstream.server.stub.engine_args import ENGINE_ARGUMENTS, ArgType, Effect, EngineArgument

# Flags serve handles itself: the model is positional (and --model), the served name renames
# the model's directory in the rendered repository; the multi-machine flags default to
# LeaderWorkerSet's environment and start headless ranks (cli.add_parallel_args).
OWN_HANDLING = {"model", "nnodes", "node_rank", "master_addr", "master_port"}
FLAG_EFFECTS = (Effect.SETS, Effect.ONLY_AT, Effect.SERVER)
FLAG_TYPES = {ArgType.INT: int, ArgType.FLOAT: float}
METAVARS = {ArgType.INT: "N", ArgType.FLOAT: "X", ArgType.JSON: "JSON"}


def flag_arguments() -> list[EngineArgument]:
    """The engine arguments ``serve`` takes as flags."""
    return [
        a
        for a in ENGINE_ARGUMENTS
        if a.name not in OWN_HANDLING
        and (a.effect in FLAG_EFFECTS or a.name == "served_model_name")
    ]


def shown(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def add_engine_flags(group: Any, defaults: Optional[EngineConfig]) -> None:
    """One flag per engine argument; ``defaults`` (the shipped model's configuration) gives the
    default each help shows. Every flag defaults to None: not given, not overridden."""
    for argument in flag_arguments():
        default = argument.default_in(defaults) if defaults is not None else None
        help_text = argument.help
        if argument.effect is Effect.ONLY_AT:
            help_text = f"only {shown(argument.only)}: {help_text}"
        elif default is not None:
            help_text += f" (default: {shown(default)})"
        kwargs: dict[str, Any] = {"dest": argument.name, "default": None, "help": help_text}
        if argument.type is ArgType.BOOL:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif argument.name == "served_model_name":  # vLLM's: several names, the first reported
            kwargs.update(nargs="+", metavar="NAME")
        elif argument.type is ArgType.ADAPTERS:
            kwargs.update(nargs="+", metavar="NAME=PATH")
        else:
            kwargs["type"] = FLAG_TYPES.get(argument.type, str)
            if argument.choices:
                kwargs["choices"] = argument.choices
            else:
                kwargs["metavar"] = METAVARS.get(argument.type, argument.name.upper())
        group.add_argument(argument.flag, **kwargs)


def engine_overrides(args: argparse.Namespace) -> dict[str, str]:
    """The config parameters the engine flags given on the command line set (vLLM's names)."""
    out: dict[str, str] = {}
    for argument in flag_arguments():
        value = getattr(args, argument.name, None)
        if value is None:
            continue
        if argument.type is ArgType.ADAPTERS:
            out[argument.name] = json.dumps(adapters(value))
            if getattr(args, "enable_lora", None) is None:  # serving adapters needs LoRA on
                out["enable_lora"] = "true"
        elif isinstance(value, list):  # --served-model-name A B
            out[argument.name] = value[0] if len(value) == 1 else json.dumps(value)
        else:
            out[argument.name] = shown(value)
    return out


def adapters(pairs: list[str]) -> dict[str, str]:
    """``name=path`` pairs (vLLM's --lora-modules) -> name -> absolute directory."""
    found = {}
    for pair in pairs:
        name, sep, path = pair.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"--lora-modules expects name=path, got {pair!r}")
        found[name] = str(Path(path).expanduser().resolve())
    return found
