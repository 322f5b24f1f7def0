"""Page-locked host memory for the host-RAM KV tier: torch's
`pin_memory=True` against `runner.pinned_zeros` (pages faulted in by
several threads, then the range registered with the driver), by size:
seconds to get it, GiB locked, and device-to-host copy speed into it.

    python benchmarks/gpu_pinned_memory.py --out DIR [--gib 8 24]

Writes pinned_memory.md and pinned_memory.json to --out."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from gpu_engine import publish
from turbomq.worker.engine.runner import pinned_zeros

GIB = 1 << 30
COPY = 1 << 30  # bytes of each timed device-to-host copy


def copy_GBps(host: torch.Tensor) -> float:
    dev = torch.empty(COPY, dtype=torch.uint8, device="cuda")
    dst = host.view(-1).view(torch.uint8)[:COPY]
    dst.copy_(dev, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dst.copy_(dev, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * COPY / (time.perf_counter() - t0) / 1e9


def measure(mode: str, gib: int) -> dict:
    nbytes = gib * GIB - 3 * 4096  # the tier's size is whatever its blocks make
    held = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    t0 = time.perf_counter()
    if mode == "pin_memory=True":
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        locked = torch.cuda.host_memory_stats()["allocated_bytes.current"] - held
    else:
        host = pinned_zeros((nbytes,), torch.uint8)
        locked = nbytes
    seconds = time.perf_counter() - t0
    out = {"mode": mode, "GiB asked": gib, "seconds": seconds, "GiB locked": locked / GIB,
           "d2h_GBps": copy_GBps(host)}
    del host
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--gib", type=int, nargs="+", default=[8, 24])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.empty(1, device="cuda")  # the context first: it is not what is timed
    rows = [measure(mode, gib) for gib in args.gib
            for mode in ("pin_memory=True", "runner.pinned_zeros")]
    lines = [f"# Pinned host memory ({torch.cuda.get_device_name()}, {os.cpu_count()} cores)", "",
             "`python benchmarks/gpu_pinned_memory.py --out DIR`: page-locked host memory "
             "as the host-RAM KV tier gets it. torch's `pin_memory=True` against "
             "`runner.pinned_zeros` (pages faulted in on up to 16 threads, then "
             "`cudaHostRegister`); seconds to get it, GiB locked (torch's pinned "
             "allocator's own count for it), and 1 GiB device-to-host copies into it. "
             "All rows from one run.", "",
             "| asked GiB | how | seconds | GiB locked | device-to-host GB/s |",
             "| ---: | --- | ---: | ---: | ---: |"]
    lines += [f"| {r['GiB asked']} | {r['mode']} | {r['seconds']:.2f} | {r['GiB locked']:.1f} | "
              f"{r['d2h_GBps']:.1f} |" for r in rows]
    publish(args.out, "pinned_memory", lines, rows)


if __name__ == "__main__":
    main()
