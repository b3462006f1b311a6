"""Engine arguments read: a ``1/model.json`` (vLLM's names only, as Triton's vLLM backend
feeds it to vLLM, where an unknown key fails the load) or a model's config parameters (vLLM's
names and Slipstream's own) turned into ``EngineArgs`` through the one table
(``engine_args.ENGINE_ARGUMENTS``); and where a ``model`` / ``tokenizer`` value points."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Optional

from slipstream.core.boolean_text import JSON_FLAG, Spelling
from slipstream.server.stub.engine_arg_values import parse_flag
from slipstream.server.stub.engine_args import BY_NAME, Effect, conflicts

MODEL_JSON = "model.json"
log = logging.getLogger("slipstream")


@dataclass
class EngineArgs:
    """What one set of engine arguments (a model.json, config parameters) asks of Slipstream."""

    engine: dict = field(default_factory=dict)  # EngineConfig settings (name -> value)
    disable_log_stats: Optional[bool] = None
    max_logprobs: Optional[int] = None
    kv_events_config: Any = None  # vLLM's KVEventsConfig fields (a JSON object or its text)


def translate(
    args: Mapping[str, Any],
    *,
    spelling: Spelling = JSON_FLAG,
    own_names: bool = False,
    where: str = "model.json",
) -> EngineArgs:
    """Engine arguments -> ``EngineArgs``; ``ValueError`` names every one it refuses.

    ``own_names``: config parameters, where Slipstream's own setting names are valid too (they
    pass through, for ``EngineConfig`` to check) and an empty value means "unset"; model.json
    takes vLLM's names only."""
    result = EngineArgs()
    problems = []
    given = {k: v for k, v in args.items() if v is not None and not (own_names and v == "")}
    for key, value in args.items():
        try:
            _apply(result, key, value, spelling, own_names, key in given)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    problems += conflicts(given)
    if problems:
        raise ValueError(f"{where}: " + "; ".join(problems))
    return result


def _apply(
    result: EngineArgs, key: str, value: Any, spelling: Spelling, own_names: bool, given: bool
) -> None:
    argument = BY_NAME.get(key)
    if argument is None:
        if not own_names:
            supported = ", ".join(sorted(BY_NAME))
            raise ValueError(
                f"unknown or unsupported engine argument {key!r} (supported: {supported})"
            )
        result.engine[key] = value  # Slipstream's own setting: EngineConfig checks it
        return
    if argument.effect is Effect.SETS and argument.convert is None:
        if value is not None:  # "" too: an empty parameter is an unset setting
            result.engine[argument.settings[0]] = value
        return
    if not given:
        return
    if argument.effect is Effect.SETS:
        assert argument.convert is not None
        result.engine.update(argument.convert(value, spelling))
    elif argument.effect is Effect.ONLY_AT:
        if not _equal(value, argument.only):
            raise ValueError(
                f"{key}={value!r} is not supported ({argument.help}), only "
                f"{json.dumps(argument.only)} is"
            )
    elif argument.effect is Effect.SERVER:
        _server_option(result, key, value, spelling)
    elif argument.effect is Effect.REMOVED:
        log.warning(
            "engine argument %s=%r is accepted and has no effect: %s", key, value, argument.help
        )


def _server_option(result: EngineArgs, key: str, value: Any, spelling: Spelling) -> None:
    if key == "disable_log_stats":
        result.disable_log_stats = parse_flag(value, key, spelling)
    elif key == "max_logprobs":
        result.max_logprobs = int(value)
    elif key == "kv_events_config":
        result.kv_events_config = value


def read_model_json(version_dir: Path) -> Optional[dict]:
    """The engine arguments of ``<version_dir>/model.json``, or None if there is none."""
    path = Path(version_dir) / MODEL_JSON
    if not path.is_file():
        return None
    try:
        args = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{path}: must hold a JSON object of vLLM engine arguments")
    return args


def _equal(value: Any, fixed: Any) -> bool:
    if fixed is None:
        return value in (None, "", "none", "None")
    if isinstance(fixed, bool):
        return str(value).strip().lower() == str(fixed).lower()
    if isinstance(fixed, int):
        try:
            return int(value) == fixed
        except (TypeError, ValueError):
            return False
    return str(value) == str(fixed)


def resolve_model(name: str, search_dirs: list) -> str:
    """Where a ``model`` / ``tokenizer`` value points: ``default``; an absolute directory; a
    directory relative to one of ``search_dirs`` (the model's directory, its version
    directory, the working directory, which is what vLLM resolves against); or a Hugging Face
    id already in the local cache. Nothing is downloaded: anything else is a load error
    naming what was tried."""
    if name in ("", "default"):
        return name
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [Path(d) / path for d in search_dirs]
    for candidate in candidates:
        if candidate.is_dir():
            return str(candidate.resolve())
    cached = _hub_cache(name)
    if cached is not None:
        return cached
    tried = ", ".join(str(c) for c in candidates)
    raise ValueError(
        f"model {name!r} not found: not a directory ({tried}) nor a Hugging Face "
        "model in the local cache; this backend does not download models"
    )


def _hub_cache(repo_id: str) -> Optional[str]:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, not a valid id, or no huggingface_hub
        return None
