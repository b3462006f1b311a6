"""Triton loads this file; the adapter lives in the package (``slipstream.server.triton_model``)."""
from slipstream.server.triton_model import TritonPythonModel  # noqa: F401
