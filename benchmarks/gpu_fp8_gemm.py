"""FP8 products at Llama-3-8B's projection shapes on cuBLASLt, the ways
torch._scaled_mm can scale them, against bf16 (F.linear), one run: row-wise
scales (per token x per channel in the epilogue: what the engine runs,
worker/model/ops/cuda.py `_linear_fp8`), and one scale per tensor with
the output in bf16 or fp32 (where the per-token and per-channel scales
would be applied after, in a kernel that follows). Row-wise scaling offers
cuBLASLt a single kernel configuration; this says what the others would
buy. Microseconds per call, the median of 50 calls after a warm-up.

    python benchmarks/gpu_fp8_gemm.py --out DIR [--rows 256 1024 8192]

Writes fp8_gemm.md and fp8_gemm.json into DIR."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import median_ms  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
COLUMNS = ("bf16", "fp8 row-wise", "fp8 per tensor, bf16 out", "fp8 per tensor, fp32 out")


def time_shape(n: int, k: int, m: int) -> dict:
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    sx = torch.rand(m, 1, device="cuda", dtype=torch.float32) + 0.5
    sw = torch.rand(1, n, device="cuda", dtype=torch.float32) + 0.5
    one = torch.ones((), device="cuda", dtype=torch.float32)
    calls = {
        "bf16": lambda: F.linear(x, w),
        "fp8 row-wise": lambda: torch._scaled_mm(xq, wq.t(), scale_a=sx, scale_b=sw,
                                                 out_dtype=torch.bfloat16),
        "fp8 per tensor, bf16 out": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.bfloat16),
        "fp8 per tensor, fp32 out": lambda: torch._scaled_mm(xq, wq.t(), scale_a=one, scale_b=one,
                                                             out_dtype=torch.float32),
    }
    return {name: median_ms(fn, reps=50) * 1e3 for name, fn in calls.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[64, 256, 512, 1024, 4096, 8192])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "us": {}}
    lines = ["# FP8 products on cuBLASLt: how they are scaled", "",
             f"{results['device']}, torch {results['torch']}; "
             "`python benchmarks/gpu_fp8_gemm.py --out DIR`. Microseconds per call "
             "(median of 50), all from one run.", ""]
    for shape, (n, k) in SHAPES.items():
        lines += [f"## {shape} ({n} x {k})", "",
                  "| rows | " + " | ".join(COLUMNS) + " |", "| ---: |" + " ---: |" * len(COLUMNS)]
        for m in args.rows:
            us = time_shape(n, k, m)
            results["us"][f"{shape}|{m}"] = us
            lines.append(f"| {m} | " + " | ".join(f"{us[c]:.1f}" for c in COLUMNS) + " |")
            print(shape, m, json.dumps(us), flush=True)
        lines.append("")
    (args.out / "fp8_gemm.md").write_text("\n".join(lines))
    (args.out / "fp8_gemm.json").write_text(json.dumps(results, indent=2) + "\n")
    print((args.out / "fp8_gemm.md").read_text())


if __name__ == "__main__":
    main()
