"""Tensor parallelism, the model's side: the process group and each rank's
slice of the weights.

Each rank holds a slice of every layer: its share of the attention heads (q,
k, v rows; the matching o columns), and of the FFN (gate and up rows; the
matching down columns). The o and down projections then yield partial sums,
which one all-reduce per projection completes. Embedding, norms and lm_head
are replicated. Every rank keeps the KV of its own KV heads in a pool of the
same number of blocks, so one block table serves all ranks.

Starting the ranks and telling them each step's inputs is the engine's side
(engine/ranks.py). docs/engine.md, Tensor parallel.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .config import ModelConfig

# A rank that waits longer than this on a collective gives up: a peer died.
COLLECTIVE_TIMEOUT = timedelta(seconds=120)


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
        # Host data (step inputs) travels over gloo whatever the device.
        self.host_group = dist.new_group(backend="gloo") if backend == "nccl" else dist.group.WORLD

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    def all_reduce(self, t: torch.Tensor) -> None:
        dist.all_reduce(t)
