"""A step's small tensors between host and device: one copy each way.

A GPU step must never wait on the device except once, when it reads back what it sampled.
Two things stall a step otherwise: a tensor made on the device from host data
(``torch.tensor(list, device="cuda")`` copies from pageable memory and synchronises), and a
read of a device value on the host (``.item()``, ``.tolist()``, ``.cpu()``). So:

* ``HostToDevice.upload`` packs a step's host arrays (token ids, positions, slots, block
  tables, sampling parameters ...) into ONE pinned buffer and copies it with one
  non-blocking copy; the device tensors are views of that copy. torch's caching host
  allocator keeps a pinned block from being reused until the copy that reads it has run,
  so a fresh buffer per step is safe without waiting.
* ``DeviceToHost`` collects the device tensors the host needs after the step (sampled token
  ids, the logprobs that were asked for) and brings them back in ONE copy: the step's one
  synchronisation.

On CPU (the compiled-kernel engine) ``upload`` wraps the arrays without copying and
``fetch`` reads the tensors in place, so the CPU step costs what it did. ``staged=True`` on
CPU runs the device protocol on CPU tensors (packing, one copy each way): what the tests use
to prove on a machine without a GPU that the device path reads the device only once.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import numpy as np
import numpy.typing as npt
import torch

_ALIGN = 16  # bytes: every segment starts aligned for any dtype's view


def _aligned(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


def _numpy_dtype(dtype: torch.dtype) -> np.dtype:
    return torch.empty(0, dtype=dtype).numpy().dtype


@dataclass(frozen=True)
class _Segment:
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _layout(shapes: Sequence[tuple[tuple[int, ...], torch.dtype, int]]) -> tuple[list, int]:
    """Aligned segments for (shape, dtype, nbytes) entries, and the buffer size."""
    segments, offset = [], 0
    for shape, dtype, nbytes in shapes:
        segments.append(_Segment(offset, nbytes, dtype, shape))
        offset += _aligned(nbytes)
    return segments, max(offset, _ALIGN)


def _view(buffer: torch.Tensor, seg: _Segment) -> torch.Tensor:
    return buffer[seg.offset : seg.offset + seg.nbytes].view(seg.dtype).view(seg.shape)


class HostToDevice:
    """Host arrays -> device tensors, in one non-blocking copy (see the module)."""

    def __init__(self, device: torch.device, staged: Optional[bool] = None) -> None:
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else staged
        self.pinned = self.staged and self.device.type == "cuda"

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """One device tensor per array (same dtype and shape)."""
        arrays = [np.ascontiguousarray(a) for a in arrays]
        if not self.staged:
            return [torch.from_numpy(a) for a in arrays]
        segments, size = _layout([(a.shape, _torch_dtype(a.dtype), a.nbytes) for a in arrays])
        host = torch.empty(size, dtype=torch.uint8, pin_memory=self.pinned)
        view = host.numpy()
        for a, seg in zip(arrays, segments):
            view[seg.offset : seg.offset + seg.nbytes] = a.reshape(-1).view(np.uint8)
        if self.device.type == "cpu":
            device = host.clone()  # the copy a GPU would make, so tests see one
        else:
            device = host.to(self.device, non_blocking=True)
        return [_view(device, seg) for seg in segments]

    def tensor(self, values, dtype: npt.DTypeLike) -> torch.Tensor:
        """One array (a list or an array) on the device."""
        return self.upload([np.asarray(values, dtype=dtype)])[0]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without a synchronisation (a pinned copy, copied
    non-blocking); on CPU the tensor itself."""
    device = torch.device(device)
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)


class HostValue:
    """A device tensor registered with ``DeviceToHost``; its ``value`` (numpy) after
    ``fetch``."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self._value: Optional[np.ndarray] = None

    @property
    def value(self) -> np.ndarray:
        if self._value is None:
            raise RuntimeError("DeviceToHost.fetch() has not run")
        return self._value


class DeviceToHost:
    """Device tensors the host reads after a step, brought back in one copy."""

    def __init__(self, device: torch.device, staged: Optional[bool] = None) -> None:
        self.device = torch.device(device)
        self.staged = self.device.type != "cpu" if staged is None else staged
        self._pending: list[HostValue] = []
        self.fetched = False

    def add(self, tensor: torch.Tensor) -> HostValue:
        if self.fetched:
            raise RuntimeError("DeviceToHost already fetched")
        pending = HostValue(tensor)
        self._pending.append(pending)
        return pending

    @property
    def registered(self) -> list[torch.Tensor]:
        """The device tensors registered so far, in order."""
        return [p.tensor for p in self._pending]

    def fetch(self) -> None:
        """Bring every registered tensor to the host (one copy; the step's one wait)."""
        if self.fetched:
            return
        self.fetched = True
        if not self._pending:
            return
        if not self.staged:
            for p in self._pending:
                p._value = p.tensor.detach().numpy()
            return
        tensors = [p.tensor.detach().contiguous() for p in self._pending]
        segments, size = _layout([(tuple(t.shape), t.dtype, t.nbytes) for t in tensors])
        packed = torch.empty(size, dtype=torch.uint8, device=self.device)
        for t, seg in zip(tensors, segments):
            if seg.nbytes:
                packed[seg.offset : seg.offset + seg.nbytes] = t.reshape(-1).view(torch.uint8)
        host = _copy_to_host(packed)
        for p, seg in zip(self._pending, segments):
            raw = host[seg.offset : seg.offset + seg.nbytes]
            p._value = raw.view(_numpy_dtype(seg.dtype)).reshape(seg.shape)


def _copy_to_host(packed: torch.Tensor) -> np.ndarray:
    """THE step's device-to-host copy (tests recognise it by this function's name)."""
    if packed.device.type == "cpu":
        return packed.clone().numpy()
    host = torch.empty(packed.shape, dtype=torch.uint8, pin_memory=True)
    with sync_allowed(packed.device):
        host.copy_(packed, non_blocking=True)
        torch.cuda.current_stream(packed.device).synchronize()
    return host.numpy()


@contextlib.contextmanager
def sync_allowed(device: torch.device) -> Iterator[None]:
    """A synchronisation the step means to make: CUDA's sync debug mode (which a test sets to
    "error" around decode steps) does not apply inside."""
    if device.type != "cuda":
        yield
        return
    mode = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode(0)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(mode)
