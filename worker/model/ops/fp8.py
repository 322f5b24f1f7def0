"""FP8 weights (`--quantization fp8`): the projections of every layer stored
as E4M3 with one float32 scale per output channel, converted at load from a
16- or 32-bit checkpoint; `fp8-lm-head`: the LM head too. Activations are
quantized per token on the fly, so the product runs on FP8 tensor cores
(cuda.py: torch._scaled_mm, the scales applied in its epilogue, or the FP8
GEMV) or, in the reference, as the same rounding followed by an fp32
matmul.

What stays in the checkpoint's dtype: the embedding, the norms and (with
`fp8`) the LM head: on a small model its FP8 logits change answers.
docs/weights.md, "FP8", has the error this costs on a real model."""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite E4M3 value
# Scales are amax times this (not amax / 448): torch on CUDA divides by a
# scalar as a multiply by its reciprocal, so this is the one rounding every
# device and the fused kernel (native/cuda/quant.cu) share.
FP8_MAX_INV = 1.0 / FP8_MAX
QUANTIZED = ("qkv", "o", "gate_up", "down")  # per-layer weights that go to FP8


@dataclass
class Fp8Weight:
    """w ~= data.float() * scale[:, None]: data [N, K] E4M3, scale [N] float32."""
    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.data.float() * self.scale[:, None]).to(dtype)


def quantize_weight(w: torch.Tensor) -> Fp8Weight:
    """Per output channel: the row's largest magnitude maps to FP8_MAX."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) * FP8_MAX_INV).clamp(min=1e-12)
    data = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return Fp8Weight(data.contiguous(), scale.contiguous())


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token (row): x ~= q.float() * scale, q E4M3 [M, K], scale [M, 1] float32.
    q = x * (1 / scale), the reciprocal rounded once: the kernels multiply
    (a division per value would dominate the FP8 GEMV's prologue)."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) * FP8_MAX_INV).clamp(min=1e-12)
    return (xf * (1.0 / scale)).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def fp8_linear_reference(x: torch.Tensor, w: Fp8Weight) -> torch.Tensor:
    """x @ w.T as the FP8 GEMM computes it: both operands rounded to E4M3,
    products summed in fp32, both scales applied, one rounding to x's dtype."""
    k = x.shape[-1]
    q, sx = quantize_rows(x.reshape(-1, k))
    y = (q.float() @ w.data.float().T) * sx * w.scale[None, :]
    return y.to(x.dtype).reshape(*x.shape[:-1], w.data.shape[0])
