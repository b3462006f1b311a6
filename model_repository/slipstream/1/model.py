"""Triton loads this file; the adapter lives in the package (``slipstream.server.triton_model``)."""
import os
import sys

# The backend stub's embedded Python ignores PYTHONPATH (its sys.path is the interpreter's
# own plus this directory), so a checkout on PYTHONPATH would lose to an installed copy.
sys.path[:0] = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
                if p and p not in sys.path]

from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401
