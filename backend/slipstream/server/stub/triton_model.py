"""Where model.py files written before the composition root import the adapter from
(``from slipstream.server.stub.triton_model import TritonPythonModel``): a model directory's
``model.py`` is copied out of the package, so an upgrade does not rewrite it.

The name is looked up on first use, so that importing the stub never imports the layers built
on it: the class is the composition root's (``slipstream.server.triton_model``)."""

from __future__ import annotations

from typing import Any


def __getattr__(name: str) -> Any:
    if name == "TritonPythonModel":
        from slipstream.server.triton_model import TritonPythonModel

        return TritonPythonModel
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
