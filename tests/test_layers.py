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


def _private_uses(package: Path) -> list:
    """``from m import _name`` and ``m._name`` across the package's modules: a private name
    used outside the module that defines it."""
    modules = {}
    for path in package.rglob("*.py"):
        parts = path.relative_to(package.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    found = []
    for name, path in sorted(modules.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        aliases = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    if full in modules:
                        aliases[alias.asname or alias.name] = full
                    elif _private(alias.name) and node.module.startswith("slipstream"):
                        found.append(f"{name}: from {node.module} import {alias.name}")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name in modules:
                        aliases[alias.asname or alias.name] = alias.name
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                owner = node.value
                if isinstance(owner, ast.Name) and owner.id in aliases:
                    found.append(f"{name}: {aliases[owner.id]}.{node.attr}")
    return sorted(set(found))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def test_no_private_name_is_used_outside_its_module():
    assert _private_uses(PACKAGE) == []


def test_the_private_name_check_sees_an_import_and_an_attribute(tmp_path):
    package = tmp_path / "slipstream"
    package.mkdir()
    (package / "a.py").write_text("def _helper():\n    pass\n")
    (package / "b.py").write_text("from slipstream.a import _helper\n")
    (package / "c.py").write_text("from slipstream import a\n\na._helper()\n")
    assert _private_uses(package) == [
        "slipstream.b: from slipstream.a import _helper",
        "slipstream.c: slipstream.a._helper",
    ]


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


TESTS = PACKAGE.parents[1] / "tests"


def test_no_test_module_imports_another():
    """Tests share fixtures through conftest.py and helpers through *_support modules."""
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            found += [f"{path.relative_to(TESTS)}: {n}" for n in names if n.startswith("test_")]
    assert found == []
