"""Building a dataclass from loosely typed values by field name (engine settings given as
text, sampling parameters given as JSON): the one loop, each caller bringing its own coercion
and its own words for a name that is no field."""

from __future__ import annotations

from dataclasses import Field, fields
from typing import Any, Callable, Mapping, TypeVar

T = TypeVar("T")


def from_values(
    cls: Callable[..., T],
    values: Mapping[str, Any],
    coerce: Callable[[Field[Any], Any], Any],
    unknown: Callable[[str], str],
) -> T:
    """``cls(**values)`` with each value passed through ``coerce(its field, value)``; a key
    that names no field raises ``ValueError(unknown(key))``."""
    known = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    kwargs: dict[str, Any] = {}
    for key, raw in values.items():
        if key not in known:
            raise ValueError(unknown(key))
        kwargs[key] = coerce(known[key], raw)
    return cls(**kwargs)
