"""One layer's view of the paged KV pool: the unit every attention op takes.
The pool that owns these tensors is turbomq.worker.model.kv_cache."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass
class LayerKV:
    """One layer's view of the pool; the unit attention ops take."""

    k: torch.Tensor  # [num_blocks, num_kv_heads, block_size, head_dim]
    v: torch.Tensor
    k_scale: Optional[torch.Tensor]  # [num_blocks, num_kv_heads, block_size] for int8, else None
    v_scale: Optional[torch.Tensor]

    @property
    def block_size(self) -> int:
        return self.k.shape[2]

    @property
    def quantized(self) -> bool:
        return self.k_scale is not None
