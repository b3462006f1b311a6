"""A Triton model's ``config.pbtxt``, read and rewritten as Triton reads it: protobuf's text
format with Triton's own ``ModelConfig`` message (``model_config_pb2``, shipped with
tritonclient).

So a commented-out parameter is a comment, both spellings of the parameter map
(``parameters { key: ... }`` repeated, or the list ``parameters [ {...}, {...} ]``) are the
same map, and a setting given again replaces its entry instead of adding a second one. A file
Triton would refuse (a misspelled field) is refused here with protobuf's message and line.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from google.protobuf import text_format

# tritonclient.grpc's package imports grpcio; the message module alone needs only protobuf.
from tritonclient.grpc import model_config_pb2

ModelConfig = Any  # model_config_pb2.ModelConfig (generated code: no static type)


class ConfigTextError(ValueError):
    """A config.pbtxt that is not a valid ``ModelConfig`` in protobuf's text format."""


def parse(config_pbtxt: str, where: str = "config.pbtxt") -> ModelConfig:
    config = model_config_pb2.ModelConfig()
    try:
        text_format.Parse(config_pbtxt, config)
    except text_format.ParseError as e:
        raise ConfigTextError(f"{where}: {e}") from None
    return config


def read_parameters(config_pbtxt: str) -> dict[str, str]:
    """The ``parameters`` of a config.pbtxt as a dict of strings."""
    return {key: value.string_value for key, value in parse(config_pbtxt).parameters.items()}


def format_value(value: object) -> str:
    """A parameter value as config.pbtxt holds it: a string (booleans lower case)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def set_parameters(
    config_pbtxt: str,
    overrides: Mapping[str, object],
    header: str = "",
    remove: Iterable[str] = (),
) -> str:
    """The config with ``parameters`` entries replaced or added (and those named in ``remove``
    taken out), written back in protobuf's text format (comments do not survive the rewrite:
    ``header`` is written as one, on top)."""
    config = parse(config_pbtxt)
    for key in remove:
        config.parameters.pop(key, None)
    for key, value in overrides.items():
        config.parameters[key].string_value = format_value(value)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + text_format.MessageToString(config)


def set_name(config_pbtxt: str, name: str) -> str:
    """The config with its model ``name`` replaced (Triton checks it against the directory)."""
    config = parse(config_pbtxt)
    config.name = name
    return text_format.MessageToString(config)
