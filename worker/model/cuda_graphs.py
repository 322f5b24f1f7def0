"""CUDA graphs for decode steps.

A decode step launches a few hundred small kernels; replaying them as one
captured graph removes the per-launch host cost that otherwise dominates at
small batch sizes. Graphs are captured lazily per (batch bucket, context
bucket): the batch is padded up to its bucket with rows that write and read a
scratch KV block no sequence owns, and the context bucket fixes the split-K
plan of the attention kernel (shorter contexts exit early inside it)."""

from __future__ import annotations

import bisect
from typing import Optional

import numpy as np
import torch

from .kv_cache import PagedKVCache
from .llama import LlamaModel
from .ops import AttentionBatch

MIN_CONTEXT_BUCKET = 512


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


def graphs_supported(model: LlamaModel, kv_cache: PagedKVCache) -> bool:
    """Graphs need every op of a decode step on the native kernels (the
    reference backend reads host-side lengths that a graph would freeze)."""
    from .ops import cuda

    block = kv_cache.block_size
    return (model.device.type == "cuda" and cuda.available()
            and model.dtype in (torch.float16, torch.bfloat16)
            and kv_cache.dtype in (model.dtype, torch.int8)
            and model.config.head_dim in (64, 128) and block & (block - 1) == 0)


class DecodeGraphs:
    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_batch: int,
                 max_model_len: int, scratch_block: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.buckets = batch_buckets(max_batch)
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // self.block_size)  # block-table columns
        self.scratch_slot = scratch_block * self.block_size
        dev = model.device
        n = self.buckets[-1]
        # All per-step inputs live in one byte buffer, filled from a pinned
        # host buffer: a step is one asynchronous host-to-device copy.
        #   int64: input_ids, positions, slot_mapping, sources   [4, n]
        #   int32: context_lens [n], block_tables [n, width]
        # Two host buffers take turns, so the host fills step t+1's while
        # step t's copy may still be queued behind the GPU's work.
        ctx_count = -(-n // 4) * 4  # keeps the block tables 16-byte aligned
        i64_bytes, i32_count = 4 * n * 8, ctx_count + n * self.width
        nbytes = i64_bytes + 4 * i32_count
        self._hosts = [_HostInputs(nbytes, i64_bytes, n, ctx_count, self.width) for _ in range(2)]
        self._copied: list[torch.cuda.Event] = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0
        self._device = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d_i64 = self._device[:i64_bytes].view(torch.int64).view(4, n)
        d_i32 = self._device[i64_bytes:].view(torch.int32)
        self.input_ids, self.positions, self.slot_mapping, self.sources = d_i64
        self.context_lens = d_i32[:n]
        self.block_tables = d_i32[ctx_count:].view(n, self.width)
        # The previous step's sampled tokens (the engine copies them here), so
        # a step can run before the host has read them: the graph takes row
        # i's input from cat(prev_tokens, input_ids)[sources[i]].
        self.prev_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        for h in self._hosts:
            h.i64[:] = 0
            h.i64[2] = self.scratch_slot
            h.i64[3] = n + np.arange(n)
            h.ctx[:] = 1
            h.tables[:] = -1
            h.tables[:, 0] = scratch_block
        self._device.copy_(self._hosts[0].buffer)
        self.q_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        # every tensor a graph reads must outlive the graph: the rows whose
        # logits are kept are static too
        self.rows = torch.arange(n, device=dev)
        self._scratch_table_row = np.full(self.width, -1, dtype=np.int32)
        self._scratch_table_row[0] = scratch_block
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = torch.cuda.graph_pool_handle()

    def context_bucket(self, max_context: int) -> int:
        bucket = MIN_CONTEXT_BUCKET
        while bucket < max_context:
            bucket *= 2
        return min(bucket, self.max_model_len)

    def fits(self, batch_size: int, max_context: int) -> bool:
        return batch_size <= self.buckets[-1] and max_context <= self.max_model_len

    def run(self, input_ids: list[int], context_lens: list[int], block_tables: np.ndarray,
            prev_rows: Optional[list[int]] = None) -> torch.Tensor:
        """One decode step: token i is at position context_lens[i] - 1 of its
        sequence. block_tables: [b, >= needed columns]. prev_rows[i] >= 0 takes
        row i's input token from prev_tokens[prev_rows[i]] instead of
        input_ids[i] (a token the host has not read yet). Returns logits [b, V]."""
        b = len(input_ids)
        n = self.buckets[-1]
        bucket = self.buckets[bisect.bisect_left(self.buckets, b)]
        ctx = np.asarray(context_lens, dtype=np.int64)
        pos = ctx - 1
        host = self._hosts[self._turn]
        self._copied[self._turn].synchronize()  # its last copy has left the buffer
        ids, positions, slots, sources = host.i64
        tables = host.tables
        cols = min(block_tables.shape[1], self.width)
        tables[:b, :cols] = block_tables[:, :cols]
        tables[:b, cols:] = -1
        tables[b:bucket] = self._scratch_table_row
        ids[:b] = input_ids
        positions[:b] = pos
        slots[:b] = tables[np.arange(b), pos // self.block_size].astype(np.int64) * self.block_size \
            + pos % self.block_size
        if prev_rows is None:
            sources[:b] = n + np.arange(b)
        else:
            prev = np.asarray(prev_rows, dtype=np.int64)
            sources[:b] = np.where(prev >= 0, prev, n + np.arange(b))
        host.ctx[:b] = ctx
        # padding rows write and read the scratch block
        ids[b:bucket], positions[b:bucket], slots[b:bucket] = 0, 0, self.scratch_slot
        sources[b:bucket] = n + np.arange(b, bucket)
        host.ctx[b:bucket] = 1
        self._device.copy_(host.buffer, non_blocking=True)
        self._copied[self._turn].record()
        self._turn ^= 1
        key = (bucket, self.context_bucket(int(ctx.max())))
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(*key)
            self._graphs[key] = entry
        graph, logits = entry
        graph.replay()
        return logits[:b]

    def release(self) -> None:
        """Drop every captured graph (captured again on next use) and the
        memory pool they shared."""
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()

    def _batch(self, bucket: int, context_bucket: int) -> AttentionBatch:
        return AttentionBatch(
            q_lens=self.q_lens[:bucket], cu_q_lens=self.cu_q_lens[:bucket + 1],
            context_lens=self.context_lens[:bucket], block_tables=self.block_tables[:bucket],
            slot_mapping=self.slot_mapping[:bucket], positions=self.positions[:bucket],
            q_lens_host=[1] * bucket, context_lens_host=[context_bucket] * bucket,
            max_q_len=1, max_context_len=context_bucket)

    def _capture(self, bucket: int, context_bucket: int):
        batch = self._batch(bucket, context_bucket)
        rows = self.rows[:bucket]
        # warm up on a side stream (lazy allocations, cuBLAS handles), then capture
        stream = torch.cuda.Stream(self.model.device)
        stream.wait_stream(torch.cuda.current_stream(self.model.device))
        with torch.cuda.stream(stream):
            self._forward(bucket, batch, rows)
        torch.cuda.current_stream(self.model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(bucket, batch, rows)
        return graph, logits

    def _forward(self, bucket: int, batch: AttentionBatch, rows: torch.Tensor) -> torch.Tensor:
        ids = torch.cat([self.prev_tokens, self.input_ids])[self.sources[:bucket]]
        return self.model.forward(ids, batch, self.kv_cache, rows)


class _HostInputs:
    """A pinned host copy of DecodeGraphs' input buffer, with numpy views."""

    def __init__(self, nbytes: int, i64_bytes: int, n: int, ctx_count: int, width: int):
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        raw = self.buffer.numpy()
        self.i64 = raw[:i64_bytes].view(np.int64).reshape(4, n)
        i32 = raw[i64_bytes:].view(np.int32)
        self.ctx = i32[:n]
        self.tables = i32[ctx_count:].reshape(n, width)
