"""Triton loads this file; the adapter lives in the package (``slipstream.server.triton_model``)."""
import os
import sys

# The Python-backend stub's interpreter ignores the environment (sys.flags.ignore_environment),
# PYTHONPATH included, and would import whatever copy of the package its virtualenv has
# installed: honour PYTHONPATH here, so that a checkout on it (tests, benchmarks) serves its
# own code.
for _entry in reversed([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]):
    if _entry not in sys.path:
        sys.path.insert(0, _entry)

from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401
