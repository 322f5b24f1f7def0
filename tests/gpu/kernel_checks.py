"""What the kernel tests share: the device, tolerances, a fresh printed seed,
the relative error, random and poisoned tensors. Import only after checking
that the CUDA kernels are available."""

from __future__ import annotations

import os
import random

import pytest
import torch

DEV = torch.device("cuda")
# ||out - ref|| / ||ref||: one rounding to the storage dtype plus fp32 noise.
TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}
DTYPES = [torch.bfloat16, torch.float16]


@pytest.fixture
def gen():
    """A fresh seed per test, printed so a failure can be replayed."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed={seed}")
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    random.seed(seed)
    return g


def rel_err(out: torch.Tensor, expect: torch.Tensor) -> float:
    out, expect = out.double(), expect.double()
    assert torch.isfinite(out).all(), "non-finite output (unwritten or bad element)"
    return ((out - expect).norm() / expect.norm().clamp_min(1e-30)).item()


def randn(shape, dtype, gen, scale=1.0):
    return (torch.randn(shape, generator=gen, device=DEV, dtype=torch.float32) * scale).to(dtype)


def poisoned(shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=DEV)
