"""Tensor parallelism: one process per device, rank 0 schedules.

Each rank holds a slice of every layer: its share of the attention heads (q,
k, v rows; the matching o columns), and of the FFN (gate and up rows; the
matching down columns). The o and down projections then yield partial sums,
which one all-reduce per projection completes. Embedding, norms and lm_head
are replicated. Every rank keeps the KV of its own KV heads in a pool of the
same number of blocks, so one block table serves all ranks.

Rank 0 runs the engine: scheduler, KV manager, sampling. For every forward
it broadcasts the step's inputs (token ids, query and context lengths, block
tables, whether a decode graph runs it) over a host-side group; the other
ranks (`follow`) run the same forward, eagerly or by replaying the same
captured graph (all-reduces inside), and discard the logits.
docs/engine.md, Tensor parallel.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from .config import ModelConfig

log = logging.getLogger("turbomq.parallel")

# A rank that waits longer than this on a collective gives up: a peer died.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

_STOP, _POOL, _FORWARD, _GRAPHED = 0, 1, 2, 3
_HEADER = 5  # kind, sequences, tokens, table width, pool blocks


@dataclass(frozen=True)
class ParallelConfig:
    size: int  # ranks (devices)
    rank: int
    init_method: str  # tcp://127.0.0.1:PORT, agreed by all ranks


def check_divisible(config: ModelConfig, size: int) -> None:
    for name, n in (("num_heads", config.num_heads), ("num_kv_heads", config.num_kv_heads),
                    ("intermediate_size", config.intermediate_size)):
        if n % size:
            raise ValueError(f"tensor parallel size {size} does not divide {name} = {n}")


def device_for(base: str, rank: int) -> torch.device:
    """Rank r's device: cuda:(N + r) from base cuda:N; cpu stays cpu."""
    dev = torch.device(base)
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank)
    return dev


def shard_weight(config: ModelConfig, name: str, w: torch.Tensor, rank: int,
                 size: int) -> torch.Tensor:
    """Rank `rank`'s slice (of `size`) of the internal tensor `name`; the
    embedding, norms and lm_head are whole on every rank."""
    r, n = rank, size
    kind = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
    if kind == "qkv":
        d = config.head_dim
        q, k, v = w.split([config.q_size, config.kv_size, config.kv_size])
        hq, hkv = config.num_heads // n * d, config.num_kv_heads // n * d
        return torch.cat([q[r * hq:(r + 1) * hq], k[r * hkv:(r + 1) * hkv],
                          v[r * hkv:(r + 1) * hkv]])
    if kind == "o":
        hq = config.q_size // n
        return w[:, r * hq:(r + 1) * hq]
    if kind == "gate_up":  # gate rows over up rows; the slice keeps that stacking
        f = config.intermediate_size // n
        gate, up = w.chunk(2)
        return torch.cat([gate[r * f:(r + 1) * f], up[r * f:(r + 1) * f]])
    if kind == "down":
        f = config.intermediate_size // n
        return w[:, r * f:(r + 1) * f]
    return w


class TensorParallel:
    """One rank's membership: its collectives and its slice of the weights."""

    def __init__(self, config: ParallelConfig, device: torch.device):
        self.size, self.rank = config.size, config.rank
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=config.init_method, world_size=self.size,
                                rank=self.rank, timeout=COLLECTIVE_TIMEOUT)
        # Step inputs are host data: they travel over gloo whatever the device.
        self._host = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD

        self.followers: list = []  # rank 0: the processes of ranks 1..

    def close(self) -> None:
        """Rank 0: stop the other ranks, wait for them, leave the group."""
        if self.rank == 0 and self.followers:
            try:
                self.send_stop()
            finally:
                for p in self.followers:
                    p.join(15)
                    if p.is_alive():
                        p.kill()
                self.followers = []
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)

    # -------------------------------------------------------- step inputs
    def send_step(self, ids: list[int], q_lens: list[int], ctx_lens: list[int],
                  tables: np.ndarray, graphed: bool) -> None:
        """Rank 0: the inputs of the forward it is about to run (`graphed`: as a
        decode graph replay, which the other ranks capture and replay alike)."""
        tables = np.asarray(tables, dtype=np.int64)
        header = torch.tensor([_GRAPHED if graphed else _FORWARD, len(q_lens), len(ids),
                               tables.shape[1], 0], dtype=torch.long)
        dist.broadcast(header, 0, group=self._host)
        body = torch.cat([torch.tensor(ids + q_lens + ctx_lens, dtype=torch.long),
                          torch.from_numpy(tables.reshape(-1))])
        dist.broadcast(body, 0, group=self._host)

    def send_pool(self, num_blocks: int) -> None:
        """Rank 0: how many blocks every pool holds."""
        header = torch.tensor([_POOL, 0, 0, 0, num_blocks], dtype=torch.long)
        dist.broadcast(header, 0, group=self._host)

    def send_stop(self) -> None:
        dist.broadcast(torch.tensor([_STOP, 0, 0, 0, 0], dtype=torch.long), 0, group=self._host)

    def receive(self) -> Optional[tuple]:
        """Ranks > 0: (ids, q_lens, ctx_lens, tables, graphed) of the next
        forward, an int (the pool's blocks), or None to stop."""
        header = torch.empty(_HEADER, dtype=torch.long)
        dist.broadcast(header, 0, group=self._host)
        kind, n, t, width, blocks = header.tolist()
        if kind == _STOP:
            return None
        if kind == _POOL:
            return blocks
        body = torch.empty(t + 2 * n + n * width, dtype=torch.long)
        dist.broadcast(body, 0, group=self._host)
        ids, q_lens, ctx_lens = body[:t], body[t:t + n].tolist(), body[t + n:t + 2 * n].tolist()
        tables = body[t + 2 * n:].reshape(n, width).numpy()
        return ids, q_lens, ctx_lens, tables, kind == _GRAPHED


def release_graphs(graphs) -> None:
    """Free captured graphs before the group goes: NCCL's teardown waits for
    graphs that still hold its collectives."""
    if graphs is not None:
        graphs.release()
        torch.cuda.synchronize()


def start(engine_config, model_config: ModelConfig) -> TensorParallel:
    """Rank 0, in the engine's process: start ranks 1.. (one process each,
    spawned) and form the group with them."""
    size = engine_config.tensor_parallel
    check_divisible(model_config, size)
    with socket.socket() as s:  # a free port for the group's rendezvous
        s.bind(("127.0.0.1", 0))
        init_method = f"tcp://127.0.0.1:{s.getsockname()[1]}"
    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked CUDA or threads
    followers = [ctx.Process(target=follow, args=(engine_config, r, init_method), daemon=True,
                             name=f"turbomq-rank{r}") for r in range(1, size)]
    for p in followers:
        p.start()
    try:
        tp = TensorParallel(ParallelConfig(size, 0, init_method),
                            device_for(engine_config.device, 0))
    except BaseException:
        for p in followers:
            p.kill()
        raise
    tp.followers = followers
    log.info("tensor parallel over %d ranks (%s)", size, engine_config.device)
    return tp


def follow(engine_config, rank: int, init_method: str) -> None:
    """Ranks > 0, in their own process: load this rank's slice, then run every
    forward rank 0 announces until it says stop."""
    from .cuda_graphs import DecodeGraphs, graphs_supported
    from .kv_cache import PagedKVCache, resolve_kv_dtype
    from .model import LlamaModel, parse_dtype
    from .ops import AttentionBatch
    from .weights import load_checkpoint

    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    device = device_for(engine_config.device, rank)
    tp = TensorParallel(ParallelConfig(engine_config.tensor_parallel, rank, init_method), device)
    graphs = None
    try:
        checkpoint = load_checkpoint(engine_config.model)
        dtype = parse_dtype(engine_config.dtype) if engine_config.dtype else None
        model = LlamaModel(checkpoint.config, checkpoint.tensors, device, dtype, tp=tp)
        del checkpoint
        num_blocks = tp.receive()
        if num_blocks is None:  # rank 0 gave up before sizing its pool
            return
        mc = model.config
        kv = PagedKVCache(mc.num_layers, num_blocks, engine_config.block_size, model.num_kv_heads,
                          mc.head_dim, resolve_kv_dtype(engine_config.kv_dtype, model.dtype), device)
        # The same graphs as rank 0's: it replays one exactly when rank 0 does.
        max_len = min(engine_config.max_model_len or mc.max_position_embeddings,
                      mc.max_position_embeddings)
        graphs = (DecodeGraphs(model, kv, engine_config.max_batch_size, max_len,
                               scratch_block=num_blocks - 1)
                  if engine_config.cuda_graphs and graphs_supported(model, kv) else None)
        no_logits = torch.empty(0, dtype=torch.long, device=device)
        while (step := tp.receive()) is not None:
            ids, q_lens, ctx_lens, tables, graphed = step
            if graphed:
                graphs.run(ids.tolist(), ctx_lens, tables)
                continue
            batch = AttentionBatch.build(q_lens, ctx_lens, tables, engine_config.block_size, device)
            model.forward(ids.to(device), batch, kv, no_logits)
    finally:
        release_graphs(graphs)
    # Gone without tearing the group down: rank 0 is done with it, and NCCL's
    # teardown may wait on what captured graphs held.
    logging.shutdown()
    os._exit(0)
