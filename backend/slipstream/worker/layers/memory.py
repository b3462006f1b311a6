"""Where a CPU model's weight memory goes: a layer's stock copy replaced by a stand-in without
storage once a packed copy serves its products, what is left given storage of its own (off
the checkpoint's memory map), and freed pages handed back to the OS."""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Optional

import torch


def storage_less(t: torch.Tensor) -> torch.nn.Parameter:
    """A stand-in with the weight's shape and dtype and no storage: the layer's own copy goes."""
    return torch.nn.Parameter(
        torch.empty(t.shape, dtype=t.dtype, device="meta"), requires_grad=False
    )


def own_storage(model: torch.nn.Module) -> None:
    """Give what is left of a model (norms, rotary tables, an embedding) storage of its own.
    Loaded from safetensors, every tensor is a view of the file's one memory map: a single
    norm weight left in it keeps the whole file mapped, and the pages the packing read (all
    of the weights) resident."""
    with torch.no_grad():
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.device.type == "cpu":
                tensor.data = tensor.data.clone()


def reads_rows_only(embedding: torch.nn.Embedding) -> bool:
    """Its lookup only reads rows of its table, so a packed copy of the table (a tied head's)
    can serve it: not a subclass with a forward of its own (Gemma scales its rows), not one
    that renormalises the rows it reads (``max_norm``). ``padding_idx`` only stops gradients."""
    return type(embedding).forward is torch.nn.Embedding.forward and embedding.max_norm is None


def tied_embedding(model: torch.nn.Module) -> Optional[torch.nn.Embedding]:
    """The input embedding that shares the LM head's weight and could read its rows from the
    head's packed copy (``reads_rows_only``); None where there is none such."""
    head = getattr(model, "lm_head", None)
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if head is None or not isinstance(embedding, torch.nn.Embedding):
        return None
    if embedding.weight is not head.weight or not reads_rows_only(embedding):
        return None
    return embedding


def release_freed_memory() -> None:
    """Hand the freed fp32 weights' pages back to the OS (glibc keeps freed heap memory,
    and raises its mmap threshold after large frees, so RSS would stay at the fp32 size)."""
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):  # not glibc
            pass
