"""Tensor parallelism, the model's side: the process group and each rank's
slice of the weights.

Each rank holds a slice of every layer: its share of the attention heads (q,
k, v rows; the matching o columns), and of the FFN (gate and up rows; the
matching down columns). The o and down projections then yield partial sums,
which one all-reduce per projection completes. The lm_head is split by
vocabulary rows where the ranks divide it (each rank's logits gathered:
every rank then reads half the head's weights a step, 0.5 GB for a 128k
vocabulary); the embedding and norms are replicated. Every rank keeps the
KV of its own KV heads in a pool of the same number of blocks, so one block
table serves all ranks.

Starting the ranks and telling them each step's inputs is the engine's side
(engine/ranks.py). docs/engine.md, Tensor parallel.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from .config import ModelConfig
from .ops import cuda as cuda_ops
from .sampler import argmax_rows

# A rank that waits longer than this on a collective gives up: a peer died.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)

# All-reduces of at most this many bytes (8 KiB a row at 4096 wide: decode
# batches and steps of up to 2048 tokens, the engine's default step budget)
# go through peer memory in one kernel; larger ones through NCCL. Alone the
# peer kernel is faster at every size on 2 x H200 (docs/benchmarks/
# all_reduce.md: 33.7 against 58.2 us at 1024 rows, 240.6 against 325.6 at
# 8192). Offline at 512 slots and 4000 requests, 16 MiB against 8 MiB gave
# 20,179 against 19,910 output tok/s on one machine (steps with prefill
# 25.17 against 25.57 ms; docs/benchmarks/tensor_parallel.md), while taking
# 8192-token chunks' messages up to 64 MiB was slower (at a budget of 8192).
# Every rank's buffer holds two halves of this per rank.
# TURBOMQ_PEER_ALL_REDUCE_BYTES overrides; 0 turns it off.
PEER_ALL_REDUCE_BYTES_DEFAULT = 16 << 20
PEER_ALL_REDUCE_BYTES = int(os.environ.get("TURBOMQ_PEER_ALL_REDUCE_BYTES",
                                           str(PEER_ALL_REDUCE_BYTES_DEFAULT)))
# Each rank pushes its partial sums into every peer's buffer (1, the
# default) or reads the peers' from theirs (0): native/cuda/all_reduce.cu.
PEER_ALL_REDUCE_PUSH = os.environ.get("TURBOMQ_PEER_ALL_REDUCE_PUSH", "1") != "0"
# All-reduces of at most this many bytes (decode batches of up to 16 rows at
# 4096 wide: where it beat pushing on 2 x H200, docs/benchmarks/all_reduce.md)
# take the low-latency kernel: the data and the call number in
# every 16-byte line pushed, no flag barrier (native/cuda/all_reduce.cu;
# at most ALL_REDUCE_LL_MAX_BYTES). TURBOMQ_PEER_ALL_REDUCE_LL_BYTES
# overrides; 0 turns it off.
PEER_ALL_REDUCE_LL_BYTES_DEFAULT = 128 << 10
PEER_ALL_REDUCE_LL_BYTES = int(os.environ.get("TURBOMQ_PEER_ALL_REDUCE_LL_BYTES",
                                              str(PEER_ALL_REDUCE_LL_BYTES_DEFAULT)))


# all_gather_into_tensor's newer name (torch >= 2.13 warns on the old one).
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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


def vocab_parallel(config: ModelConfig, size: int) -> bool:
    """Whether the lm_head is split by vocabulary rows over `size` ranks."""
    return size > 1 and config.vocab_size % size == 0


def device_for(base: str, rank: int) -> torch.device:
    """Rank r's device: cuda:(N + r) from base cuda:N; cpu stays cpu."""
    dev = torch.device(base)
    if dev.type == "cuda":
        return torch.device("cuda", (dev.index or 0) + rank)
    return dev


def shard_weight(config: ModelConfig, name: str, w: torch.Tensor, rank: int,
                 size: int) -> torch.Tensor:
    """Rank `rank`'s slice (of `size`) of the internal tensor `name`; the
    embedding and norms are whole on every rank, the lm_head too where
    `size` does not divide the vocabulary."""
    r, n = rank, size
    if name == "lm_head.weight" and vocab_parallel(config, size):
        v = config.vocab_size // n
        return w[r * v:(r + 1) * v]
    kind = name.rsplit(".", 2)[-2] if name.startswith("layers.") else ""
    if name.endswith(".weight_scale") and kind in ("o", "down"):
        return w  # one scale per output row: the rows are whole on every rank
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
    """One rank's membership of the group and its collectives."""

    def __init__(self, config: ParallelConfig, device: torch.device):
        self.size, self.rank = config.size, config.rank
        backend = "nccl" if device.type == "cuda" else "gloo"
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend, init_method=config.init_method, world_size=self.size,
                                rank=self.rank, timeout=COLLECTIVE_TIMEOUT)
        # Host data (the IPC handles at start) travels over gloo whatever the device.
        self.host_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD
        self.peer = PeerAllReduce.open(self, device)

    def leave(self) -> None:
        if self.peer is not None:
            self.peer.close()
            self.peer = None
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> None:
        """t summed over the ranks, in place."""
        if self.peer is not None and self.peer.fits(t):
            self.peer.run(t)
        else:
            dist.all_reduce(t)

    def broadcast(self, t: torch.Tensor) -> None:
        """Rank 0's t to every rank, on the device (NCCL on CUDA)."""
        dist.broadcast(t, 0)

    def all_gather_columns(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, cols] on each rank -> [rows, ranks * cols], rank r's columns
        at r * cols (the vocabulary-split lm_head's logits)."""
        rows, cols = t.shape
        parts = torch.empty((self.size * rows, cols), dtype=t.dtype, device=t.device)
        if rows:  # every rank has the same rows (the step's inputs are rank 0's)
            _all_gather_single(parts, t.contiguous())
        return parts.view(self.size, rows, cols).transpose(0, 1).reshape(rows, self.size * cols)

    def argmax_columns(self, t: torch.Tensor) -> torch.Tensor:
        """argmax_rows(all_gather_columns(t)), int64 [rows] on every rank,
        without gathering t: each rank's first maximum and its value are
        gathered (8 bytes a row and rank, where the logits take 2 per
        vocabulary entry), and the largest value wins, ties to the lowest
        rank, hence to the lowest column, as argmax_rows breaks them."""
        rows, cols = t.shape
        if self.size * cols > 1 << 24:
            raise ValueError("argmax_columns: column ids must be exact in float32")
        local = argmax_rows(t)
        mine = torch.stack([t.gather(1, local[:, None])[:, 0].float(),
                            (local + self.rank * cols).float()], dim=1)
        parts = torch.empty((self.size * rows, 2), dtype=torch.float32, device=t.device)
        if rows:
            _all_gather_single(parts, mine)
        parts = parts.view(self.size, rows, 2)
        best = torch.argmax(parts[..., 0].transpose(0, 1), dim=1)  # first maximum: lowest rank
        return parts[..., 1].transpose(0, 1).gather(1, best[:, None])[:, 0].long()

    def all_reduce_into(self, residual: torch.Tensor, partial: torch.Tensor) -> None:
        """residual += partial summed over the ranks (the sum rounded first,
        as all_reduce then add_ round)."""
        if self.peer is not None and self.peer.fits(partial):
            self.peer.run(partial, residual)
        else:
            dist.all_reduce(partial)
            residual.add_(partial)


class PeerAllReduce:
    """The one-shot all-reduce of native/cuda/all_reduce.cu: this rank's
    buffer, shared with the peers through CUDA IPC, and theirs mapped here.
    Every rank takes the same path for the same message, since fits() looks
    only at its shape and dtype."""

    def __init__(self, own: int, buffers: list[int], rank: int, capacity: int):
        self.own, self.buffers, self.rank, self.capacity = own, buffers, rank, capacity

    @classmethod
    def open(cls, tp: "TensorParallel", device: torch.device) -> Optional["PeerAllReduce"]:
        """The all-reduce over peer memory where every rank's GPU reaches every
        other's (all ranks decide together, else None: NCCL only)."""
        capacity = PEER_ALL_REDUCE_BYTES // 16 * 16
        k = cuda_ops._k
        ok = (device.type == "cuda" and capacity > 0 and k is not None
              and hasattr(k, "all_reduce") and tp.size in (2, 4, 8)
              and all(torch.cuda.can_device_access_peer(device, torch.device("cuda", d))
                      for d in range(torch.cuda.device_count()) if d != device.index))
        if ok:
            k.set_all_reduce_push(PEER_ALL_REDUCE_PUSH)
            k.set_all_reduce_ll_bytes(PEER_ALL_REDUCE_LL_BYTES)
        own = k.all_reduce_buffer_alloc(capacity, tp.size) if ok else 0
        handles: list = [None] * tp.size
        dist.all_gather_object(handles, k.ipc_handle(own) if ok else None, group=tp.host_group)
        if not all(handles):
            if ok:
                k.all_reduce_buffer_free(own)
            return None
        buffers = [own if r == tp.rank else k.ipc_open(h) for r, h in enumerate(handles)]
        return cls(own, buffers, tp.rank, capacity)

    def fits(self, t: torch.Tensor) -> bool:
        return cuda_ops.all_reduce_fits(t, self.capacity)

    def run(self, t: torch.Tensor, residual: Optional[torch.Tensor] = None) -> None:
        cuda_ops.all_reduce_peer(t, self.buffers, self.rank, self.capacity, residual)

    def close(self) -> None:
        """Unmap the peers' buffers and free this one (no peer touches it
        any more: every rank is past its last step)."""
        k = cuda_ops._k
        torch.cuda.synchronize()
        for r, b in enumerate(self.buffers):
            if r != self.rank:
                k.ipc_close(b)
        k.all_reduce_buffer_free(self.own)
