"""The o projection at one row (Llama-3-8B: 4096 x 4096, bf16, the residual
added) in the invariant GEMM's gemv shape and in the default GEMV, a few
launches each, for Nsight Compute to compare:

    ncu --kernel-name regex:"gemm_gemv_kernel|gemv_kernel" --launch-skip 4 \
        --launch-count 2 --section SpeedOfLight --section WarpStateStats \
        --section Occupancy --section LaunchStats python benchmarks/gpu_gemv_shape_ncu.py

GPU only."""

from __future__ import annotations

import torch

from turbomq.worker.model.ops import cuda as cuda_ops


def main() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn((1, 4096), generator=gen, device="cuda").to(torch.bfloat16)
    w = (torch.randn((4096, 4096), generator=gen, device="cuda") * 0.02).to(torch.bfloat16)
    res = torch.randn((1, 4096), generator=gen, device="cuda").to(torch.bfloat16)
    for _ in range(3):  # gemv shape: launches 1-3, then the GEMV: 4-6
        cuda_ops.linear_invariant(x, w, residual=res, path="gemv")
    for _ in range(3):
        cuda_ops.linear(x, w, residual=res)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
