"""The op layer the model runs on. `reference` is pure PyTorch: the CPU backend
and the oracle for the native CUDA kernels."""

from __future__ import annotations

from types import ModuleType

import torch

from . import reference
from .attention_batch import AttentionBatch

__all__ = ["AttentionBatch", "ops_for", "reference"]


def ops_for(device: torch.device) -> ModuleType:
    """The backend that runs on `device`."""
    return reference
