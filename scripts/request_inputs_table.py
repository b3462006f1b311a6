"""docs/requests.md's table of request inputs, regenerated from the one table of inputs
(``backend/slipstream/server/stub/input_table.py``).

    python scripts/request_inputs_table.py          # rewrite docs/requests.md's table
    python scripts/request_inputs_table.py --check  # exit 1 when docs/requests.md is stale

``tests/server/unit/test_input_table.py`` runs the check.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

from slipstream.server.stub.input_table import markdown_table  # noqa: E402

DOC = REPO / "docs" / "requests.md"
# The marker lines around the table; what lies between them is generated.
_SPAN = re.compile(r"(<!-- request-inputs:[^\n]*-->\n)(.*?)(<!-- /request-inputs -->)", re.S)


def render(readme: str) -> str:
    """``readme`` with its inputs table replaced by the generated one."""
    if not _SPAN.search(readme):
        raise SystemExit(f"{DOC}: no request-inputs markers")
    return _SPAN.sub(lambda m: m.group(1) + markdown_table() + m.group(3), readme, count=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say whether it is current")
    args = parser.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print("docs/requests.md's inputs table is stale: run scripts/request_inputs_table.py")
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
