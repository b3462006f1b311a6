"""Extract the Prometheus queries of a Grafana dashboard JSON (every panel target's ``expr``
and every templating query), for tests/server/e2e/data/vllm_grafana_queries.json:

    python scripts/grafana_queries.py grafana.json --source URL \
        > tests/server/e2e/data/vllm_grafana_queries.json

The test (tests/server/e2e/test_openai_api.py, metrics contract) checks that each series these
queries select exists in Slipstream's metrics with the labels they filter on.
"""

from __future__ import annotations

import argparse
import json
import sys


def queries(dashboard: dict) -> tuple[list[str], list[str]]:
    """(panel expressions, templating queries), in dashboard order, without repeats."""
    exprs: list[str] = []

    def walk(panels: list) -> None:
        for panel in panels:
            for target in panel.get("targets", []):
                expr = target.get("expr")
                if expr and expr not in exprs:
                    exprs.append(expr)
            walk(panel.get("panels", []))  # rows hold panels

    walk(dashboard.get("panels", []))
    templating = []
    for var in dashboard.get("templating", {}).get("list", []):
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query
        if var.get("type") == "query" and query:
            templating.append(query)
    return exprs, templating


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dashboard")
    p.add_argument("--source", default="", help="where the dashboard came from")
    args = p.parse_args(argv)
    with open(args.dashboard) as f:
        exprs, templating = queries(json.load(f))
    json.dump(
        {"source": args.source, "expressions": exprs, "templating": templating},
        sys.stdout,
        indent=2,
    )
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
