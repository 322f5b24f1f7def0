"""The paged KV pool's tensors (the bookkeeping lives in the native manager).

Layout per layer: K and V are [num_blocks, num_kv_heads, block_size, head_dim],
so one (block, head) is a contiguous block_size x head_dim tile that a kernel
reads with wide coalesced loads. INT8 storage adds one float32 scale per
(block, head, token): symmetric per-token, per-head quantization."""

from __future__ import annotations

import torch

from .ops.layer_kv import LayerKV

KV_DTYPES = ("auto", "fp32", "fp16", "bf16", "int8")
_TORCH_KV_DTYPE = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
                   "int8": torch.int8}


def resolve_kv_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_dtype not in KV_DTYPES:
        raise ValueError(f"kv_dtype must be one of {KV_DTYPES}, got {kv_dtype!r}")
    return model_dtype if kv_dtype == "auto" else _TORCH_KV_DTYPE[kv_dtype]


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        shape = (num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim)
        self.data = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = (torch.zeros(shape[:-1], dtype=torch.float32, device=device)
                       if dtype == torch.int8 else None)
        self.layers = [
            LayerKV(self.data[i, 0], self.data[i, 1],
                    None if self.scales is None else self.scales[i, 0],
                    None if self.scales is None else self.scales[i, 1])
            for i in range(num_layers)]

    @staticmethod
    def bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                        dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        per_token_head = head_dim * elem + (4 if dtype == torch.int8 else 0)
        return num_layers * 2 * num_kv_heads * block_size * per_token_head

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        return n + (0 if self.scales is None else self.scales.numel() * 4)
