"""The op layer the model runs on. `reference` is pure PyTorch: the CPU backend
and the oracle for the native CUDA kernels in `cuda`."""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .attention_batch import AttentionBatch
from .layer_kv import LayerKV

__all__ = ["AttentionBatch", "LayerKV", "ops_for", "reference"]


def ops_for(device: torch.device) -> ModuleType:
    """The backend that runs on `device`: CUDA kernels when the native module
    was built with them, else the reference."""
    if torch.device(device).type == "cuda":
        from . import cuda
        if cuda.available():
            return cuda
    return reference
