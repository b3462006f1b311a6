"""Finding, on CPU, every place a GPU step would wait on the device.

On a GPU a step synchronises whenever the host reads a device value: ``.item()``, ``.tolist()``,
``.cpu()``, ``.numpy()``, ``bool(t)``, ``int(t)``, or an operator whose output shape depends on
the data (``nonzero``, ``unique``, boolean-mask indexing, ``masked_select`` ...). On CPU nothing
waits, so ``HostReads`` tracks which tensors *would* live on the device and reports every
read of one on the host:

* device tensors are the roots given (model weights, the KV cache), what
  ``transfer.HostToDevice.upload`` hands out, and -- through a ``TorchDispatchMode`` -- every
  output of an operator one of whose inputs is a device tensor (in-place ones included);
* reads are seen at the Python level (a ``TorchFunctionMode``: ``tolist``, ``numpy``, ``item``,
  ``cpu``, ``__bool__`` ...) and at the operator level (``_local_scalar_dense``, ``nonzero``,
  ``unique``, boolean indexing ...); ``.to(device)`` is not one (on CPU, ``.to(x.device)``
  and ``.to("cpu")`` look alike: the cuda tier's sync-debug test covers it);
* a read inside ``transfer._copy_to_host`` is the step's one copy back (``transfers``), and
  reads made by OpenAI Triton's interpreter are a kernel running, not the host waiting.
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakTensorKeyDictionary

# Python-level reads of a tensor's values on the host
PYTHON_READS = {
    "tolist",
    "numpy",
    "item",
    "cpu",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "__array__",
}
# operators whose output shape (or Python result) depends on the data
DATA_DEPENDENT = {
    "_local_scalar_dense",
    "nonzero",
    "nonzero_static",
    "masked_select",
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "equal",
    "is_nonzero",
}


@dataclass
class Read:
    what: str
    where: str  # the innermost frames outside torch


@dataclass
class HostReads:
    """``with HostReads(roots) as reads: ...``; then ``reads.reads`` and ``reads.transfers``."""

    roots: Iterable[torch.Tensor] = ()
    reads: list[Read] = field(default_factory=list)
    transfers: int = 0

    def __post_init__(self) -> None:
        self.device = WeakTensorKeyDictionary()
        self.bases = WeakTensorKeyDictionary()  # view -> the tensor it views
        for t in self.roots:
            self.device[t] = True
        self._modes: list = []
        self._patched = None

    # -- tracking --------------------------------------------------------------------------
    def is_device(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t in self.device

    def mark(self, t) -> None:
        """``t`` (and the tensors it views: an in-place write into a view writes its base)."""
        while isinstance(t, torch.Tensor) and t not in self.device:
            self.device[t] = True
            t = self.bases.get(t)

    def read(self, what: str) -> None:
        frames = [f for f in traceback.extract_stack()[:-2] if "torch/" not in f.filename]
        names = {f.name for f in frames}
        if "_copy_to_host" in names:
            if what in ("numpy", "__array__"):  # the one copy's own read of its host buffer
                self.transfers += 1
            return
        if any("triton/runtime/interpreter" in f.filename for f in frames):
            return  # a kernel run by the interpreter
        where = " < ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in frames[-4:])
        self.reads.append(Read(what, where))

    # -- the modes -------------------------------------------------------------------------
    def __enter__(self) -> "HostReads":
        from slipstream.worker import transfer

        upload = transfer.HostToDevice.upload
        tracker = self

        def tracked_upload(self_, arrays):
            tensors = upload(self_, arrays)
            if self_.staged:
                for t in tensors:
                    tracker.mark(t)
            return tensors

        transfer.HostToDevice.upload = tracked_upload  # type: ignore[method-assign]
        self._patched = (transfer.HostToDevice, upload)
        self._modes = [_Dispatch(self), _Function(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        cls, upload = self._patched  # type: ignore[misc]
        cls.upload = upload

    def summary(self) -> str:
        return "\n".join(f"{r.what}: {r.where}" for r in self.reads[:20])


class _Dispatch(TorchDispatchMode):
    def __init__(self, tracker: HostReads) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        flat = _flatten((args, kwargs))
        on_device = any(self.tracker.is_device(a) for a in flat)
        name = func.overloadpacket.__name__
        if on_device and (name in DATA_DEPENDENT or _bool_indexing(name, flat)):
            self.tracker.read(f"aten.{name}")
        out = func(*args, **kwargs)
        base = args[0] if args else None
        if func.is_view and isinstance(out, torch.Tensor) and isinstance(base, torch.Tensor):
            if out is not base:  # some view ops hand back their input itself
                self.tracker.bases[out] = base
        if on_device:
            for t in _flatten(out):
                self.tracker.mark(t)
        return out


class _Function(TorchFunctionMode):
    def __init__(self, tracker: HostReads) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in PYTHON_READS and args and self.tracker.is_device(args[0]):
            self.tracker.read(name)
        return func(*args, **kwargs)


def _flatten(value) -> list:
    out: list = []
    stack = [value]
    while stack:
        v = stack.pop()
        if isinstance(v, (list, tuple)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.values())
        else:
            out.append(v)
    return out


def _bool_indexing(name: str, flat: list) -> bool:
    return name in ("index", "index_put", "index_put_") and any(
        isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in flat
    )


def model_roots(engine) -> list[torch.Tensor]:
    """What lives on the device for the whole life of an engine: weights, buffers, KV cache."""
    roots = [p for p in engine.model.parameters()] + [b for b in engine.model.buffers()]
    roots.append(engine.kv_cache.data)
    roots += engine.kv_cache.key_caches + engine.kv_cache.value_caches
    return roots
