"""A pooling (embedding) request's settings, vLLM's: which of the prompt's last-layer hidden
states make its vector, and whether it is scaled to unit length.

Decoder models (the ones this engine serves) pool the last token by default, as vLLM does
for them; ``MEAN`` averages every prompt token, ``CLS`` takes the first. ``dimensions``
(Matryoshka truncation) is refused: no model here is trained for it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping


class PoolingType(str, enum.Enum):
    LAST = "LAST"
    MEAN = "MEAN"
    CLS = "CLS"


@dataclass(frozen=True)
class PoolingParams:
    pooling_type: PoolingType = PoolingType.LAST
    normalize: bool = True

    @classmethod
    def from_dict(cls, values: Mapping[str, Any], model: str = "this model") -> "PoolingParams":
        """From vLLM's names; an unknown key, a bad value or ``dimensions`` is a
        ``ValueError`` for the client."""
        unknown = set(values) - {"pooling_type", "normalize", "dimensions", "task"}
        if unknown:
            raise ValueError(f"unknown pooling parameters: {sorted(unknown)}")
        if values.get("task") not in (None, "embed"):
            raise ValueError(f"pooling task {values['task']!r} is not supported (only 'embed')")
        if values.get("dimensions") not in (None, []):
            raise ValueError(
                f'Model "{model}" does not support matryoshka representation, changing output '
                "dimensions will lead to poor results."
            )
        kind = values.get("pooling_type", PoolingType.LAST.value)
        try:
            pooling_type = PoolingType(str(kind).upper())
        except ValueError:
            raise ValueError(
                f"pooling_type must be one of {[t.value for t in PoolingType]}, got {kind!r}"
            ) from None
        normalize = values.get("normalize", True)
        if not isinstance(normalize, bool):
            raise ValueError(f"normalize must be a boolean, got {normalize!r}")
        return cls(pooling_type, normalize)
