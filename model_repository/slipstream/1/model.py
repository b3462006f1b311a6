"""Triton loads this file; the adapter lives in the package
(``slipstream.server.triton_model``)."""

import os
import sys

# The backend stub's embedded Python ignores PYTHONPATH: honour it here, so a checkout named
# there wins over the installed package (tests run the code of the tree they are in).
for _path in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _path and _path not in sys.path:
        sys.path.insert(0, _path)

from slipstream.server.triton_model import TritonPythonModel  # noqa: E402,F401
