"""The ``TritonPythonModel`` a Slipstream model directory's ``1/model.py`` re-exports: the
composition root above the stub's adapter (``server/stub``) and TensorRT-LLM's interfaces
(``server/trtllm``), which it wires in (``model_interfaces``). Imported only inside the
Python-backend stub.

Older model.py files import ``slipstream.server.stub.triton_model`` (or this module, where the
adapter lived before the stub had its room): both give this class."""

from slipstream.server.model_interfaces import EXTENSIONS
from slipstream.server.stub.adapter import TritonAdapter


class TritonPythonModel(TritonAdapter):
    extensions = EXTENSIONS
