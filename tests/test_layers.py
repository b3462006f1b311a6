"""The tree's layers hold: core/ and the worker never reach up into the server or the benchmark."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "backend" / "slipstream"
FORBIDDEN_FOR_LOWER_LAYERS = (
    "slipstream.server",
    "slipstream_bench",
    "triton_python_backend_utils",
    "tritonclient",
)


def _imported_modules(path: Path) -> set:
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            raise AssertionError(f"{path}: relative import; the layer test reads absolute ones")
    return names


def _violations(folder: str, forbidden: tuple) -> list:
    found = []
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        for name in _imported_modules(path):
            if name.startswith(forbidden):
                found.append(f"{path.relative_to(PACKAGE)} imports {name}")
    return found


def test_core_imports_neither_worker_nor_server_nor_benchmark_nor_torch():
    assert _violations("core", FORBIDDEN_FOR_LOWER_LAYERS + ("slipstream.worker", "torch")) == []


def test_worker_imports_neither_server_nor_benchmark():
    assert _violations("worker", FORBIDDEN_FOR_LOWER_LAYERS) == []


def test_engine_modules_at_package_top_import_no_server_or_benchmark():
    top = [p for p in PACKAGE.glob("*.py")]
    found = [
        f"{p.name} imports {n}"
        for p in top
        for n in _imported_modules(p)
        if n.startswith(FORBIDDEN_FOR_LOWER_LAYERS)
    ]
    assert found == []


def test_layer_checker_sees_a_forbidden_import(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("from slipstream.server.stub.request_parser import parse_request\n")
    assert "slipstream.server.stub.request_parser" in _imported_modules(bad)


def test_engine_package_imports_no_server_or_benchmark():
    assert _violations("engine", FORBIDDEN_FOR_LOWER_LAYERS) == []


# The stub speaks its own request vocabulary; TensorRT-LLM's (server/trtllm) is built on it and
# the composition root (server/triton_model, server/model_interfaces) wires the two. The one
# exception: the legacy name old model.py files import, looked up on first use.
ABOVE_THE_STUB = (
    "slipstream.server.trtllm",
    "slipstream.server.triton_model",
    "slipstream.server.model_interfaces",
)
LEGACY_STUB_NAME = "server/stub/triton_model.py"


def test_the_stub_imports_nothing_built_on_it():
    found = [
        v for v in _violations("server/stub", ABOVE_THE_STUB) if not v.startswith(LEGACY_STUB_NAME)
    ]
    assert found == []


def test_no_private_name_is_imported_from_another_module():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module != "__future__":
                private = [a.name for a in node.names if a.name.startswith("_")]
                found += [f"{path.relative_to(PACKAGE)}: {node.module}.{n}" for n in private]
    assert found == []
