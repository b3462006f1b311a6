"""Lines per room, imports between rooms, the longest functions and the highest cyclomatic
complexities of ``backend/slipstream`` (the figures redesign steps are judged by).

    python scripts/code_metrics.py [--root backend/slipstream] [--top 10] [--json OUT]

A room is a folder under the package (a file at the top level is its own room). Complexity
is McCabe's: 1 + one per branch point (if/elif, loops, except, boolean operators, conditional
expressions, comprehension filters, match cases, assert).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

_BRANCHES = (
    ast.If,
    ast.For,
    ast.AsyncFor,
    ast.While,
    ast.ExceptHandler,
    ast.IfExp,
    ast.Assert,
    ast.match_case,
)


@dataclass(frozen=True)
class FunctionFigure:
    name: str
    lines: int
    complexity: int


def room_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).parts
    return "/".join(parts[:-1]) if len(parts) > 1 else parts[0].removesuffix(".py")


def complexity(fn: ast.AST) -> int:
    score = 1
    for node in ast.walk(fn):
        if isinstance(node, _BRANCHES):
            score += 1
        elif isinstance(node, ast.BoolOp):
            score += len(node.values) - 1
        elif isinstance(node, ast.comprehension):
            score += len(node.ifs)
    return score


def functions(tree: ast.AST, where: str) -> list[FunctionFigure]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            lines = (node.end_lineno or node.lineno) - node.lineno + 1
            out.append(FunctionFigure(f"{where}:{node.name}", lines, complexity(node)))
    return out


def imported_rooms(tree: ast.AST, package: str, root: Path) -> set[str]:
    rooms = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        for name in names:
            if name == package or name.startswith(package + "."):
                target = root.joinpath(*name.split(".")[1:])
                if target.with_suffix(".py").exists():
                    rooms.add(room_of(target.with_suffix(".py"), root))
                elif target.is_dir():
                    rooms.add(room_of(target / "__init__.py", root))
    return rooms


def measure(root: Path) -> dict:
    lines: Counter[str] = Counter()
    files: Counter[str] = Counter()
    arrows: Counter[tuple[str, str]] = Counter()
    figures: list[FunctionFigure] = []
    for path in sorted(root.rglob("*.py")):
        room = room_of(path, root)
        text = path.read_text()
        tree = ast.parse(text)
        lines[room] += len(text.splitlines())
        files[room] += 1
        figures += functions(tree, str(path.relative_to(root)))
        for target in imported_rooms(tree, root.name, root) - {room}:
            arrows[(room, target)] += 1
    return {
        "lines": dict(lines),
        "files": dict(files),
        "arrows": {f"{a} -> {b}": n for (a, b), n in sorted(arrows.items())},
        "functions": [asdict(f) for f in figures],
    }


def report(figures: dict, top: int) -> str:
    out = ["| room | files | lines |", "| --- | ---: | ---: |"]
    for room in sorted(figures["lines"]):
        out.append(f"| {room} | {figures['files'][room]} | {figures['lines'][room]} |")
    out.append(f"\nimports between rooms (file -> room pairs): {sum(figures['arrows'].values())}")
    out += [f"  {arrow}: {n}" for arrow, n in figures["arrows"].items()]
    fns = figures["functions"]
    for key in ("lines", "complexity"):
        out.append(f"\nhighest {key}:")
        out += [f"  {f[key]:4d}  {f['name']}" for f in sorted(fns, key=lambda f: -f[key])[:top]]
    over = sum(1 for f in fns if f["complexity"] > 15)
    out.append(f"\nfunctions: {len(fns)}, complexity > 15: {over}")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--root", default="backend/slipstream")
    p.add_argument("--top", type=int, default=10)
    p.add_argument("--json", help="write the figures here as JSON")
    args = p.parse_args(argv)
    figures = measure(Path(args.root))
    print(report(figures, args.top))
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
