"""The test tier (a plugin the root conftest loads). ``pytest --device cuda`` (or
``SLIPSTREAM_TEST_DEVICE=cuda``) on a machine with an NVIDIA GPU runs the GPU tier: OpenAI
Triton kernels compiled (no interpreter), and every test that takes the ``tier_device``
fixture on CUDA (engines in fp32, against fp32 references); the other tests, CPU-only, are
skipped there. The default tier is ``cpu``: the kernels run in Triton's interpreter
(``TRITON_INTERPRET=1``, read when ``@triton.jit`` decorates, i.e. when a kernel module is
imported: set in ``pytest_configure``, before collection imports any)."""

import os

import pytest

DEVICE_ENV = "SLIPSTREAM_TEST_DEVICE"


def pytest_addoption(parser):
    parser.addoption(
        "--device",
        choices=("cpu", "cuda"),
        default=os.environ.get(DEVICE_ENV, "cpu"),
        help="test tier: cpu (default; Triton kernels interpreted) or cuda (the GPU tier)",
    )


def pytest_configure(config):
    device = config.getoption("--device")
    os.environ[DEVICE_ENV] = device  # for the test modules and the processes they start
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        return
    os.environ.pop("TRITON_INTERPRET", None)
    import torch

    if not torch.cuda.is_available():
        raise pytest.UsageError("--device cuda: torch sees no CUDA GPU here")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--device") == "cpu":
        return
    cpu_only = pytest.mark.skip(reason="CPU-only test (the cuda tier runs tier_device tests)")
    for item in items:
        if "tier_device" not in getattr(item, "fixturenames", ()):
            item.add_marker(cpu_only)


@pytest.fixture(scope="session")
def tier_device(pytestconfig):
    """The device the tier's device tests run on (``torch.device``)."""
    import torch

    return torch.device(pytestconfig.getoption("--device"))
