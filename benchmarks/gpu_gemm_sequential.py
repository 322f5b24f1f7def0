"""Experiment: the product as one accumulation over K (docs/determinism.md,
"Next"), one run on one Hopper GPU, Llama-3-8B projections, bf16. The
kernel is in gpu_gemm_sequential.cu beside this file, built here with
torch's extension loader; the engine does not use it.

Every tiling of that kernel (tile rows x tile columns, consumer
warpgroups, ring stages) runs the same k16 steps into one accumulator, so
the tile may follow M: the experiment times each tiling at each M, from a
decode row to an 8192-row prefill, against cuBLAS, the default
`ops.linear` (the GEMV up to 4 rows) and today's batch-invariant GEMM (its
own choice of shape), and reports the best tiling per M. It checks that
every tiling gives a row the same bits, whatever M, and the error against
a float32 product.

    python benchmarks/gpu_gemm_sequential.py --out DIR [--rows 1 4 ...]

Writes gemm_sequential_tiles.md and gemm_sequential_tiles.json into DIR."""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
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
gemm_bench = _load("gpu_gemm_invariant")  # shapes, weight rotation
ROWS = [1, 2, 4, 8, 16, 64, 128, 256, 512, 1024, 4096, 8192]
DEV, DTYPE = gemm_bench.DEV, gemm_bench.DTYPE
_ext = None


def tiling(t: tuple[int, ...]):
    """t: (tile rows, tile columns, consumer warpgroups, stages[, max blocks, PDL])."""
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _ext.gemm_sequential(x, w, *t)
    return run


def name_of(t: tuple[int, ...]) -> str:
    launch = {(0, True): "", (-1, True): "/a block a tile", (0, False): "/no PDL"}[t[4], t[5]]
    return f"{t[0]}x{t[1]}/{t[2]}wg/{t[3]}st{launch}"


def variants(tilings: list[tuple]) -> list[tuple]:
    """Each tiling persistent and a programmatic dependent; the tall ones also
    a block a tile, and without PDL."""
    out = []
    for t in tilings:
        out.append((*t, 0, True))
        if t[0] >= 128:
            out += [(*t, -1, True), (*t, 0, False)]
    return out


def transposed(t: tuple[int, int]):
    """t: (warps a block, stages)."""
    def run(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _ext.gemv_transposed(x, w, *t)
    return run


def worth_timing(t: tuple[int, int, int, int], m: int) -> bool:
    """Tiles far too tall for M waste the MMAs; far too small ones the reuse."""
    mt, nt = t[0], t[1]
    if m <= 64:
        return mt == 64
    if m <= 512:
        return mt <= 128
    return mt >= 128 or nt >= 64


def weight_copies(n: int, k: int) -> list[torch.Tensor]:
    """Enough copies of an [n, k] weight that a graph's calls read them from HBM."""
    copies = max(1, -(-gemm_bench.ROTATE_BYTES // (2 * n * k)))
    return [torch.randn((n, k), device=DEV, dtype=DTYPE) * 0.02 for _ in range(copies)]


def plan_calls(m: int, n: int, k: int, copies: int) -> int:
    """Calls per graph: about 10 ms of work, at least one pass over the weight copies."""
    est = max(2 * n * k / 3e12, 2 * m * n * k / 5e14)
    return max(copies, min(50, math.ceil(0.01 / est)))


def check(n: int, k: int, tilings: list[tuple], few: list[tuple]) -> dict:
    gen = torch.Generator(device=DEV).manual_seed(0)
    x = torch.randn((300, k), device=DEV, dtype=DTYPE, generator=gen)
    w = torch.randn((n, k), device=DEV, dtype=DTYPE, generator=gen) * 0.02
    want = x.float() @ w.float().T
    ref = tiling(tilings[0])(x, w)
    err = ((ref.float() - want).abs().max() / want.abs().max()).item()
    same = all(torch.equal(tiling(t)(x, w), ref) for t in tilings)
    alone = all(torch.equal(tiling(t)(x[:m].contiguous(), w), ref[:m])
                for t in tilings if t[0] == 64 for m in (1, 3, 37))
    few_same = all(torch.equal(transposed(t)(x[:m].contiguous(), w), ref[:m])
                   for t in few for m in (1, 3, 8))
    return {"rel_err": err, "tilings_same_bits": bool(same), "rows_alone_same_bits": bool(alone),
            "transposed_same_bits": bool(few_same)}


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
    tilings = [tuple(t) for t in _ext.tilings()]
    few = [tuple(t) for t in _ext.transposed_tilings()]
    results = []
    for name, (n, k) in gemm_bench.SHAPES.items():
        correct = check(n, k, tilings, few)
        print(name, correct, flush=True)
        ws = weight_copies(n, k)
        copies = len(ws)
        for m in args.rows:
            x = torch.randn((m, k), device=DEV, dtype=DTYPE)
            calls = plan_calls(m, n, k, copies)

            def timed(fn) -> float:
                return gpu_kernels.time_graph(lambda i: fn(x, ws[i % copies]), calls, 10) * 1e6

            r = {"name": name, "n": n, "k": k, "m": m, **correct, "cublas_us": timed(F.linear),
                 "linear_us": timed(lambda a, b: cuda_ops.linear(a, b)),
                 "invariant_us": timed(lambda a, b: cuda_ops.linear_invariant(a, b)),
                 "tilings": {name_of(t): timed(tiling(t)) for t in variants(tilings)
                             if worth_timing(t, m)}}
            if m <= 8:
                r["tilings"].update({f"transposed {t[0]} warps/{t[1]}st": timed(transposed(t))
                                     for t in few})
            r["best"] = min(r["tilings"].items(), key=lambda kv: kv[1])
            results.append(r)
            print(f"{name:8s} M={m:5d} cuBLAS {r['cublas_us']:8.1f} linear {r['linear_us']:8.1f} "
                  f"invariant {r['invariant_us']:8.1f} best {r['best'][0]} {r['best'][1]:8.1f} "
                  f"({r['cublas_us'] / r['best'][1]:.2f}x cuBLAS)", flush=True)
        write_report(args.out, results)


def write_report(out: Path, results: list[dict]) -> None:
    lines = ["# One accumulation over K: the tile follows M", "",
             f"{torch.cuda.get_device_name()}, bf16, one run: "
             "`python benchmarks/gpu_gemm_sequential.py --out DIR`. Times in us. `linear`: the "
             "default `ops.linear` (the GEMV up to 4 rows, cuBLAS beyond); `invariant`: today's "
             "batch-invariant GEMM, its own shape; `best`: the fastest tiling of the one-"
             "accumulation kernel (tile rows x columns / consumer warpgroups / stages). "
             "`/ linear` > 1 means the best tiling is slower.", "",
             "| shape | M | cuBLAS | linear | invariant | best | tiling | best / linear |"
             " best / invariant | rel. error | tilings same bits | rows alone same bits |"
             " transposed same bits |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: | --- | --- |"
             " --- |"]
    for r in results:
        best_name, best = r["best"]
        lines.append(f"| {r['name']} | {r['m']} | {r['cublas_us']:.1f} | {r['linear_us']:.1f} | "
                     f"{r['invariant_us']:.1f} | {best:.1f} | {best_name} | "
                     f"{best / r['linear_us']:.2f} | {best / r['invariant_us']:.2f} | "
                     f"{r['rel_err']:.1e} | {r['tilings_same_bits']} | "
                     f"{r['rows_alone_same_bits']} | {r['transposed_same_bits']} |")
    lines += ["", "Every tiling timed, per shape and M:", ""]
    for r in results:
        lines.append(f"- {r['name']} M={r['m']}: " + ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(r["tilings"].items(), key=lambda kv: kv[1])))
    (out / "gemm_sequential_tiles.md").write_text("\n".join(lines) + "\n")
    (out / "gemm_sequential_tiles.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
