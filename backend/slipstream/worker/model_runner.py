"""Packs a scheduled step into one ragged batch and runs the model on the paged KV cache.

A step's inputs are built on the host (lists, then numpy) and reach the device through
``transfer.HostToDevice``: on a GPU one pinned buffer and one non-blocking copy, so packing a
step never waits on the device; on CPU the arrays are wrapped as they are."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from slipstream.core.scheduler_output import SchedulerOutput
from slipstream.worker.attention.dispatch import get_ops
from slipstream.worker.attention.metadata import AttentionMetadata
from slipstream.worker.cuda_graphs import DecodeGraphRunner
from slipstream.worker.kv_cache import KVCache
from slipstream.worker.lora.layers import LoraLayers, LoraMapping
from slipstream.worker.model.forward import ModelForward
from slipstream.worker.transfer import HostToDevice


@dataclass
class StepBatch:
    """Host-side description of one ragged forward."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: list[list[int]]  # per scheduled request: the rows whose logits it samples
    # the rows whose logits the step returns: sampled rows, then prompt-logprob rows ([0]
    # when there are none: the forward keeps one)
    keep: torch.Tensor
    lora: LoraMapping = field(default_factory=LoraMapping)  # rows per LoRA adapter
    # per scheduled request: the rows whose logits score its next prompt token (prompt_logprobs)
    prompt_rows: Optional[list[list[int]]] = None


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_cache: KVCache,
        device: torch.device,
        max_model_len: int,
        max_num_seqs: int = 0,
        cuda_graph_sizes=None,
        attention_ops: str = "auto",
        fast_forward: bool = True,
        lora: Optional[LoraLayers] = None,
    ) -> None:
        self.model = model
        self.kv = kv_cache
        self.device = device
        self.block_size = kv_cache.geometry.block_size
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.upload = HostToDevice(device)  # the step's inputs, in one copy
        ops = get_ops(device, attention_ops)
        self.forward = ModelForward.select(
            model, kv_cache, ops, device, fast_forward, fuse=lora is None
        )
        self.lora = lora  # its per-token adapter choice cannot be replayed from a CUDA graph
        if lora is not None:
            cuda_graph_sizes = None
        self.graphs = self._capture_decode_graphs(max_num_seqs, cuda_graph_sizes)

    # -- CUDA graphs (decode-only steps) ---------------------------------------------------
    def _capture_decode_graphs(self, max_num_seqs: int, sizes) -> Optional[DecodeGraphRunner]:
        if self.device.type != "cuda" or not sizes or max_num_seqs <= 0:
            return None
        self._cu_seqlens = torch.arange(max_num_seqs + 2, dtype=torch.int32, device=self.device)
        self._keep_all = torch.arange(max_num_seqs + 1, dtype=torch.long, device=self.device)
        runner = DecodeGraphRunner(
            self._decode_forward,
            max_num_seqs,
            self.max_blocks_per_seq,
            self.device,
            batch_sizes=sizes,
        )
        with torch.inference_mode():
            runner.capture()
        return runner if runner.captured else None

    def _decode_forward(self, input_ids, positions, slot_mapping, block_tables, seq_lens):
        """One token per sequence, built only from fixed-address tensors (graph-capturable)."""
        n = input_ids.shape[0]
        meta = AttentionMetadata(
            slot_mapping,
            self._cu_seqlens[: n + 1],
            seq_lens,
            block_tables,
            max_seqlen_q=1,
            max_seqlen_k=self.max_blocks_per_seq * self.block_size,
            block_size=self.block_size,
            query_lens_host=[1] * n,
            seq_lens_host=[],
        )
        return self.forward(input_ids, positions, meta, self._keep_all[:n])

    def prepare(self, sched: SchedulerOutput) -> StepBatch:
        ids: list = []
        pos: list = []
        slots: list = []
        q_lens: list = []
        seq_lens: list = []
        tables: list = []
        verify: list = []
        prompt: list = []
        sample_rows: list = [None] * len(sched.scheduled)
        prompt_rows: list = [None] * len(sched.scheduled)
        lora_spans: list = []
        bs = self.block_size
        for i in self._batch_order(sched):
            item = sched.scheduled[i]
            req, n = item.request, item.num_new_tokens
            start = req.num_computed_tokens
            tokens = req.all_token_ids + item.spec_token_ids
            row0 = len(ids)
            ids.extend(tokens[start : start + n])
            pos.extend(range(start, start + n))
            table = req.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in range(start, start + n))
            q_lens.append(n)
            seq_lens.append(start + n)
            tables.append(table)
            verify.append(bool(item.spec_token_ids))  # drafts only follow a decoded token
            prompt.append(start < req.num_prompt_tokens)
            reaches_end = start + n == len(tokens)
            k = 1 + len(item.spec_token_ids) if reaches_end else 0
            sample_rows[i] = list(range(row0 + n - k, row0 + n))
            prompt_rows[i] = _prompt_logprob_rows(req, start, n, row0)
            if self.lora is not None:
                lora_spans.append((self.lora.slot_of(req.params.lora_name), row0, n))
        self._add_padding(sched, ids, pos, slots, q_lens, seq_lens, tables)
        verify.extend([False] * (len(q_lens) - len(verify)))  # padding rows
        prompt.extend([True] * (len(q_lens) - len(prompt)))
        keep = [r for rows in sample_rows for r in rows]
        keep += [r for rows in prompt_rows for r in rows]
        batch = self._to_batch(
            ids, pos, slots, q_lens, seq_lens, tables, sample_rows, verify, prompt, keep
        )
        batch.prompt_rows = prompt_rows
        if self.lora is not None:
            batch.lora = self.lora.mapping_for(lora_spans, self.device)
        return batch

    def _batch_order(self, sched: SchedulerOutput) -> list[int]:
        """The order of the scheduled requests' rows in the batch: as scheduled, or with LoRA
        grouped by adapter, so that each adapter's rows are one slice (no gather/scatter).
        ``sample_rows`` and ``prompt_rows`` stay indexed as ``sched.scheduled``."""
        indices = list(range(len(sched.scheduled)))
        if self.lora is None:
            return indices
        slots = [self.lora.slot_of(item.request.params.lora_name) for item in sched.scheduled]
        order = [-1 if s is None else s for s in slots]  # no adapter first
        return sorted(indices, key=order.__getitem__)

    def _add_padding(self, sched, ids, pos, slots, q_lens, seq_lens, tables) -> None:
        """Static batching's wasted work, made real: padded prompt tokens and finished rows
        still go through the model (slot -1 writes nothing; they read the scratch block)."""
        for width in sched.padding.row_lengths(sched.scheduled):
            ids.extend([0] * width)
            pos.extend([0] * width)
            slots.extend([-1] * width)
            q_lens.append(width)
            seq_lens.append(width)
            tables.append([0] * -(-width // self.block_size))

    def _to_batch(
        self, ids, pos, slots, q_lens, seq_lens, tables, sample_rows, verify, prompt, keep
    ) -> StepBatch:
        width = max(len(t) for t in tables)
        table_arr = np.full((len(tables), width), -1, dtype=np.int32)
        for i, t in enumerate(tables):
            table_arr[i, : len(t)] = t
        cu = np.zeros(len(q_lens) + 1, dtype=np.int32)
        np.cumsum(q_lens, out=cu[1:])
        ids_t, pos_t, slots_t, cu_t, lens_t, tables_t, keep_t = self.upload.upload(
            [
                np.asarray(ids, dtype=np.int64),
                np.asarray(pos, dtype=np.int64),
                np.asarray(slots, dtype=np.int64),
                cu,
                np.asarray(seq_lens, dtype=np.int32),
                table_arr,
                np.asarray(keep if keep else [0], dtype=np.int64),
            ]
        )
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            cu_seqlens_q=cu_t,
            seq_lens=lens_t,
            block_tables=tables_t,
            max_seqlen_q=max(q_lens),
            max_seqlen_k=max(seq_lens),
            block_size=self.block_size,
            query_lens_host=q_lens,
            seq_lens_host=seq_lens,
            verify_host=verify,
            prompt_host=prompt,
        )
        return StepBatch(ids_t, pos_t, meta, sample_rows, keep_t)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """Forward the packed batch; logits (fp32) only for the rows that are sampled, then
        those of the prompt-logprob rows (``batch.prompt_rows``, in request order)."""
        num_rows = sum(len(r) for r in batch.sample_rows)
        num_rows += sum(len(r) for r in batch.prompt_rows or [])
        meta = batch.meta
        if self.graphs is not None and meta.decode_only and num_rows:
            logits = self.graphs(
                batch.input_ids,
                batch.positions,
                meta.slot_mapping,
                meta.block_tables,
                meta.seq_lens,
            )
            return logits.index_select(0, batch.keep).float()
        if self.lora is not None:
            self.lora.activate(batch.lora)
        try:
            logits = self.forward(batch.input_ids, batch.positions, meta, batch.keep).float()
        finally:
            if self.lora is not None:
                self.lora.deactivate()
        return logits if num_rows else logits[:0]

    def execute(self, sched: SchedulerOutput) -> tuple[torch.Tensor, list[list[int]]]:
        """Logits of the sampled rows, and which rows each scheduled request owns."""
        logits, sample_rows, _ = self.execute_with_prompt_logits(sched)
        return logits, sample_rows

    def execute_with_prompt_logits(self, sched: SchedulerOutput) -> tuple:
        """``execute``, plus per scheduled request the logits of its prompt-logprob rows
        (``[rows, V]``, or None): row j scores prompt token ``first + j + 1``."""
        batch = self.prepare(sched)
        logits = self.run(batch)
        num_sampled = sum(len(r) for r in batch.sample_rows)
        prompt_logits, cursor = [], num_sampled
        assert batch.prompt_rows is not None  # prepare() sets them
        for rows in batch.prompt_rows:
            prompt_logits.append(logits[cursor : cursor + len(rows)] if rows else None)
            cursor += len(rows)
        return logits[:num_sampled], batch.sample_rows, prompt_logits


def _prompt_logprob_rows(req, start: int, n: int, row0: int) -> list[int]:
    """The rows of this chunk whose logits score a prompt token not scored yet (a recomputed
    prompt is not scored twice): position p scores token p + 1, up to the prompt's last."""
    if req.params.prompt_logprobs is None:
        return []
    first = max(start, len(req.prompt_logprobs))
    last = min(start + n, req.num_prompt_tokens - 1)
    return list(range(row0 + first - start, row0 + last - start)) if last > first else []
