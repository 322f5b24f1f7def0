"""Batch-invariant GEMM benchmark on one CUDA GPU.

ops.linear_invariant (native/cuda/gemm_invariant.cu: every output one
float32 accumulation over K, so a row's result does not depend on the
batch, whatever the tile) against cuBLAS (F.linear) and the default
ops.linear (the GEMV up to 4 rows) at Llama-3-8B's projection shapes (qkv
6144 x 4096, o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336), bf16,
for M = 1 to 8192 rows: the tiling linear_invariant picks, its time, TFLOP/s
and ratio to cuBLAS, and every other tiling that takes M (the transposed
shape up to 8 rows; tiles of 64 x 128 to 256 x 128), so the choice can be
checked.

Timing: CUDA graphs of many calls (launch gaps out of the numbers), CUDA
events, median of replays (gpu_kernels.time_graph). Weights rotate through
enough copies that small-M calls read them from HBM, not L2.

    python benchmarks/gpu_gemm_invariant.py --out DIR

GPU only: without CUDA (or a CUDA build of turbomq._native) it says why and
exits.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F

from turbomq.worker.model.ops import cuda as cuda_ops

_spec = importlib.util.spec_from_file_location("gpu_kernels", Path(__file__).with_name("gpu_kernels.py"))
gpu_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_kernels)

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
ROWS = [1, 2, 4, 8, 16, 64, 128, 256, 512, 1024, 4096, 8192]
ROTATE_BYTES = 512 << 20  # weight copies per graph, so small M reads from HBM
DTYPE = torch.bfloat16
DEV = torch.device("cuda")
# The tilings (cuda._TILINGS keys) timed beside the choice, by M.
TRANSPOSED = ("transposed", "transposed4")
TILED = ("64x128", "256x128") + tuple(f"128x{c}" for c in range(64, 257, 32))


def plan_calls(m: int, n: int, k: int, copies: int) -> int:
    """Calls per graph: about 10 ms of work, at least one pass over the weight copies."""
    est = max(2 * n * k / 3e12, 2 * m * n * k / 5e14)  # seconds: bandwidth or compute bound
    return max(copies, min(50, math.ceil(0.01 / est)))


def tiling_name(m: int, n: int, k: int) -> str:
    rows, cols = cuda_ops._k.gemm_invariant_tiling(m, n, k)
    return next(t for t, v in cuda_ops._TILINGS.items() if v == (rows, cols))


def bench_shape(name: str, n: int, k: int, rows_list: list[int]) -> list[dict]:
    copies = max(1, math.ceil(ROTATE_BYTES / (2 * n * k)))
    ws = [torch.randn((n, k), device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
    out = []
    x = torch.randn((rows_list[0], k), device=DEV, dtype=DTYPE)
    gpu_kernels.time_graph(lambda i: cuda_ops.linear_invariant(x, ws[i % copies]), copies, 3)  # warm-up
    for m in rows_list:
        x = torch.randn((m, k), device=DEV, dtype=DTYPE)
        calls = plan_calls(m, n, k, copies)

        def timed(fn) -> float:
            return gpu_kernels.time_graph(lambda i: fn(x, ws[i % copies]), calls, 10) * 1e6

        r = {"name": name, "n": n, "k": k, "m": m, "tiling": tiling_name(m, n, k),
             "us": timed(cuda_ops.linear_invariant), "cublas_us": timed(F.linear),
             "linear_us": timed(cuda_ops.linear),
             "tilings": {t: timed(lambda a, b, t=t: cuda_ops.linear_invariant(a, b, tiling=t))
                         for t in (TRANSPOSED if m <= 8 else ()) + TILED}}
        r["tflops"] = 2 * m * n * k / r["us"] / 1e6
        out.append(r)
        print(f"{name:8s} M={m:5d} {r['tiling']:11s} {r['us']:8.1f} us, cuBLAS "
              f"{r['cublas_us']:8.1f} ({r['cublas_us'] / r['us']:.2f}x), linear "
              f"{r['linear_us']:8.1f}; " + ", ".join(f"{t} {v:.1f}" for t, v in r["tilings"].items()),
              flush=True)
    return out


def markdown(info: dict, rows: list[dict]) -> str:
    lines = ["# Batch-invariant GEMM against cuBLAS", "",
             f"Device: {info['device']} ({info['sms']} SMs), torch {info['torch']}, bf16. "
             "`python benchmarks/gpu_gemm_invariant.py --out DIR`, one run. `tiling`: the one "
             "`linear_invariant` picks (`gemm_invariant_tiling`); `vs cuBLAS` > 1 is faster; "
             "`linear`: the default `ops.linear` (the GEMV up to 4 rows, cuBLAS beyond). "
             "Times in us.", "",
             "| shape | M | tiling | time | TFLOP/s | cuBLAS | vs cuBLAS | linear | vs linear |"
             " fastest tiling |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"]
    for r in rows:
        best = min(r["tilings"].items(), key=lambda kv: kv[1])
        lines.append(f"| {r['name']} | {r['m']} | {r['tiling']} | {r['us']:.1f} | "
                     f"{r['tflops']:.0f} | {r['cublas_us']:.1f} | {r['cublas_us'] / r['us']:.2f} | "
                     f"{r['linear_us']:.1f} | {r['linear_us'] / r['us']:.2f} | "
                     f"{best[0]} {best[1]:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for gemm_invariant.md / .json")
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS, help="values of M")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__}
    rows = []
    for name in args.shapes:
        n, k = SHAPES[name]
        rows += bench_shape(name, n, k, args.rows)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm_invariant.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2) + "\n")
    text = markdown(info, rows)
    (out / "gemm_invariant.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
