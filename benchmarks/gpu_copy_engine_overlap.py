"""Could the copy engines carry tensor parallelism's all-reduce beside the
GEMMs? Two GPUs of one process, torch only (no native kernels):

- exchange: each GPU copies its rows x 4096 bf16 partial sums into a buffer
  on the other (`copy_` across devices: a DMA copy engine over NVLink, no
  SM), the data movement of a two-rank all-reduce; alone, µs a call;
- a rank's down projection ([rows, 7168] x [7168, 4096], bf16) alone, µs a
  call;
- both at once on GPU 0 (the GEMMs on one stream, as many exchanges as
  span them on others): does either slow the other?

Every stream is first held by a sleeping kernel while the host queues the
calls, so the events time the device, not the host. All rows from one run.

    python benchmarks/gpu_copy_engine_overlap.py --out DIR   (2 GPUs)

Writes copy_engine_overlap.md and copy_engine_overlap.json to --out."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from gpu_engine import publish

HIDDEN, INTER = 4096, 7168  # Llama-3-8B's width, and its MLP's per rank at 2 ranks
CALLS = 64
HOLD_CYCLES = 200_000_000  # ~0.1 s: longer than the host takes to queue every call


def _held(streams: list) -> None:
    """Hold each stream with a sleeping kernel while calls are queued behind it."""
    for s in streams:
        with torch.cuda.device(s.device), torch.cuda.stream(s):
            torch.cuda._sleep(HOLD_CYCLES)


def _span(stream, body) -> tuple:
    """Events around `body`'s calls on `stream` (queued while it is held)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        start.record()
    body()
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        end.record()
    return start, end


def _cudart():
    """The CUDA runtime torch loaded (the same library, so the same device
    state), for cudaMemcpyAsync on a stream of our choosing: torch's own
    cross-device copy_ fences both devices' streams around every copy,
    which would run the two directions one after the other."""
    import ctypes

    torch.zeros(1, device="cuda")
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "libcudart.so" in line}
    if not paths:
        raise SystemExit("copy engine overlap: libcudart is not loaded")
    lib = ctypes.CDLL(sorted(paths)[0])
    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                                    ctypes.c_int, ctypes.c_void_p]
    lib.cudaSetDevice.argtypes = [ctypes.c_int]
    return lib


def measure(rt, rows: int) -> dict:
    d0, d1 = torch.device("cuda", 0), torch.device("cuda", 1)
    parts = [torch.randn(rows, HIDDEN, device=d, dtype=torch.bfloat16) for d in (d0, d1)]
    recv = [torch.empty_like(p) for p in parts]
    recv[1].copy_(parts[0])  # torch enables peer access both ways
    recv[0].copy_(parts[1])
    act = torch.randn(rows, INTER, device=d0, dtype=torch.bfloat16)
    weight = torch.randn(HIDDEN, INTER, device=d0, dtype=torch.bfloat16) * 0.01
    out = torch.empty(rows, HIDDEN, device=d0, dtype=torch.bfloat16)
    gemm_stream = torch.cuda.Stream(d0)
    copy_streams = [torch.cuda.Stream(d0), torch.cuda.Stream(d1)]
    nbytes = rows * HIDDEN * 2

    def exchange(calls: int) -> None:
        # GPU 0 -> 1 on GPU 0's copy stream, 1 -> 0 on GPU 1's (cudaMemcpyDefault: 4)
        for _ in range(calls):
            for src in (0, 1):
                rt.cudaSetDevice(src)
                err = rt.cudaMemcpyAsync(recv[1 - src].data_ptr(), parts[src].data_ptr(), nbytes,
                                         4, copy_streams[src].cuda_stream)
                assert err == 0, f"cudaMemcpyAsync: error {err}"
        torch.cuda.set_device(d0)

    def gemms() -> None:
        with torch.cuda.device(d0), torch.cuda.stream(gemm_stream):
            for _ in range(CALLS):
                torch.matmul(act, weight.t(), out=out)

    def run(with_gemms: bool, exchanges: int) -> dict:
        streams = ([gemm_stream] if with_gemms else []) + (copy_streams if exchanges else [])
        for _ in range(2):  # the second pass is timed
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
            _held(streams)
            spans = {}
            if with_gemms:
                spans["gemm"] = _span(gemm_stream, gemms)
            if exchanges:
                spans["exchange"] = _span(copy_streams[0], lambda: exchange(exchanges))
            torch.cuda.synchronize(d0)
            torch.cuda.synchronize(d1)
        calls = {"gemm": CALLS, "exchange": exchanges}
        return {k: s.elapsed_time(e) * 1e3 / calls[k] for k, (s, e) in spans.items()}

    F.linear(act, weight)  # cuBLAS's handle and plan made before timing
    alone_gemm = run(True, 0)["gemm"]
    alone_exchange = run(False, CALLS)["exchange"]
    # as many exchanges as keep the copy engines busy for the GEMMs' whole span
    both = run(True, max(1, round(CALLS * alone_gemm / alone_exchange)))
    return {"rows": rows, "bytes": nbytes, "exchange_us": alone_exchange,
            "exchange_GBps": nbytes / alone_exchange / 1e3, "gemm_us": alone_gemm,
            "gemm_beside_exchange_us": both["gemm"], "exchange_beside_gemm_us": both["exchange"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        raise SystemExit("copy engine overlap: needs 2 CUDA devices")
    rt = _cudart()
    results = {"device": torch.cuda.get_device_name(), "calls": CALLS,
               "rows": [measure(rt, r) for r in args.rows]}
    lines = [f"# Copy engines beside the GEMMs ({results['device']} x 2)", "",
             "`python benchmarks/gpu_copy_engine_overlap.py --out DIR`; µs a call, mean of "
             f"{CALLS} calls queued behind a held stream. Exchange: each GPU's rows x {HIDDEN} "
             "bf16 copied to the other by the copy engines; GEMM: [rows, "
             f"{INTER}] x [{INTER}, {HIDDEN}] bf16 on GPU 0.", "",
             "| rows | MiB | exchange alone | GB/s a direction | GEMM alone | GEMM beside exchange "
             "| exchange beside GEMM |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in results["rows"]:
        lines.append(f"| {r['rows']} | {r['bytes'] / 2 ** 20:.0f} | {r['exchange_us']:.1f} | "
                     f"{r['exchange_GBps']:.0f} | {r['gemm_us']:.1f} | "
                     f"{r['gemm_beside_exchange_us']:.1f} | {r['exchange_beside_gemm_us']:.1f} |")
    publish(args.out, "copy_engine_overlap", lines, results)


if __name__ == "__main__":
    main()
