"""Does the batch-invariant GEMM's split shape lose time to its last, partial
wave? One row, the gate/up shape (silu, K = 4096), the weight rows N_w in
256-row steps from 23,808 to 29,952: the grid is N_w / 128 column tiles x 8
chunks, three blocks an SM, so the waves run from 3.76 to 4.73 on an H100.
If a partial wave cost time, the weight rate (TB/s) would dip as a wave
starts to fill; it is timed with programmatic launches on (as in a decode
step: the next launch's weights load during the tail) and off.

Timing: a CUDA graph of 20 launches, replayed 5 times, CUDA events.

    python benchmarks/gpu_split_waves.py --out DIR

Writes split_waves.md into DIR. GPU only."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from turbomq.worker.model.ops import cuda as cuda_ops

K = 4096
ROWS = list(range(23808, 30000, 256))


def rate(w: torch.Tensor, x: torch.Tensor) -> float:
    """Microseconds a launch."""
    for _ in range(5):
        cuda_ops.linear_invariant(x, w, silu=True, path="split")
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            cuda_ops.linear_invariant(x, w, silu=True, path="split")
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / 100


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason is not None:
        raise SystemExit(f"gpu_split_waves: {reason}")
    torch.manual_seed(0)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    x = torch.randn(1, K, device="cuda", dtype=torch.bfloat16)
    table = {}
    for pdl in (True, False):
        cuda_ops._k.set_programmatic_launch(pdl)
        for n_w in ROWS:
            w = torch.randn(n_w, K, device="cuda", dtype=torch.bfloat16) * 0.02
            table[(pdl, n_w)] = rate(w, x)
            del w
    cuda_ops._k.set_programmatic_launch(True)
    lines = ["# Split shape: time against waves (one row, gate/up shape)", "",
             f"{torch.cuda.get_device_name()}, {sms} SMs; `python benchmarks/gpu_split_waves.py "
             "--out DIR`. Blocks = N_w / 128 x 8 chunks, three an SM.", "",
             "| N_w | blocks | waves | µs (PDL on) | TB/s | µs (PDL off) | TB/s |",
             "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for n_w in ROWS:
        blocks = n_w // 128 * 8
        on, off = table[(True, n_w)], table[(False, n_w)]
        nbytes = n_w * K * 2
        lines.append(f"| {n_w} | {blocks} | {blocks / (3 * sms):.2f} | {on:.2f} | "
                     f"{nbytes / on / 1e6:.3f} | {off:.2f} | {nbytes / off / 1e6:.3f} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "split_waves.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
