"""Batch-invariant ops for deterministic mode (docs/determinism.md): the
op signatures the model calls, each row's result bit for bit independent
of the other rows in the step, of how many there are, and of whether its
token is computed in a prefill chunk or a decode step.

- linear: the batch-invariant GEMM (every output one float32 accumulation
  over K in increasing k; the same sums for one row or thousands, whatever
  the tile), with silu_mul or the
  residual add in the GEMM's store (on CUDA; bit for bit the separate
  kernel): the fused decode GEMVs reduce in another order than the GEMM, so
  a token would come out differently decoded than prefilled. The norm in
  front of a projection is folded (fold_norm): the norm weight multiplied
  into the projection's columns at load, and the row's rsqrt(mean(x^2) +
  eps) applied to its totals in the GEMM's store, its sum of squares in one
  fixed order (gemm_invariant.cu): no norm launch at decode. A projection
  whose weight is not folded takes the norm as a separate kernel;
- attention: the paged-attention kernel with a fixed split-K partition of
  PARTITION_KEYS keys, always combined (also when one partition would do:
  the combine normalizes a partition's output again). Partition boundaries
  then sit at fixed positions of the context, whatever the batch, and
  partitions are combined in index order; partitions and keys a row may not
  see add exact zeros. (The default plans the partition from the batch's
  grid and skips the combine when it can.)
- rms_norm, rotary, the KV write, silu_mul: one row or element at a time
  already. At decode (up to GEMM_INVARIANT_TRANSPOSED_MAX_ROWS rows, 16-bit
  pool) rotary and the KV write run in the qkv GEMM's store, with the
  separate kernel's roundings.

On the CPU the same structure runs on the reference ops."""

from __future__ import annotations

import os
from dataclasses import dataclass
from types import ModuleType
from typing import Optional

import torch

from .attention_batch import AttentionBatch
from .layer_kv import LayerKV

# Keys per split-K partition of attention: 128. Fewer keys spread a short
# context over more blocks at batch 1, more keys write and combine fewer
# partials in a full batch (H100, Llama-3-8B shape, one call: batch-1
# decode 0.925x of the default at 64, 0.913x at 128, 0.901x at 256; offline
# 0.746x, 0.821x, 0.837x). A long prefill's partials are bounded by
# launching over its tiles in turn (cuda.py). TURBOMQ_DETERMINISTIC_PARTITION
# overrides (a multiple of 64; tokens then differ from those of another
# size, so every worker must use the same).
PARTITION_KEYS = int(os.environ.get("TURBOMQ_DETERMINISTIC_PARTITION", "128"))
# Each warp of the attention kernel loads its next 16-token group while it
# computes the current one (where the launch is small: cuda.py), so that a
# 128-key partition's two groups a warp are in flight together, where a
# decode step at batch 1 would wait on them in turn. The same bits.
LOAD_AHEAD = True


@dataclass(frozen=True)
class NormFolded:
    """A projection's weight with the RMSNorm weight in front of it folded
    in: weight[n, k] * norm_weight[k], rounded once to the dtype."""
    weight: torch.Tensor


def fold_norm(weight: torch.Tensor, norm_weight: torch.Tensor) -> NormFolded:
    """The folded weight (a new tensor: a tied embedding stays as it is)."""
    folded = weight.float() * norm_weight.float()[None, :]
    return NormFolded(folded.to(weight.dtype).contiguous())


class InvariantOps:
    """The model's ops on `base` (the cuda or reference module), batch-invariant."""

    def __init__(self, base: ModuleType) -> None:
        self.base = base
        self.native = base.__name__.rsplit(".", 1)[-1] == "cuda"

    def linear(self, x: torch.Tensor, weight: torch.Tensor, *,
               norm: Optional[tuple[torch.Tensor, float]] = None, silu: bool = False,
               residual: Optional[torch.Tensor] = None) -> torch.Tensor:
        b = self.base
        eps = None
        if isinstance(weight, NormFolded):
            if norm is None:
                raise ValueError("a norm-folded weight needs the norm's eps")
            weight, eps = weight.weight, norm[1]
        elif norm is not None:
            x = b.rms_norm(x, norm[0], norm[1])
        if self.native and not (silu and residual is not None):
            # silu_mul or the residual add in the GEMM's store: the same bits
            # as the separate kernel after it.
            return b.linear_invariant(x, weight, residual=residual, silu=silu, norm_eps=eps)
        y = b.linear_invariant(x, weight, norm_eps=eps)
        if silu:
            y = b.silu_mul(y)
        if residual is not None:
            return residual.add_(y)
        return y

    def qkv_rotary_write_kv(self, x: torch.Tensor, weight: torch.Tensor,
                            norm: tuple[torch.Tensor, float], positions: torch.Tensor,
                            cos_sin: torch.Tensor, kv: LayerKV, slot_mapping: torch.Tensor,
                            num_heads: int) -> torch.Tensor:
        if self.native and isinstance(weight, NormFolded):
            # Decode rows on a 16-bit pool: rotary and the KV write in the
            # GEMM's store, the same bits as the two launches below.
            q = self.base.qkv_rotary_write_kv_invariant(x, weight.weight, norm[1], positions,
                                                        cos_sin, kv, slot_mapping, num_heads)
            if q is not None:
                return q
        t = x.shape[0]
        nkv, d = kv.k.shape[1], kv.k.shape[3]
        qkv = self.linear(x, weight, norm=norm)
        q, k, v = qkv.split([num_heads * d, nkv * d, nkv * d], dim=-1)
        return self.base.rotary_write_kv(q.reshape(t, num_heads, d), k.reshape(t, nkv, d),
                                         v.reshape(t, nkv, d), positions, cos_sin, kv,
                                         slot_mapping)

    def paged_attention(self, q: torch.Tensor, kv: LayerKV, batch: AttentionBatch,
                        scale: float) -> torch.Tensor:
        if self.native:
            return self.base.paged_attention(q, kv, batch, scale, partition_size=PARTITION_KEYS,
                                             always_combine=True, load_ahead=LOAD_AHEAD)
        return self.base.paged_attention(q, kv, batch, scale)
