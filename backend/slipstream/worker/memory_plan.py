"""How a GPU engine shares out the device's memory, as vLLM does.

``gpu_memory_utilization`` (default 0.9) is the share of the GPU's TOTAL memory this engine
may use, whatever other processes hold (vLLM's meaning, per instance). From that budget the
engine first takes what it cannot do without, measured before the KV cache exists:

* the weights: the target model, its LoRA slots, and the draft model (speculative decoding),
  all loaded before the cache is sized;
* the activations' peak: a profiling forward of ``max_num_batched_tokens`` prompt tokens and
  one decode step of the largest CUDA-graph batch (with its sampling), on a scratch cache;
* the CUDA graphs' pool: the largest graph's decode activations plus every graph's logits;
* memory outside torch's allocator that grew meanwhile (CUDA context, cuBLAS workspaces).

The KV pool takes the rest, shared between the target's cache and the draft model's (whose
cache holds as many blocks as the target's plus a few per sequence). vLLM also refuses to
start when the free memory at start is below the budget; so does this.

The arithmetic is here, on plain figures (tested with made-up ones); measuring them is the
factory's thin CUDA part (``engine/factory.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default
GIB = 2**30


@dataclass(frozen=True)
class MemoryFigures:
    """What a GPU engine measured before sizing its KV cache (bytes)."""

    total: int  # the device's total memory
    free_at_start: int  # free before this engine loaded anything
    weights: int  # the target model's weights (LoRA slots included)
    draft_weights: int  # the draft model's (0 without one, or when it is the target)
    activations: int  # the profiling steps' peak above the weights
    cuda_graphs: int  # the graphs' memory pool, estimated (0 without graphs)
    non_torch: int  # growth of memory torch's allocator does not hold


@dataclass(frozen=True)
class BlockSizes:
    """What one KV block costs, and what the draft model's cache adds to the target's."""

    target: int  # bytes per block of the target's cache
    draft: int = 0  # bytes per block of the draft model's cache (0: no draft model)
    draft_extra_blocks: int = 0  # blocks the draft cache holds beyond the target's count


@dataclass(frozen=True)
class MemoryPlan:
    figures: MemoryFigures
    utilization: float
    budget: int  # total x utilization
    kv_bytes: int  # what is left for the KV caches
    num_blocks: int  # the target's cache
    draft_num_blocks: int  # the draft model's cache (0 without one)

    @property
    def non_kv(self) -> int:
        f = self.figures
        return f.weights + f.draft_weights + f.activations + f.cuda_graphs + f.non_torch

    def describe(self) -> str:
        """Each figure, for the log."""
        f = self.figures

        def g(n: int) -> str:
            return f"{n / GIB:.2f} GiB"

        parts = [
            f"total {g(f.total)} x gpu_memory_utilization {self.utilization} = {g(self.budget)}",
            f"weights {g(f.weights)}",
            f"draft model {g(f.draft_weights)}",
            f"activation peak {g(f.activations)}",
            f"CUDA graphs {g(f.cuda_graphs)}",
            f"non-torch {g(f.non_torch)}",
            f"KV cache {g(self.kv_bytes)} = {self.num_blocks} blocks"
            + (f" + {self.draft_num_blocks} draft blocks" if self.draft_num_blocks else ""),
        ]
        return "GPU memory: " + ", ".join(parts)


def plan_memory(figures: MemoryFigures, utilization: float, blocks: BlockSizes) -> MemoryPlan:
    """The KV cache's share of ``figures.total x utilization`` (see the module); raises
    ``ValueError`` with the figures when the budget cannot be had or holds no cache."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(figures.total * utilization)
    if figures.free_at_start < budget:
        raise ValueError(
            f"free memory on the device at start ({figures.free_at_start / GIB:.2f} of "
            f"{figures.total / GIB:.2f} GiB) is less than gpu_memory_utilization {utilization} "
            f"asks for ({budget / GIB:.2f} GiB): lower gpu_memory_utilization or free memory "
            "held by other processes"
        )
    non_kv = (
        figures.weights
        + figures.draft_weights
        + figures.activations
        + figures.cuda_graphs
        + figures.non_torch
    )
    kv_bytes = max(budget - non_kv, 0)
    # target N blocks, draft N + extra: N x (target + draft) + extra x draft <= kv_bytes
    draft_fixed = blocks.draft_extra_blocks * blocks.draft
    num_blocks = max(kv_bytes - draft_fixed, 0) // (blocks.target + blocks.draft)
    draft_blocks = num_blocks + blocks.draft_extra_blocks if blocks.draft else 0
    plan = MemoryPlan(figures, utilization, budget, kv_bytes, num_blocks, draft_blocks)
    if num_blocks < 2:
        raise ValueError(
            f"no room for the KV cache: {plan.describe()}; raise gpu_memory_utilization, "
            "or lower max_num_batched_tokens, max_num_seqs or the CUDA-graph batch sizes"
        )
    return plan


def cpu_kv_bytes(kv_cache_memory_bytes: int | None) -> int:
    """The CPU engine's KV pool: ``kv_cache_memory_bytes``, 1 GiB when unset."""
    return GIB if kv_cache_memory_bytes is None else kv_cache_memory_bytes
