"""What a request asks its output to conform to: vLLM's ``StructuredOutputsParams``.

Exactly one constraint per request (``json`` schema, ``regex``, ``choice``, ``grammar`` or
``json_object``), with vLLM's field names and its refusal of none or several. Only the shape
is checked here (pure Python); compiling it against the tokenizer, and refusing an invalid
schema, regex or grammar, is ``worker.structured_output``'s job.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass, fields
from typing import Any, Optional, Union

MAX_SPEC_CHARS = 1 << 20  # as large as a request's whole sampling_parameters JSON
MAX_CHOICES = 1024


class GuideKind(str, enum.Enum):
    JSON = "json"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"
    JSON_OBJECT = "json_object"


@dataclass(frozen=True)
class StructuredOutputsParams:
    json: Union[None, str, dict[str, Any]] = None  # a JSON schema (object or its text)
    regex: Optional[str] = None
    choice: Optional[tuple[str, ...]] = None  # the output is exactly one of these strings
    grammar: Optional[str] = None  # Lark or GBNF (llama.cpp) text
    json_object: Optional[bool] = None  # any JSON object
    disable_any_whitespace: bool = False  # JSON without free whitespace between tokens
    disable_additional_properties: bool = False  # objects without unlisted keys
    whitespace_pattern: Optional[str] = None  # accepted for vLLM parity; see docs
    structural_tag: Optional[str] = None  # refused: no structural tags

    def __post_init__(self) -> None:
        constraints = [k for k in GuideKind if getattr(self, k.value) is not None]
        if self.structural_tag is not None:
            raise ValueError("structured_outputs: 'structural_tag' is not supported")
        if len(constraints) > 1:  # vLLM's texts
            raise ValueError(
                "You can only use one kind of structured outputs constraint but "
                f"multiple are specified: {[k.value for k in constraints]}"
            )
        if not constraints:
            raise ValueError(
                "You must use one kind of structured outputs constraint but none are specified"
            )
        self._check_types()

    def _check_types(self) -> None:
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured_outputs: '{name}' must be a non-empty string")
        for name in ("disable_any_whitespace", "disable_additional_properties"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"structured_outputs: '{name}' must be a boolean")
        if self.json_object is not None and self.json_object is not True:
            raise ValueError("structured_outputs: 'json_object' must be true when given")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(
                "structured_outputs: 'json' must be a JSON schema (an object or its text)"
            )
        if self.choice is not None:
            ok = isinstance(self.choice, (list, tuple)) and 0 < len(self.choice) <= MAX_CHOICES
            if not ok or not all(isinstance(c, str) and c for c in self.choice):
                raise ValueError(
                    "structured_outputs: 'choice' must be a list of 1 to "
                    f"{MAX_CHOICES} non-empty strings"
                )
            object.__setattr__(self, "choice", tuple(self.choice))
        if len(self.spec_text) > MAX_SPEC_CHARS:
            raise ValueError(
                f"structured_outputs: the {self.kind.value} is longer than "
                f"{MAX_SPEC_CHARS} characters"
            )

    @property
    def kind(self) -> GuideKind:
        return next(k for k in GuideKind if getattr(self, k.value) is not None)

    @property
    def spec_text(self) -> str:
        """The constraint as text (a JSON schema serialized, choices as a JSON list)."""
        value = getattr(self, self.kind.value)
        if self.kind is GuideKind.JSON_OBJECT:
            return ""
        if isinstance(value, str):
            return value
        return json.dumps(list(value) if isinstance(value, tuple) else value)

    @property
    def cache_key(self) -> tuple[Any, ...]:
        """Equal for requests that compile to the same grammar (a schema sent as text or as
        an object alike; key order is kept: it is the order of the output's properties)."""
        text = self.spec_text
        if self.kind is GuideKind.JSON and isinstance(self.json, str):
            try:
                text = json.dumps(json.loads(text))
            except ValueError:
                pass  # refused when compiled
        return (
            self.kind.value,
            text,
            self.disable_any_whitespace,
            self.disable_additional_properties,
            self.whitespace_pattern,
        )

    @classmethod
    def from_value(cls, value: Any) -> "StructuredOutputsParams":
        """From an instance, a dict with vLLM's field names, or that dict's JSON text."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError(
                "structured_outputs must be an object with one of json, regex, "
                "choice, grammar, json_object"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(k for k in value if k not in known and k not in _IGNORED)
        if unknown:
            raise ValueError(f"structured_outputs: unknown field(s) {unknown}")
        return cls(**{k: v for k, v in value.items() if k in known})


# vLLM fields that choose how, not what: the backend is always the one built in.
_IGNORED = {"backend", "disable_fallback", "_backend", "_backend_was_auto"}
