"""Where the Triton adapter lived before ``slipstream.server.stub.triton_model``: model
repositories and backend directories written before the move import it from here (a
``model.py`` is copied out of the package, so an upgrade does not rewrite it)."""

from slipstream.server.stub.triton_model import TritonPythonModel  # noqa: F401
