"""The model runner: the one owner of tensors.

It builds the model (this rank's slice under tensor parallelism), the paged
KV pool and the decode graphs, and runs the forward step. The same code runs
on every rank: rank 0's engine calls `launch` (forward, then sampling), the
other ranks call `forward` with the inputs rank 0 announced (engine/ranks.py).
The engine above it holds no tensors: it hands a step over as `StepInputs`
(plain ints) and reads the sampled tokens back as ints."""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import time
import weakref
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from ..model.cuda_graphs import DecodeGraphs, MixedGraphs, PrefillGraphs, graphs_supported
from ..model.kv_cache import PagedKVCache, resolve_kv_dtype
from ..model.llama import LlamaModel, parse_dtype
from ..model.ops import AttentionBatch
from ..model.ops.attention_batch import to_device
from ..model.parallel import TensorParallel, device_for
from ..model.sampler import sample
from ..model.weights import Checkpoint, load_checkpoint
from .config import EngineConfig

log = logging.getLogger("turbomq.engine")

CPU_KV_BYTES_DEFAULT = 1 << 30  # pool cap on CPU when num_kv_blocks is not given
# Greedy steps over vocabulary-split logits reduce the ranks' argmax
# (StepInputs.greedy); TURBOMQ_TP_GREEDY_ARGMAX=0 gathers the logits for
# them too, as for sampled steps (A/B runs: benchmarks/gpu_tensor_parallel.py).
GREEDY_ARGMAX = os.environ.get("TURBOMQ_TP_GREEDY_ARGMAX", "1") != "0"


def host_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor whose pages are all faulted in, by up to 16
    threads at once (one thread faults in a few GB a second)."""
    t = torch.empty(shape, dtype=dtype)
    flat = t.view(-1).view(torch.uint8)
    parts = max(1, min(16, os.cpu_count() or 1, flat.numel()))
    with concurrent.futures.ThreadPoolExecutor(parts) as pool:  # torch frees the GIL
        list(pool.map(torch.Tensor.zero_, flat.chunk(parts)))
    return t


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed host tensor of page-locked memory, exactly its size. Not
    `pin_memory=True`: torch's pinned allocator rounds a request up to a
    power of two (a 24 GiB tier locked 32) and locks the pages as it faults
    them in (22.0 s for it on an H200 host). Here the pages are faulted in
    first (`host_zeros`) and the range registered with the driver: 7.7 s
    (docs/kv_cache.md, "Host-RAM tier")."""
    t = host_zeros(shape, dtype)
    nbytes = t.numel() * t.element_size()
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(status) != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {status}")
    weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    return t


@dataclass
class StepInputs:
    """One forward's inputs, host side; rank 0 sends them to the other ranks."""
    ids: list[int]  # new tokens, flattened sequence by sequence
    q_lens: list[int]  # new tokens per sequence
    ctx_lens: list[int]  # KV length per sequence after this step
    tables: np.ndarray  # [sequences, width] block tables, -1 padded
    graphed: bool  # a decode step that a captured graph runs
    # Row i >= 0 (a decode row) takes its input token from row prev_rows[i]
    # of the previous step's sampled tokens, still on the device (every rank
    # holds them: rank 0 broadcasts what it samples, or, greedy, every rank
    # takes the same argmax).
    prev_rows: Optional[list[int]] = None
    sampled: int = 0  # rows whose next token rank 0 samples in this step
    # Every sampled row is greedy without a repetition penalty: the token is
    # the argmax of its logits, so vocabulary-split ranks reduce their
    # argmax instead of gathering the logits, and each takes the tokens itself.
    greedy: bool = False


@dataclass(eq=False)
class SampledTokens:
    """A launched step's sampled tokens, on their way to the host."""
    tokens: torch.Tensor  # on the host once `ready` has passed
    ready: Optional[torch.cuda.Event]  # None: already on the host

    def read(self) -> list[int]:
        if self.ready is not None:
            self.ready.synchronize()
        return self.tokens.tolist()


class LoadTicket:
    """When blocks loaded from host RAM are in the pool: `done()` asks without
    waiting; `order()` makes the compute stream wait for them (before a
    forward that reads them, or reuses their blocks); `wait()` blocks the
    host. Copies that ran synchronously (no CUDA) are done at once."""

    def __init__(self, event: Optional["torch.cuda.Event"],
                 compute: Optional["torch.cuda.Stream"]) -> None:
        self._event, self._compute = event, compute

    def done(self) -> bool:
        return self._event is None or self._event.query()

    def order(self) -> None:
        if self._event is not None:
            self._compute.wait_event(self._event)

    def wait(self) -> None:
        if self._event is not None:
            self._event.synchronize()


class ModelRunner:
    def __init__(self, config: EngineConfig, tp: Optional[TensorParallel] = None,
                 checkpoint: Optional[Checkpoint] = None, model: Optional[LlamaModel] = None):
        """`model` injects an already built model (benchmarks with random
        weights); otherwise this rank's part is built from `checkpoint`, or
        loaded from `config.model`."""
        self.config = config
        self.device = device_for(config.device, tp.rank if tp is not None else 0)
        if model is None:
            checkpoint = checkpoint or load_checkpoint(config.model)
            dtype = (parse_dtype(config.dtype) if config.dtype
                     else checkpoint.gpu_dtype if self.device.type == "cuda" else None)
            model = LlamaModel(checkpoint.config, checkpoint.tensors, self.device, dtype, tp=tp,
                               deterministic=config.deterministic,
                               quantization=config.quantization)
            del checkpoint
        self.model = model
        self.tp = tp
        # Vocabulary-split logits: this runner gathers them itself, after the
        # forward (graphs included), and only for steps that sample; greedy
        # steps take the ranks' argmax instead (TensorParallel.argmax_columns).
        model.defer_gather = model.gather_logits
        mc = model.config
        self.max_model_len = min(config.max_model_len or mc.max_position_embeddings,
                                 mc.max_position_embeddings)
        self.kv_dtype = resolve_kv_dtype(config.kv_dtype, model.dtype)
        self.kv_cache: Optional[PagedKVCache] = None
        self.host_kv: Optional[torch.Tensor] = None  # the host-RAM tier, if any
        self.host_scales: Optional[torch.Tensor] = None
        # CUDA: a copy stream per direction, and each one's last copies
        self._copy_streams: dict[str, "torch.cuda.Stream"] = {}
        self._copied: dict[str, Optional["torch.cuda.Event"]] = {"out": None, "in": None}
        self.graphs: Optional[DecodeGraphs] = None
        self.prefill_graphs: Optional[PrefillGraphs] = None
        self.mixed_graphs: Optional[MixedGraphs] = None
        # Two pinned buffers for sampled tokens, one per step in flight.
        self._token_buffers = ([torch.empty(config.max_batch_size, dtype=torch.long,
                                            pin_memory=True) for _ in range(2)]
                               if self.device.type == "cuda" else [])
        self._token_turn = 0
        self._last_sampled = torch.empty(0, dtype=torch.long, device=self.device)

    # ------------------------------------------------------------ the pool
    def kv_blocks_that_fit(self) -> int:
        """Blocks of the KV pool: the configured count, or what memory allows."""
        cfg, mc = self.config, self.model.config
        if cfg.num_kv_blocks is not None:
            if cfg.num_kv_blocks < 1:
                raise ValueError("num_kv_blocks must be >= 1")
            return cfg.num_kv_blocks
        per_block = PagedKVCache.bytes_per_block(mc.num_layers, cfg.block_size,
                                                 self.model.num_kv_heads, mc.head_dim,
                                                 self.kv_dtype)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * cfg.kv_cache_fraction)
        else:
            want = cfg.max_batch_size * self.max_model_len * per_block // cfg.block_size
            budget = min(want + per_block, CPU_KV_BYTES_DEFAULT)
        return max(budget // per_block, 1)

    def allocate_kv(self, num_blocks: int) -> None:
        """The pool of `num_blocks` blocks plus one, owned by no sequence,
        that absorbs the padding rows of decode graphs; then the graphs."""
        cfg, mc = self.config, self.model.config
        self.kv_cache = PagedKVCache(mc.num_layers, num_blocks + 1, cfg.block_size,
                                     self.model.num_kv_heads, mc.head_dim, self.kv_dtype,
                                     self.device)
        if cfg.cuda_graphs and graphs_supported(self.model, self.kv_cache):
            self.graphs = DecodeGraphs(self.model, self.kv_cache, cfg.max_batch_size,
                                       self.max_model_len, scratch_block=num_blocks)
            # Not in deterministic mode (docs/determinism.md).
            if cfg.prefill_graph_tokens > 0 and not cfg.deterministic:
                self.prefill_graphs = PrefillGraphs(self.model, self.kv_cache,
                                                    cfg.prefill_graph_tokens,
                                                    self.max_model_len, scratch_block=num_blocks)
            if cfg.mixed_graph_tokens > 0 and not cfg.deterministic:
                tokens = min(cfg.mixed_graph_tokens, cfg.max_num_batched_tokens)
                self.mixed_graphs = MixedGraphs(self.model, self.kv_cache, tokens,
                                                scratch_block=num_blocks)
            if cfg.graphs_at_start:
                self.capture_graphs()
        log.info("KV pool: %d blocks of %d tokens = %d tokens (%s, %.2f GiB)", num_blocks,
                 cfg.block_size, num_blocks * cfg.block_size, self.kv_dtype,
                 self.kv_cache.nbytes / 2**30)

    def capture_graphs(self) -> None:
        """Every bucket's decode, prefill and mixed-step graphs, captured now."""
        t0 = time.perf_counter()
        held = [g for g in (self.graphs, self.prefill_graphs, self.mixed_graphs)
                if g is not None]
        for graphs in held:
            graphs.capture_all()
        log.info("CUDA graphs: %d captured in %.1f s", sum(g.captured for g in held),
                 time.perf_counter() - t0)

    def host_kv_blocks_default(self) -> int:
        """A quarter of the available RAM, at most 4x the GPU pool, on CUDA;
        none on the CPU (its pool is host RAM already)."""
        if self.device.type != "cuda" or self.kv_cache is None:
            return 0
        try:
            with open("/proc/meminfo") as f:
                info = dict(line.split(":", 1) for line in f)
            available = int(info["MemAvailable"].split()[0]) * 1024
        except (OSError, KeyError, ValueError):
            return 0
        per_block = self.kv_cache.nbytes // self.kv_cache.num_blocks
        return min(available // 4 // per_block, 4 * self.kv_cache.num_blocks)

    def allocate_host_kv(self, num_blocks: int) -> None:
        """Host memory for `num_blocks` blocks, one contiguous slot per block
        (all layers, K and V), pinned on CUDA: each copy is then one
        asynchronous DMA at full PCIe speed."""
        kv, pin = self.kv_cache, self.device.type == "cuda"

        def slots_like(pool: torch.Tensor) -> torch.Tensor:
            shape = (num_blocks, pool.shape[0], pool.shape[1], *pool.shape[3:])
            return pinned_zeros(shape, pool.dtype) if pin else torch.empty(shape, dtype=pool.dtype)

        if pin:
            self._copy_streams = {d: torch.cuda.Stream(self.device) for d in ("out", "in")}
        self.host_kv = slots_like(kv.data)
        self.host_scales = slots_like(kv.scales) if kv.scales is not None else None
        log.info("host KV tier: %d blocks (%.2f GiB%s)", num_blocks,
                 self.host_kv.nbytes / 2**30, ", pinned" if pin else "")

    def move_blocks(self, spills: Sequence[tuple[int, int]],
                    loads: Sequence[tuple[int, int]]) -> tuple[int, "LoadTicket"]:
        """Copy (GPU block, host slot) pairs out, then (host slot, GPU block)
        pairs in. Returns the bytes moved and a ticket that says when the
        loaded blocks are in the pool.

        On CUDA the PCIe copies run on two copy streams, beside the compute,
        and nothing here waits for the GPU. A spill gathers its blocks into a
        staging buffer on the compute stream (so the forward may overwrite
        them at once) and copies that to host RAM in the background. A load
        copies into a staging buffer and scatters it into the pool on the
        "in" stream, after the compute queued so far (a block freed by a
        sequence still in the forward in flight, or gathered by this step's
        spill, is not overwritten early); the compute stream does not wait
        for it: the blocks' sequence joins a later step, once the ticket is
        done. Each direction waits for the other's previous copies, because
        a slot emptied by a load may be refilled by a later spill."""
        kv, moved = self.kv_cache, 0
        planes = [(kv.data, self.host_kv)]
        if kv.scales is not None:
            planes.append((kv.scales, self.host_scales))
        streams = self._copy_streams
        compute = torch.cuda.current_stream(self.device) if streams else None
        # What each direction waits for: the other's copies of earlier steps.
        # (A slot spilled this step is not loaded this step, and one loaded
        # this step is not refilled before the next.)
        before = dict(self._copied)
        for pool, host in planes:
            if spills:
                blocks = to_device([b for b, _ in spills], torch.long, self.device)
                staged = pool.index_select(2, blocks).movedim(2, 0).contiguous()
                with self._on_copy_stream("out", before["in"], compute, staged):
                    for i, (_, slot) in enumerate(spills):
                        host[slot].copy_(staged[i], non_blocking=True)
                moved += staged.nbytes
            if loads:
                with self._on_copy_stream("in", before["out"], compute, None):
                    staged = torch.empty((len(loads), *host.shape[1:]), dtype=host.dtype,
                                         device=self.device)
                    for i, (slot, _) in enumerate(loads):
                        staged[i].copy_(host[slot], non_blocking=True)
                    blocks = to_device([b for _, b in loads], torch.long, self.device)
                    pool[:, :, blocks] = staged.movedim(0, 2)
                moved += staged.nbytes
        return moved, LoadTicket(self._copied["in"] if loads and streams else None, compute)

    @contextlib.contextmanager
    def _on_copy_stream(self, direction: str, wait: Optional["torch.cuda.Event"],
                        after: Optional["torch.cuda.Stream"], staged: Optional[torch.Tensor]):
        """Run the body's copies on `direction`'s copy stream (CUDA), after
        `wait` and after `after`'s work so far, and record when they are done.
        Elsewhere: just run them."""
        if not self._copy_streams:
            yield
            return
        stream = self._copy_streams[direction]
        if wait is not None:
            stream.wait_event(wait)
        if after is not None:
            stream.wait_stream(after)
        with torch.cuda.stream(stream):
            yield
        if staged is not None:
            staged.record_stream(stream)  # not reused before the copy has read it
        self._copied[direction] = torch.cuda.Event()
        self._copied[direction].record(stream)

    def release_graphs(self) -> None:
        """Free captured graphs (before a tensor-parallel group goes: NCCL's
        teardown waits for graphs that still hold its collectives)."""
        if self.graphs is None:
            return
        self.graphs.release()
        for graphs in (self.prefill_graphs, self.mixed_graphs):  # only beside decode graphs
            if graphs is not None:
                graphs.release()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        """Give back every tensor: graphs (and their memory pool), the KV pool,
        the weights, the token buffers. The runner is done."""
        if self.model is None:
            return
        self.release_graphs()
        self.graphs = self.prefill_graphs = self.mixed_graphs = None
        self.kv_cache = self.model = None
        self.host_kv = self.host_scales = None
        self._token_buffers = []
        self._last_sampled = None  # the last step's tokens, kept for the next step
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the allocator's cache too, back to the driver

    # ------------------------------------------------------------ steps
    def graphable(self, batch_size: int, max_context: int) -> bool:
        """Whether a decode step of this shape can replay a captured graph."""
        return self.graphs is not None and self.graphs.fits(batch_size, max_context)

    def forward(self, step: StepInputs, rows: Optional[Sequence[int]] = None) -> torch.Tensor:
        """Run one step's forward; logits of the sequences in `rows` (their
        last new token); `rows` None: the other ranks, whose logits are
        dropped."""
        if step.graphed:  # decode-only: every row's logits
            return self.graphs.run(step.ids, step.ctx_lens, step.tables, step.prev_rows)
        # One sequence's prefill (every rank takes the same decision, from
        # the same inputs): the last token's logits.
        if (self.prefill_graphs is not None and step.prev_rows is None
                and self.prefill_graphs.fits(step.q_lens, step.ctx_lens)):
            return self.prefill_graphs.run(step.ids, step.ctx_lens[0], step.tables[0])
        # Every input reaches the device without waiting for it, so this
        # forward is queued behind the step in flight.
        batch = AttentionBatch.build(step.q_lens, step.ctx_lens, step.tables,
                                     self.config.block_size, self.device)
        input_ids = to_device(step.ids, torch.long, self.device)
        ends = np.cumsum(step.q_lens) - 1  # each row's last new token
        if step.prev_rows is not None:  # decode rows whose input is in flight
            rows_in_flight = [r for r, src in enumerate(step.prev_rows) if src >= 0]
            input_ids.index_copy_(0, to_device(ends[rows_in_flight], torch.long, self.device),
                                  self._last_sampled.index_select(0, to_device(
                                      [step.prev_rows[r] for r in rows_in_flight], torch.long,
                                      self.device)))
        if rows is None:
            # another rank: as many rows as rank 0 where the logits are
            # gathered over the ranks (their values are dropped), else none
            count = max(step.sampled, 1) if self.model.gather_logits else 0
            picked = to_device(ends[:count], torch.long, self.device)
        else:
            picked = to_device(ends[list(rows)] if rows else ends[:1], torch.long, self.device)
        if self.mixed_graphs is not None and self.mixed_graphs.fits(len(step.ids)):
            return self.mixed_graphs.run(input_ids, batch, picked)
        return self.model.forward(input_ids, batch, self.kv_cache, picked)

    @staticmethod
    def greedy_step(params: Sequence) -> bool:
        """StepInputs.greedy for a step sampling rows with these SamplingParams."""
        return GREEDY_ARGMAX and all(p.is_greedy and p.repetition_penalty == 1.0 for p in params)

    def follow(self, step: StepInputs) -> None:
        """Ranks > 0: run the forward rank 0 announced, then take the tokens
        it sampled (device to device), which the next step may read."""
        logits = self.forward(step)
        if not step.sampled:
            return
        if self.model.defer_gather and step.greedy:
            self._keep_sampled(self.tp.argmax_columns(logits))
            return
        if self.model.defer_gather:
            self.tp.all_gather_columns(logits)  # for rank 0's sampling
        tokens = torch.empty(step.sampled, dtype=torch.long, device=self.device)
        self.tp.broadcast(tokens)
        self._keep_sampled(tokens)

    def _keep_sampled(self, tokens: torch.Tensor) -> None:
        """The step's sampled tokens stay on the device for the next step (and
        where a decode graph reads them), on every rank: no rank waits for
        the host to hand them back."""
        self._last_sampled = tokens
        if self.graphs is not None:
            self.graphs.prev_tokens[:len(tokens)].copy_(tokens)

    def launch(self, step: StepInputs, rows: Sequence[int], params: Sequence,
               rngs: Sequence, histories: Sequence[Sequence[int]]) -> SampledTokens:
        """Queue the forward and the sampling of the sequences in `rows` on the
        device (one SamplingParams, SeedRNG and token history each)."""
        logits = self.forward(step, rows)
        if not rows:
            return SampledTokens(torch.empty(0, dtype=torch.long), None)
        if self.model.defer_gather and step.greedy:  # every rank takes the same tokens
            tokens = self.tp.argmax_columns(logits)
        else:
            if self.model.defer_gather:
                logits = self.tp.all_gather_columns(logits)
            tokens = sample(logits, params, rngs, histories)
            if self.tp is not None:  # the other ranks receive them in follow()
                self.tp.broadcast(tokens)
        self._keep_sampled(tokens)
        if self.device.type != "cuda":
            return SampledTokens(tokens, None)
        # Pinned, so the copy is asynchronous (into pageable memory it would
        # wait for this very step).
        host = self._token_buffers[self._token_turn][:len(rows)]
        self._token_turn ^= 1
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return SampledTokens(host, ready)
