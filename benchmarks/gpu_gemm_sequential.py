"""Experiment: the product as one accumulation over K (docs/determinism.md,
"Next"), both halves of the plan, one run on one Hopper GPU, Llama-3-8B
projections, bf16. The kernels are in gpu_gemm_sequential.cu beside this
file, built here with torch's extension loader; the engine does not use them.

- Many rows: 256 x 128 wgmma tiles (alone, and in clusters of two row
  tiles sharing the weight tile by multicast) against cuBLAS and the
  batch-invariant GEMM's tiled shape (cp.async, and TMA loads). Does the
  tile that one accumulator set allows reach ~0.9x cuBLAS?
- 1-8 rows: a warp per tile of 8 weight rows walking all of K, against the
  default GEMV, the invariant GEMM's own choice, and its gemv shape (these
  launch as programmatic dependents in the graph; the experiment does not,
  so it pays its start-up that they hide). Each tiling of warps and tiles
  is timed; the best is reported.

It checks the large kernel against a float32 product, that a row's bits do
not depend on M or on the pairing, and that the few-row kernel gives a row
the same bits as the large one (the premise of the plan).

    python benchmarks/gpu_gemm_sequential.py --out DIR [--rows 256 1024 8192]

Writes gemm_sequential.md and gemm_sequential.json into DIR."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.cpp_extension import load

from turbomq.worker.model.ops import cuda as cuda_ops

_here = Path(__file__).resolve().parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, _here / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gpu_kernels = _load("gpu_kernels")
gemm_bench = _load("gpu_gemm_invariant")  # shapes, call plans, weight rotation
ROWS = [128, 256, 512, 1024, 4096, 8192]
FEW_ROWS = [1, 2, 4, 8]
NARROW_TILINGS = [(4, 1), (4, 2), (4, 4), (8, 1), (8, 2), (8, 4)]  # (warps, tiles a warp)
SMEM_LIMIT = 227 * 1024
DEV, DTYPE = gemm_bench.DEV, gemm_bench.DTYPE


_ext = None


def sequential(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _ext.gemm_sequential(x, w)


def sequential_paired(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return _ext.gemm_sequential(x, w, paired=True)


def narrow(warps: int, tiles: int):
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _ext.gemv_sequential(x, w, warps, tiles)
    return run


def narrow_fits(m: int, k: int, warps: int) -> bool:
    return (m * (k + 8) * 2 + 127) // 128 * 128 + warps * 6 * 2048 <= SMEM_LIMIT


def invariant_tiled(tma: bool):
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        cuda_ops._k.set_gemm_invariant_tma(tma)
        try:
            return cuda_ops.linear_invariant(x, w, path="tiled")
        finally:
            cuda_ops._k.set_gemm_invariant_tma(cuda_ops.INVARIANT_TMA)
    return run


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight that a graph's calls read them from HBM."""
    copies = max(1, -(-gemm_bench.ROTATE_BYTES // (2 * n * k)))
    return [torch.randn((n, k), device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]


def check(n: int, k: int) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn((1000, k), device=DEV, dtype=DTYPE, generator=gen)
    w = torch.randn((n, k), device=DEV, dtype=DTYPE, generator=gen) * 0.02
    want = x.float() @ w.float().T
    got = sequential(x, w)
    err = ((got.float() - want).abs().max() / want.abs().max()).item()
    alone = sequential(x[:37].contiguous(), w)
    few = [m for m in FEW_ROWS if narrow_fits(m, k, 4)]
    same = all(torch.equal(narrow(4, 1)(x[:m].contiguous(), w), got[:m]) for m in few)
    return {"rel_err": err, "rows_bit_identical": bool(torch.equal(alone, got[:37])),
            "paired_same_bits": bool(torch.equal(sequential_paired(x, w), got)),
            "few_rows_same_bits": bool(same)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="*", default=ROWS)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    global _ext
    # wgmma and setmaxnreg need the arch-specific target: sm_90a only (a
    # plain sm_90 build would compile them to traps).
    os.environ["TORCH_CUDA_ARCH_LIST"] = "9.0a"
    _ext = load("gemm_sequential", [str(_here / "gpu_gemm_sequential.cu")],
                extra_include_paths=[str(_here.parent / "native" / "cuda")],
                extra_cuda_cflags=["-O3", "-std=c++17"], verbose=False)
    results = many_rows(args.rows)
    few_results = few_rows()
    write_report(args.out, results, few_results)


def many_rows(rows: list[int]) -> list[dict]:
    kinds = {"cublas_us": F.linear, "sequential_us": sequential,
             "sequential_paired_us": sequential_paired, "tiled_us": invariant_tiled(False),
             "tiled_tma_us": invariant_tiled(True)}
    results = []
    for name, (n, k) in gemm_bench.SHAPES.items():
        correct = check(n, k)
        print(name, correct, flush=True)
        ws = weight_copies(n, k)
        copies = len(ws)
        for m in rows:
            x = torch.randn((m, k), device=DEV, dtype=DTYPE)
            calls, reps = gemm_bench.plan_calls(m, n, k, copies)
            r = {"name": name, "n": n, "k": k, "m": m, **correct}
            for key, fn in kinds.items():
                r[key] = gpu_kernels.time_graph(lambda i, fn=fn: fn(x, ws[i % copies]), calls,
                                                reps) * 1e6
            r["tflops"] = 2 * m * n * k / r["sequential_us"] / 1e6
            results.append(r)
            print(f"{name:8s} M={m:5d} cuBLAS {r['cublas_us']:8.1f} sequential "
                  f"{r['sequential_us']:8.1f} ({r['cublas_us'] / r['sequential_us']:.2f}x) "
                  f"paired {r['sequential_paired_us']:8.1f} "
                  f"tiled {r['tiled_us']:8.1f} tiled+TMA {r['tiled_tma_us']:8.1f}", flush=True)
    return results


def few_rows() -> list[dict]:
    few_results = []
    for name, (n, k) in gemm_bench.SHAPES.items():
        ws = weight_copies(n, k)
        copies = len(ws)
        for m in FEW_ROWS:
            x = torch.randn((m, k), device=DEV, dtype=DTYPE)
            calls, reps = gemm_bench.plan_calls(m, n, k, copies)

            def timed(fn) -> float:
                return gpu_kernels.time_graph(lambda i: fn(x, ws[i % copies]), calls, reps) * 1e6

            r = {"name": name, "n": n, "k": k, "m": m, "cublas_us": timed(F.linear),
                 "gemv_us": timed(lambda a, b: cuda_ops.linear(a, b)),
                 "invariant_us": timed(lambda a, b: cuda_ops.linear_invariant(a, b)),
                 "invariant_gemv_us": None, "narrow": {}}
            if cuda_ops._k.gemm_invariant_gemv_fits(m, k):
                r["invariant_gemv_us"] = timed(
                    lambda a, b: cuda_ops.linear_invariant(a, b, path="gemv"))
            for warps, tiles in NARROW_TILINGS:
                if narrow_fits(m, k, warps):
                    r["narrow"][f"{warps}x{tiles}"] = timed(narrow(warps, tiles))
            if r["narrow"]:
                r["narrow_best"] = min(r["narrow"].items(), key=lambda kv: kv[1])
            few_results.append(r)
            print(f"{name:8s} M={m} cuBLAS {r['cublas_us']:7.1f} GEMV {r['gemv_us']:7.1f} "
                  f"invariant {r['invariant_us']:7.1f} gemv shape {r['invariant_gemv_us']} "
                  f"narrow {r.get('narrow_best')}", flush=True)
    return few_results


def write_report(out: Path, results: list[dict], few_results: list[dict]) -> None:
    lines = ["# One accumulation over K: 256 x 128 wgmma tiles against cuBLAS", "",
             f"{torch.cuda.get_device_name()}, bf16, one run: "
             "`python benchmarks/gpu_gemm_sequential.py --out DIR`. `vs cuBLAS` > 1 means faster. "
             "The invariant GEMM's tiled shape (chunk sums folded in order) beside it, with "
             "`cp.async` and with TMA loads.", "",
             "| shape | M | cuBLAS (us) | sequential (us) | TFLOP/s | vs cuBLAS | paired (us) |"
             " tiled (us) | tiled, TMA (us) | rel. error | rows bit-identical | paired same bits |"
             " few rows same bits |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"
             " --- |"]
    for r in results:
        ratio = r["cublas_us"] / r["sequential_us"]
        lines.append(f"| {r['name']} | {r['m']} | {r['cublas_us']:.1f} | "
                     f"{r['sequential_us']:.1f} | {r['tflops']:.0f} | {ratio:.2f} | "
                     f"{r['sequential_paired_us']:.1f} | "
                     f"{r['tiled_us']:.1f} | {r['tiled_tma_us']:.1f} | {r['rel_err']:.1e} | "
                     f"{r['rows_bit_identical']} | {r['paired_same_bits']} | "
                     f"{r['few_rows_same_bits']} |")
    lines += ["", "## A few rows: a warp per tile of 8 weight rows over all of K", "",
              "`narrow`: the best (warps x tiles a warp) of the tilings, each timed; the others "
              "launch as programmatic dependents, it does not. Times in us.", "",
              "| shape | M | cuBLAS | default `ops.linear` (GEMV to 4 rows) |"
              " invariant (its choice) | invariant gemv shape | narrow | tiling | narrow / GEMV |",
              "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in few_results:
        best = r.get("narrow_best")
        inv_gemv = f"{r['invariant_gemv_us']:.1f}" if r["invariant_gemv_us"] else ""
        lines.append(f"| {r['name']} | {r['m']} | {r['cublas_us']:.1f} | {r['gemv_us']:.1f} | "
                     f"{r['invariant_us']:.1f} | {inv_gemv} | "
                     + (f"{best[1]:.1f} | {best[0]} | {r['gemv_us'] / best[1]:.2f} |" if best
                        else "| | |"))
    (out / "gemm_sequential.md").write_text("\n".join(lines) + "\n")
    (out / "gemm_sequential.json").write_text(
        json.dumps({"many_rows": results, "few_rows": few_results}, indent=1))


if __name__ == "__main__":
    main()
