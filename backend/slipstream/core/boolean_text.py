"""The one parser of booleans written as text ("true", "1", "yes" ...): settings, request
values, config parameters, command-line options.

Callers differ only in which words they accept, and that is data (a ``Spelling``): a request
value or an engine setting takes the common words, while a config.pbtxt switch takes exactly
"true" or "false" (what Triton's own backends accept, and so what their configs hold).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional


@dataclass(frozen=True)
class Spelling:
    true: frozenset[str]
    false: frozenset[str]

    def words(self) -> str:
        """The accepted words, for an error message."""
        return " or ".join(f'"{w}"' for w in sorted(self.true | self.false))


# Engine settings, command-line and environment switches.
SETTING = Spelling(frozenset({"true", "1", "yes", "on"}), frozenset({"false", "0", "no", "off"}))
# Request values (sampling_parameters JSON, request parameters): vLLM clients' spellings.
REQUEST = Spelling(frozenset({"true", "1", "yes"}), frozenset({"false", "0", "no"}))
# model.json values: JSON booleans (read as text) or 0/1.
JSON_FLAG = Spelling(frozenset({"true", "1"}), frozenset({"false", "0"}))
# config.pbtxt switches of the backend (REPORT_CUSTOM_METRICS ...).
EXACT = Spelling(frozenset({"true"}), frozenset({"false"}))


def parse_bool(text: str, spelling: Spelling = SETTING) -> Optional[bool]:
    """True or False for one of ``spelling``'s words (case and surrounding blanks aside),
    None for anything else: the caller says what is wrong, in its own terms."""
    word = text.strip().lower()
    if word in spelling.true:
        return True
    if word in spelling.false:
        return False
    return None
