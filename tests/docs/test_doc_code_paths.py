"""Every file of the repository that README.md, deploy/README.md and docs/*.md name in inline
code exists: a path with a folder (`worker/layers/linear.py`) is a file relative to the
repository root or one of the folders the documents name paths from (backend/slipstream/,
backend/, benchmarks/, tests/, client_examples/, deploy/); a bare source name (`loop.py`) is
the name of some file of the repository's code. Checked are the names ending in .py, .cpp, .h,
.pbtxt, .json or .yaml; code blocks are left out (they name what commands write).

Not files of this repository, so not checked: absolute and home paths (the container's or a
machine's: `/opt/tritonserver/backends/slipstream/model.py`), a path from a model's version
folder (`1/model.json`: the files a user puts into a Triton model repository), a bare .json
name (what a run writes or a user or checkpoint supplies: `results.json`, `config.json`), and
the other projects' files in OTHER_PROJECTS."""

import re
from pathlib import Path

import pytest

from support import ROOT

DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "deploy" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
CHECKED = DOCUMENTS

PATH_BASES = ["", *"backend/slipstream backend benchmarks tests client_examples deploy".split()]
NAME_FOLDERS = "backend benchmarks tests client_examples scripts model_repository deploy".split()

OTHER_PROJECTS = {
    # vllm_backend's model and request code ("vllm_backend's `src/model.py`"), and its CI test
    ("docs/benchmarks.md", "src/model.py"),
    ("docs/robustness.md", "src/model.py"),
    ("docs/vllm_backend.md", "src/utils/request.py"),
    ("docs/vllm_backend.md", "vllm_multi_gpu_test.py"),
    # Triton python_backend's module, which `slipstream serve` copies from the pytriton wheel
    ("docs/serving.md", "triton_python_backend_utils.py"),
    # TensorRT-LLM backend's clients and tests, which the document ports
    ("docs/trtllm_clients.md", "end_to_end_grpc_client.py"),
    ("docs/trtllm_clients.md", "end_to_end_test.py"),
    ("docs/trtllm_clients.md", "test_max_queue_size.py"),
    ("docs/trtllm_clients.md", "inflight_batcher_llm_client.py"),
    ("docs/trtllm_clients.md", "benchmark_core_model.py"),
}

FENCE = re.compile(r"^(```|~~~)")
URL = re.compile(r"\w+://\S+")
CODE_PATH = re.compile(r"(?<![\w./~$+-])[\w./~$+-]*\w\.(?:py|cpp|h|pbtxt|json|yaml)(?![\w.])")
VERSION_FOLDER = re.compile(r"^\d+/")


def code_paths(path: Path) -> list[str]:
    """The file names and paths of a Markdown file's inline code, code blocks left out."""
    found, fenced = [], False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if not fenced:
            for span in re.findall(r"`([^`]+)`", line):
                found += CODE_PATH.findall(URL.sub("", span))
    return found


def repository_names() -> set[str]:
    return {p.name for folder in NAME_FOLDERS for p in (ROOT / folder).rglob("*") if p.is_file()}


def missing(document: str, name: str, names: set[str]) -> bool:
    """Whether `name`, named in `document` (relative to the repository), is a file of the
    repository that is not there."""
    if (document, name) in OTHER_PROJECTS or name.startswith(("/", "~", "$")):
        return False
    if "/" not in name:
        return not name.endswith(".json") and name not in names
    if VERSION_FOLDER.match(name):
        return False
    relative = name.removeprefix("./")
    return not any((ROOT / base / relative).is_file() for base in PATH_BASES)


@pytest.fixture(scope="module")
def names():
    return repository_names()


@pytest.mark.parametrize("path", CHECKED, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_file_the_document_names_in_code_exists(path, names):
    document = str(path.relative_to(ROOT))
    assert [name for name in code_paths(path) if missing(document, name, names)] == []


def test_the_checker_sees_moved_files_and_lets_through_what_is_not_the_repositorys(tmp_path):
    doc = tmp_path / "a.md"
    doc.write_text(
        "`worker/layers/linear.py` and `worker/cpu_linear.py`,\n"
        "`python benchmarks/gpu_check.py -v`, `loop.py`, `gone_away.py`, `/opt/x/model.py`,\n"
        "`1/model.json`, `results.json`, `src/model.py`, `https://example.com/a/b.py`,\n"
        "`generate_stream.json.j2`\n"
        "```\nwritten/by/a/command.json\n```\n"
    )
    found = code_paths(doc)
    assert found == [
        "worker/layers/linear.py",
        "worker/cpu_linear.py",
        "benchmarks/gpu_check.py",
        "loop.py",
        "gone_away.py",
        "/opt/x/model.py",
        "1/model.json",
        "results.json",
        "src/model.py",
    ]
    names = repository_names()
    assert [n for n in found if missing("docs/robustness.md", n, names)] == [
        "worker/cpu_linear.py",
        "gone_away.py",
    ]
    assert missing("docs/a.md", "src/model.py", names)
