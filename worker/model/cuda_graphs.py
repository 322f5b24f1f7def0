"""CUDA graphs for decode steps, for a lone sequence's short prefill, and
pieces of any other step between its attention launches (MixedGraphs).

A step launches a few hundred small kernels; replaying them as one captured
graph removes the per-launch host cost that otherwise dominates at small
batch sizes (decode) and for short prompts (a 128-token prefill of an 8B
model is host-bound when launched op by op: every tensor-parallel rank pays
that cost, so a prompt waits as long on two GPUs as on one). A graph is
held per bucket, captured at start (`capture_all`) or on first use: the
batch (decode) or the new tokens (prefill) are padded up to their bucket
with rows that write a scratch KV block no sequence owns, and a context
bucket fixes the split-K plan of the attention kernels (shorter contexts
exit early inside them)."""

from __future__ import annotations

import abc
import bisect
import math
import time
from typing import Optional

import numpy as np
import torch

from .kv_cache import PagedKVCache
from .llama import LlamaModel
from .ops import AttentionBatch

MIN_CONTEXT_BUCKET = 512
MIN_PREFILL_BUCKET = 16
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


def batch_buckets(max_batch: int) -> list[int]:
    sizes = [1, 2, 4, 8] + list(range(16, max_batch + 1, 16))
    return sorted({b for b in sizes if b < max_batch} | {max_batch})


def prefill_buckets(max_tokens: int) -> list[int]:
    """New-token counts a prefill graph is captured for, up to `max_tokens`:
    steps of a quarter of the power of two below (16 up to 128, then 32 up
    to 256, 64 up to 512, ...), so that padding costs the products at most
    a quarter more rows (a 129-token chat turn takes 160, not 256)."""
    sizes, b = [], MIN_PREFILL_BUCKET
    while b < max_tokens:
        sizes.append(b)
        b += max(MIN_PREFILL_BUCKET, (1 << (b.bit_length() - 1)) // 4)
    return sizes + [max_tokens] if max_tokens > 0 else []


def graphs_supported(model: LlamaModel, kv_cache: PagedKVCache) -> bool:
    """Graphs need every op of a step on the native kernels (the reference
    backend reads host-side lengths that a graph would freeze)."""
    from .ops import cuda

    block = kv_cache.block_size
    return (model.device.type == "cuda" and cuda.available()
            and model.dtype in (torch.float16, torch.bfloat16)
            and kv_cache.dtype in (model.dtype, torch.int8)
            and model.config.head_dim in (64, 128) and block & (block - 1) == 0)


def context_bucket(max_context: int, max_model_len: int) -> int:
    bucket = MIN_CONTEXT_BUCKET
    while bucket < max_context:
        bucket *= 2
    return min(bucket, max_model_len)


def context_buckets(max_model_len: int) -> list[int]:
    """Every context bucket up to `max_model_len`."""
    return sorted({context_bucket(1 << k, max_model_len)
                   for k in range(max(max_model_len, 1).bit_length() + 1)})


def warmed_up(device: torch.device, run):
    """run() once on a side stream, ordered after the current stream's work
    and before its next: what a capture needs done first (lazy allocations,
    cuBLAS handles). Returns its result."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        result = run()
    torch.cuda.current_stream(device).wait_stream(stream)
    return result


class GraphInputs:
    """A graph's per-step inputs in one device byte buffer (every field
    16-byte aligned), filled from one of two pinned host buffers that take
    turns: a step is one asynchronous host-to-device copy, and the host fills
    step t+1's buffer while step t's copy may still be queued behind the
    GPU's work. `fields`: name -> (dtype, shape)."""

    def __init__(self, fields: dict[str, tuple[torch.dtype, tuple[int, ...]]],
                 device: torch.device):
        layout, size = {}, 0
        for name, (dtype, shape) in fields.items():
            size = -(-size // 16) * 16
            nbytes = dtype.itemsize * math.prod(shape)
            layout[name] = (size, nbytes, dtype, shape)
            size += nbytes
        self.buffer = torch.empty(size, dtype=torch.uint8, device=device)
        self.device = {name: self.buffer[o:o + n].view(dtype).view(shape)
                       for name, (o, n, dtype, shape) in layout.items()}
        self._hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.hosts = [{name: h.numpy()[o:o + n].view(_NUMPY[dtype]).reshape(shape)
                       for name, (o, n, dtype, shape) in layout.items()} for h in self._hosts]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def next_host(self) -> dict[str, np.ndarray]:
        """The host buffer to fill for the next step (its last copy has left it)."""
        self._copied[self._turn].synchronize()
        return self.hosts[self._turn]

    def upload(self) -> None:
        """Copy the buffer just filled to the device, queued on the current stream."""
        self.buffer.copy_(self._hosts[self._turn], non_blocking=True)
        self._copied[self._turn].record()
        self._turn ^= 1


class _Graphs(abc.ABC):
    """Captured graphs by (rows, context) bucket, sharing one memory pool and
    one logits buffer. A subclass says which buckets there are (`_keys`), what
    a bucket's graph reads (`_batch`) and runs (`_forward`)."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_model_len: int,
                 logit_rows: int):
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // self.block_size)  # block-table columns
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, object]] = {}
        self._pool = torch.cuda.graph_pool_handle()
        # Every graph writes its logits here: one replays at a time, and its
        # logits are read (sampled) before the next, so buckets need not each
        # hold their own (at 512 rows of a 128k vocabulary, 260 MB apiece).
        self._logit_rows = logit_rows
        self.logits: Optional[torch.Tensor] = None
        # the host's time in captures (a step that captures waits for it)
        self.capture_seconds = 0.0

    @property
    def captured(self) -> int:
        """How many graphs are held (captured at start, or each on its first use)."""
        return len(self._graphs)

    def release(self) -> None:
        """Drop every captured graph (captured again on next use), the
        memory pool they shared and their logits."""
        self._graphs.clear()
        self._pool = torch.cuda.graph_pool_handle()
        self.logits = None

    def capture_all(self) -> None:
        """Capture every bucket's graph now (at start), so that no step waits
        for a capture: each takes a device synchronize and two forwards."""
        for key in self._keys():
            if key not in self._graphs:
                self._fill_idle_inputs(*key)  # the warm-up runs them
                self._entry(key)

    def _entry(self, key: tuple[int, int]):
        entry = self._graphs.get(key)
        if entry is None:
            t0 = time.perf_counter()
            entry = self._graphs[key] = self._capture(*key)
            self.capture_seconds += time.perf_counter() - t0
        return entry

    def _replay(self, rows: int, max_context: int) -> torch.Tensor:
        graph, logits, _ = self._entry((rows, context_bucket(max_context, self.max_model_len)))
        graph.replay()
        return logits

    def _capture(self, rows: int, context: int):
        # Every tensor a graph reads must outlive it: the batch (its tile
        # lists) is kept with the graph.
        batch = self._batch(rows, context)
        warm = warmed_up(self.model.device, lambda: self._forward(rows, batch, None))
        if self.logits is None:
            self.logits = torch.empty((self._logit_rows, warm.shape[1]), dtype=warm.dtype,
                                      device=warm.device)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            logits = self._forward(rows, batch, self.logits[:warm.shape[0]])
        return graph, logits, batch

    @abc.abstractmethod
    def _keys(self) -> list[tuple[int, int]]:
        """Every (rows, context) bucket a step may replay."""

    @abc.abstractmethod
    def _fill_idle_inputs(self, rows: int, context: int) -> None:
        """Inputs for a bucket's capture outside a step: rows that touch
        only the scratch block."""

    @abc.abstractmethod
    def _batch(self, rows: int, context: int) -> AttentionBatch:
        """The attention metadata of the bucket's graph, over the device inputs."""

    @abc.abstractmethod
    def _forward(self, rows: int, batch: AttentionBatch,
                 out: Optional[torch.Tensor]) -> torch.Tensor:
        """The forward the bucket's graph captures; its logits (in `out`, if given)."""


class DecodeGraphs(_Graphs):
    """Decode steps, by (batch bucket, context bucket)."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_batch: int,
                 max_model_len: int, scratch_block: int):
        self.buckets = batch_buckets(max_batch)
        super().__init__(model, kv_cache, max_model_len, logit_rows=self.buckets[-1])
        self.scratch_slot = scratch_block * self.block_size
        dev = model.device
        n = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        # `sources`: row i's input is cat(prev_tokens, input_ids)[sources[i]]
        self.inputs = GraphInputs({"input_ids": (i64, (n,)), "positions": (i64, (n,)),
                                   "slot_mapping": (i64, (n,)), "sources": (i64, (n,)),
                                   "context_lens": (i32, (n,)),
                                   "block_tables": (i32, (n, self.width))}, dev)
        # The previous step's sampled tokens (the engine copies them here), so
        # a step can run before the host has read them.
        self.prev_tokens = torch.zeros(n, dtype=torch.int64, device=dev)
        self.q_lens = torch.ones(n, dtype=torch.int32, device=dev)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self._scratch_table_row = np.full(self.width, -1, dtype=np.int32)
        self._scratch_table_row[0] = scratch_block
        for _ in self.inputs.hosts:  # both hold the same
            self._fill_idle_inputs(n, 0)

    def _fill_idle_inputs(self, rows: int, context: int) -> None:
        # every row a padding row: token 0 at position 0 in the scratch block
        n = self.buckets[-1]
        h = self.inputs.next_host()
        h["input_ids"][:] = h["positions"][:] = 0
        h["slot_mapping"][:] = self.scratch_slot
        h["sources"][:] = n + np.arange(n)
        h["context_lens"][:] = 1
        h["block_tables"][:] = self._scratch_table_row
        self.inputs.upload()

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
        h = self.inputs.next_host()
        ids, positions, slots, sources = (h["input_ids"], h["positions"], h["slot_mapping"],
                                          h["sources"])
        tables = h["block_tables"]
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
        h["context_lens"][:b] = ctx
        # padding rows write and read the scratch block
        ids[b:bucket], positions[b:bucket], slots[b:bucket] = 0, 0, self.scratch_slot
        sources[b:bucket] = n + np.arange(b, bucket)
        h["context_lens"][b:bucket] = 1
        self.inputs.upload()
        return self._replay(bucket, int(ctx.max()))[:b]

    def _keys(self) -> list[tuple[int, int]]:
        return [(b, c) for b in self.buckets for c in context_buckets(self.max_model_len)]

    def _batch(self, bucket: int, context: int) -> AttentionBatch:
        d = self.inputs.device
        return AttentionBatch(
            q_lens=self.q_lens[:bucket], cu_q_lens=self.cu_q_lens[:bucket + 1],
            context_lens=d["context_lens"][:bucket], block_tables=d["block_tables"][:bucket],
            slot_mapping=d["slot_mapping"][:bucket], positions=d["positions"][:bucket],
            q_lens_host=[1] * bucket, context_lens_host=[context] * bucket,
            max_q_len=1, max_context_len=context)

    def _forward(self, bucket: int, batch: AttentionBatch,
                 out: Optional[torch.Tensor]) -> torch.Tensor:
        d = self.inputs.device
        ids = torch.cat([self.prev_tokens, d["input_ids"]])[d["sources"][:bucket]]
        # every row's logits are kept: a slice, so no gather kernel
        return self.model.forward(ids, batch, self.kv_cache, slice(None), out)


def fill_prefill_inputs(h: dict[str, np.ndarray], input_ids: list[int], context_len: int,
                        block_table: np.ndarray, bucket: int, block_size: int,
                        scratch_block: int) -> int:
    """PrefillGraphs' host inputs for one sequence's new tokens `input_ids`
    (ending at position context_len - 1) padded to `bucket` rows: the padding
    rows take the next positions, write the scratch block's first slot, and
    the block table's missing columns are the scratch block. Returns the
    context the padded rows make."""
    q = len(input_ids)
    start = context_len - q
    padded = start + bucket
    table = h["block_tables"][0]
    cols = min(len(block_table), len(table))
    table[:cols] = block_table[:cols]
    table[cols:] = -1
    table[table < 0] = scratch_block
    positions = np.arange(start, padded)
    h["input_ids"][:q] = input_ids
    h["input_ids"][q:bucket] = 0
    h["positions"][:bucket] = positions
    slots = h["slot_mapping"]
    slots[:q] = table[positions[:q] // block_size].astype(np.int64) * block_size \
        + positions[:q] % block_size
    slots[q:bucket] = scratch_block * block_size
    h["logits_row"][0] = q - 1
    h["q_lens"][0] = bucket
    h["cu_q_lens"][:] = (0, bucket)
    h["context_lens"][0] = padded
    return padded


class PrefillGraphs(_Graphs):
    """A lone sequence's prefill of 2..max_tokens new tokens (a fresh short
    prompt, a chat turn on a resident session), by (token bucket, context
    bucket). The new tokens are padded up to their bucket with rows at the
    positions after them, which write the scratch block and whose outputs
    are dropped (causal attention: no real row sees them); the sequence's
    context counts them, and its block table is completed with the scratch
    block for the keys only they read. The logits are the last real row's.

    Not bit-identical to the eager prefill (the matrix products run on the
    padded row count, whose kernel choice may differ), so deterministic mode
    does not use them."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_tokens: int,
                 max_model_len: int, scratch_block: int):
        super().__init__(model, kv_cache, max_model_len, logit_rows=1)
        self.buckets = prefill_buckets(max_tokens)
        self.scratch_block = scratch_block
        self.replays = 0
        n = self.buckets[-1]
        i64, i32 = torch.int64, torch.int32
        self.inputs = GraphInputs({"input_ids": (i64, (n,)), "positions": (i64, (n,)),
                                   "slot_mapping": (i64, (n,)), "logits_row": (i64, (1,)),
                                   "q_lens": (i32, (1,)), "cu_q_lens": (i32, (2,)),
                                   "context_lens": (i32, (1,)),
                                   "block_tables": (i32, (1, self.width))}, model.device)

    def fits(self, q_lens: list[int], ctx_lens: list[int]) -> bool:
        if len(q_lens) != 1 or not self.buckets or not 2 <= q_lens[0] <= self.buckets[-1]:
            return False
        bucket = self.buckets[bisect.bisect_left(self.buckets, q_lens[0])]
        return ctx_lens[0] - q_lens[0] + bucket <= self.max_model_len

    def run(self, input_ids: list[int], context_len: int, block_table: np.ndarray) -> torch.Tensor:
        """The new tokens input_ids end at position context_len - 1;
        block_table: the sequence's blocks (>= needed columns, -1 padded).
        Returns the last token's logits, [1, V]."""
        q = len(input_ids)
        bucket = self.buckets[bisect.bisect_left(self.buckets, q)]
        padded = fill_prefill_inputs(self.inputs.next_host(), input_ids, context_len, block_table,
                                     bucket, self.block_size, self.scratch_block)
        self.inputs.upload()
        self.replays += 1
        return self._replay(bucket, padded)

    def _keys(self) -> list[tuple[int, int]]:
        # the padded rows count in the context: a bucket's context is at least its rows
        return [(b, c) for b in self.buckets for c in context_buckets(self.max_model_len)
                if c >= b]

    def _fill_idle_inputs(self, rows: int, context: int) -> None:
        # one token at position 0 padded to the bucket, every block the scratch one
        fill_prefill_inputs(self.inputs.next_host(), [0], 1, np.full(1, -1, dtype=np.int32),
                            rows, self.block_size, self.scratch_block)
        self.inputs.upload()

    def _batch(self, bucket: int, context: int) -> AttentionBatch:
        d = self.inputs.device
        return AttentionBatch(
            q_lens=d["q_lens"], cu_q_lens=d["cu_q_lens"], context_lens=d["context_lens"],
            block_tables=d["block_tables"], slot_mapping=d["slot_mapping"][:bucket],
            positions=d["positions"][:bucket], q_lens_host=[bucket],
            context_lens_host=[context], max_q_len=bucket, max_context_len=context)

    def _forward(self, bucket: int, batch: AttentionBatch,
                 out: Optional[torch.Tensor]) -> torch.Tensor:
        d = self.inputs.device
        return self.model.forward(d["input_ids"][:bucket], batch, self.kv_cache, d["logits_row"],
                                  out)


class MixedGraphs:
    """Steps no other graph takes (prefill chunks beside decode rows, several
    prompts at once) of up to max_tokens new tokens, as captured pieces by
    token bucket: the embedding and layer 0's attention input, then per layer
    what follows its attention up to the next layer's attention input
    (LlamaModel.after_attention). Attention itself runs between the replays,
    launched as usual over the step's real rows: its plan depends on the
    step's sequences, the pieces only on the token count. A step then costs
    the host 2 launches a layer instead of a dozen.

    The pieces read and write static buffers (ids, positions, slots, the
    residual stream, the queries, attention's output); rows past the step's
    tokens are padding that writes the scratch block, and no real row reads
    them (no product mixes rows; attention only reads the real rows). As
    PrefillGraphs, not bit-identical to the eager forward (the products run
    on the padded row count), so not in deterministic mode."""

    def __init__(self, model: LlamaModel, kv_cache: PagedKVCache, max_tokens: int,
                 scratch_block: int):
        self.model = model
        self.kv_cache = kv_cache
        self.buckets = prefill_buckets(max_tokens)
        self.scratch_slot = scratch_block * kv_cache.block_size
        n, dev, cfg = self.buckets[-1], model.device, model.config
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), self.scratch_slot, dtype=torch.int64, device=dev)
        self.residual = torch.zeros((n, cfg.hidden_size), dtype=model.dtype, device=dev)
        heads = (model.num_heads, cfg.head_dim)
        self.q = torch.zeros((n, *heads), dtype=model.dtype, device=dev)
        self.attn = torch.zeros((n, *heads), dtype=model.dtype, device=dev)
        self._graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self._pool = None  # the pieces' memory pool, made at the first capture
        self.capture_seconds = 0.0
        self.replays = 0

    @property
    def captured(self) -> int:
        return sum(len(pieces) for pieces in self._graphs.values())

    def fits(self, num_tokens: int) -> bool:
        return bool(self.buckets) and 0 < num_tokens <= self.buckets[-1]

    def release(self) -> None:
        self._graphs.clear()
        self._pool = None

    def capture_all(self) -> None:
        for bucket in reversed(self.buckets):  # the largest first: its memory serves the rest
            self._pieces(bucket)

    @torch.inference_mode()
    def run(self, input_ids: torch.Tensor, batch: AttentionBatch,
            logits_indices: torch.Tensor) -> torch.Tensor:
        """The step's forward: input_ids [T] and batch as model.forward takes
        them; float32 logits of the rows in logits_indices."""
        t = input_ids.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, t)]
        pieces = self._pieces(bucket)  # a capture, if any, before the inputs are in place
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(batch.positions)
        self.slot_mapping[:t].copy_(batch.slot_mapping)
        self.slot_mapping[t:bucket].fill_(self.scratch_slot)
        model, q, attn = self.model, self.q[:t], self.attn[:t]
        pieces[0].replay()
        for i, layer_kv in enumerate(self.kv_cache.layers):
            model.ops.paged_attention(q, layer_kv, batch, model.scale, out=attn)
            pieces[i + 1].replay()
        self.replays += 1
        return model.logits(self.residual[:t], logits_indices)

    def _piece(self, bucket: int, i: int) -> None:
        """Piece i of a bucket's step: i = 0 the embedding and layer 0's
        attention input, i > 0 layer i - 1's after_attention."""
        model, kv = self.model, self.kv_cache
        residual, q = self.residual[:bucket], self.q[:bucket]
        positions, slots = self.positions[:bucket], self.slot_mapping[:bucket]
        if i == 0:
            torch.index_select(model.embed, 0, self.input_ids[:bucket], out=residual)
            model.attention_input(0, residual, positions, slots, kv, out=q)
        else:
            model.after_attention(i - 1, residual, self.attn[:bucket], positions, slots, kv,
                                  q_out=q)

    def _pieces(self, bucket: int) -> list[torch.cuda.CUDAGraph]:
        pieces = self._graphs.get(bucket)
        if pieces is None:
            t0 = time.perf_counter()
            # Captured over padding only: every row writes the scratch block.
            self.slot_mapping[:bucket].fill_(self.scratch_slot)
            pieces = self._graphs[bucket] = self._capture(bucket)
            self.capture_seconds += time.perf_counter() - t0
        return pieces

    @torch.inference_mode()
    def _capture(self, bucket: int) -> list[torch.cuda.CUDAGraph]:
        """The bucket's pieces, each warmed up on a side stream (lazy
        allocations, cuBLAS handles), then captured, all into one pool: a
        piece's temporaries are dead once it ends, and its outputs are the
        static buffers."""
        dev = self.model.device
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        count = len(self.kv_cache.layers) + 1
        warmed_up(dev, lambda: [self._piece(bucket, i) for i in range(count)])
        pieces = []
        for i in range(count):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                self._piece(bucket, i)
            pieces.append(graph)
        return pieces
