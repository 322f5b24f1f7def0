"""Batch-invariant GEMM benchmark on one CUDA GPU.

ops.linear_invariant (native/cuda/gemm_invariant.cu: K summed in fixed
chunks in a fixed order, so a row's result does not depend on the batch)
against cuBLAS (F.linear) at Llama-3-8B's projection shapes (qkv 6144 x 4096,
o 4096 x 4096, gate_up 28672 x 4096, down 4096 x 14336), bf16, for M = 1 to
8192 rows: time, TFLOP/s, GB/s (weights + x + y; the split shape's fp32
chunk sums are extra traffic, not counted) and the ratio to cuBLAS. Both
launch shapes are timed where they fit (split: up to 512 rows), so the
split/tiled switch (cuda.INVARIANT_SPLIT_MAX_ROWS) can be checked, the gemv shape
where it takes the rows (up to 16, x in its shared memory), and the native
GEMV (the non-invariant decode path) up to 8 rows. Every
linear_invariant figure is taken twice: chunk sums on mma.sync (the default)
and on wgmma (TURBOMQ_INVARIANT_WGMMA=1), in the same run.

Timing: CUDA graphs of many calls (launch gaps out of the numbers), CUDA
events, median of replays (gpu_kernels.time_graph). Weights rotate through
enough copies that small-M calls read them from HBM, not L2.

    python benchmarks/gpu_gemm_invariant.py --out docs/benchmarks

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
ROWS = [1, 8, 32, 64, 128, 256, 512, 1024, 4096, 8192]
SPLIT_MAX_ROWS = 512   # forced split shape timed up to here (its workspace grows with M)
GEMV_MAX_ROWS = 8
ROTATE_BYTES = 512 << 20  # weight copies per graph, so small M reads from HBM
DTYPE = torch.bfloat16
DEV = torch.device("cuda")


def plan_calls(m: int, n: int, k: int, copies: int) -> tuple[int, int]:
    """(calls per graph, replays): about 20 ms of work per replay, at least one
    pass over the weight copies."""
    est = max(2 * n * k / 3e12, 2 * m * n * k / 5e14)  # seconds: bandwidth or compute bound
    calls = max(copies, min(50, math.ceil(0.02 / est)))
    return calls, 20 if est < 1e-3 else 8


def bench_shape(name: str, n: int, k: int, rows_list: list[int]) -> list[dict]:
    wbytes = 2 * n * k
    copies = max(1, math.ceil(ROTATE_BYTES / wbytes))
    ws = [torch.randn((n, k), device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]
    out = []
    for m in rows_list:
        x = torch.randn((m, k), device=DEV, dtype=DTYPE)
        calls, reps = plan_calls(m, n, k, copies)

        def timed(fn) -> float:
            return gpu_kernels.time_graph(lambda i: fn(x, ws[i % copies]), calls, reps)

        kind = cuda_ops._invariant_path(None, m, n, k, DEV)
        path = {cuda_ops._k.GemmInvariantPath.SPLIT: "split",
                cuda_ops._k.GemmInvariantPath.GEMV: "gemv"}.get(kind, "tiled")
        r = {"name": name, "n": n, "k": k, "m": m, "copies": copies, "path": path}
        r["cublas_us"] = timed(F.linear) * 1e6
        for kind, prefix in ((False, ""), (True, "wg_")):
            cuda_ops.set_invariant_wgmma(kind, kind)
            r[prefix + "tiled_us"] = timed(
                lambda a, b: cuda_ops.linear_invariant(a, b, path="tiled")) * 1e6
            r[prefix + "split_us"] = None
            if m <= SPLIT_MAX_ROWS:
                r[prefix + "split_us"] = timed(
                    lambda a, b: cuda_ops.linear_invariant(a, b, path="split")) * 1e6
        cuda_ops.set_invariant_wgmma(True, True)  # the tiled shape on wgmma with TMA loads
        cuda_ops._k.set_gemm_invariant_tma(True)
        r["wg_tma_tiled_us"] = timed(
            lambda a, b: cuda_ops.linear_invariant(a, b, path="tiled")) * 1e6
        cuda_ops._k.set_gemm_invariant_tma(cuda_ops.INVARIANT_TMA)
        cuda_ops.set_invariant_wgmma(cuda_ops.INVARIANT_WGMMA)
        # The default: the split shape on mma.sync, the tiled one on wgmma
        # where INVARIANT_WGMMA (Hopper).
        tiled_prefix = "wg_" if cuda_ops.INVARIANT_WGMMA else ""
        r["inv_gemv_us"] = None
        if cuda_ops._k.gemm_invariant_gemv_fits(m, k):
            r["inv_gemv_us"] = timed(
                lambda a, b: cuda_ops.linear_invariant(a, b, path="gemv")) * 1e6
        r["us"] = {"split": r["split_us"], "gemv": r["inv_gemv_us"]}.get(
            path, r[tiled_prefix + "tiled_us"])
        r["gemv_us"] = None
        if m <= GEMV_MAX_ROWS:
            r["gemv_us"] = timed(lambda a, b: cuda_ops.linear(a, b, native=True)) * 1e6
        t = r["us"] / 1e6
        r["TFLOPs"] = 2 * m * n * k / t / 1e12
        r["GBps"] = (wbytes + 2 * m * k + 2 * m * n) / t / 1e9
        r["vs_cublas"] = r["cublas_us"] / r["us"]
        r["vs_gemv"] = r["gemv_us"] / r["us"] if r["gemv_us"] else None
        out.append(r)
        extra = f"  gemv {r['gemv_us']:8.1f} us" if r["gemv_us"] else ""
        split = f"{r['split_us']:8.1f}" if r["split_us"] else "       -"
        wg_split = f"{r['wg_split_us']:8.1f}" if r["wg_split_us"] else "       -"
        inv_gemv = f"{r['inv_gemv_us']:8.1f}" if r["inv_gemv_us"] else "       -"
        print(f"{name:8s} {n:5d}x{k:5d} M={m:5d}: {r['path']:5s} {r['us']:8.1f} us "
              f"{r['TFLOPs']:6.1f} TFLOP/s {r['GBps']:6.0f} GB/s | cuBLAS {r['cublas_us']:8.1f} us "
              f"(x{r['vs_cublas']:.2f}) | mma.sync tiled {r['tiled_us']:8.1f} split {split} | "
              f"wgmma tiled {r['wg_tiled_us']:8.1f} split {wg_split} "
              f"tiled+TMA {r['wg_tma_tiled_us']:8.1f} | gemv shape {inv_gemv}{extra}", flush=True)
        del x
        torch.cuda.empty_cache()
    del ws
    torch.cuda.empty_cache()
    return out


def markdown(info: dict, rows: list[dict]) -> str:
    lines = [
        "# Batch-invariant GEMM benchmark", "",
        f"Device: {info['device']} ({info['sms']} SMs), torch {info['torch']}, bf16. "
        f"Read-only reduction in the same run: **{info['read_GBps']:.0f} GB/s**. "
        "Produced by `benchmarks/gpu_gemm_invariant.py`.", "",
        f"`linear_invariant` (chunks of {info['chunk']} along K, folded in order) against "
        "cuBLAS (`F.linear`). GB/s counts weights + x + y. `vs cuBLAS` > 1 means faster than "
        "cuBLAS. The launch shapes give the same bits, and so do the two kinds of MMA; "
        "`path` is the one `linear_invariant` picks (the gemv shape up to "
        f"{info.get('gemv_max_rows', 0)} row(s) where x fits its shared memory, split up to "
        f"{info['split_max_rows']} rows if the chunk sums fit in 64 MiB; with the tiled "
        "shape on `mma.sync`, also while its grid would leave SMs idle), and `time` that "
        "path on the default's kind: the split shape on `mma.sync`, the tiled one on "
        f"{'`wgmma`' if info['invariant_wgmma'] else '`mma.sync`'}. The last columns time "
        "each shape on each kind, same inputs, same run.", ""]
    for name in dict.fromkeys(r["name"] for r in rows):
        sel = [r for r in rows if r["name"] == name]
        lines += [f"## {name} ({sel[0]['n']} x {sel[0]['k']})", "",
                  "| M | path | time (us) | TFLOP/s | GB/s | cuBLAS (us) | vs cuBLAS "
                  "| mma.sync tiled (us) | mma.sync split (us) | wgmma tiled (us) "
                  "| wgmma split (us) | wgmma tiled, TMA (us) | gemv shape (us) | GEMV (us) |",
                  "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
                  "| ---: | ---: | ---: | ---: |"]
        for r in sel:
            split = f"{r['split_us']:.1f}" if r["split_us"] else ""
            wg_split = f"{r['wg_split_us']:.1f}" if r["wg_split_us"] else ""
            gemv = f"{r['gemv_us']:.1f}" if r["gemv_us"] else ""
            inv_gemv = f"{r['inv_gemv_us']:.1f}" if r.get("inv_gemv_us") else ""
            lines.append(f"| {r['m']} | {r['path']} | {r['us']:.1f} | {r['TFLOPs']:.1f} | "
                         f"{r['GBps']:.0f} | {r['cublas_us']:.1f} | {r['vs_cublas']:.2f} | "
                         f"{r['tiled_us']:.1f} | {split} | {r['wg_tiled_us']:.1f} | "
                         f"{wg_split} | {r['wg_tma_tiled_us']:.1f} | {inv_gemv} | {gemv} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks",
                    help="folder for gemm_invariant.md / gemm_invariant.json")
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS, help="values of M")
    ap.add_argument("--shapes", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    read_bw = gpu_kernels.read_bandwidth()
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "read_GBps": read_bw / 1e9, "chunk": cuda_ops._k.GEMM_INVARIANT_CHUNK,
            "split_max_rows": cuda_ops.INVARIANT_SPLIT_MAX_ROWS,
            "gemv_max_rows": cuda_ops.INVARIANT_GEMV_MAX_ROWS,
            "invariant_wgmma": cuda_ops.INVARIANT_WGMMA}
    print(f"{props.name}: read {read_bw / 1e9:.0f} GB/s", flush=True)
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
