"""The tensor-parallel all-reduce on two GPUs: NCCL against the peer-memory
kernel (native/cuda/all_reduce.cu) pulling, pushing, and its low-latency
kernel (LL: data and call number in each line; up to 256 KiB), per call, as
decode runs it: 64 calls in a row (two a layer of a 32-layer model), each adding
the sum into the residual stream, captured once as a CUDA graph and
replayed; from one decode row to 1024 (a large decode batch), where the
peer kernel should hand over to NCCL (TURBOMQ_PEER_ALL_REDUCE_BYTES; the
run raises it to take every size; --rows times other sizes, such as
prefill chunks). All rows from one run.

    python benchmarks/gpu_all_reduce.py --out DIR [--rows 1024 4096 8192]   (2 GPUs)

Writes all_reduce.md and all_reduce.json to --out.
"""

from __future__ import annotations

import argparse
import json
import socket
from pathlib import Path

import torch

CALLS = 64  # per graph: a 32-layer model's all-reduces of one decode step
REPLAYS = 50
HIDDEN = 4096
ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
MODES = ("NCCL", "peer, pull", "peer, push", "peer, LL")


def _rank(rank: int, port: int, results, row_counts: tuple[int, ...]) -> None:
    import torch.distributed as dist

    from turbomq.worker.model.ops import cuda as cuda_ops
    from turbomq.worker.model.parallel import ParallelConfig, TensorParallel

    tp = TensorParallel(ParallelConfig(2, rank, f"tcp://127.0.0.1:{port}"),
                        torch.device("cuda", rank))
    try:
        assert tp.peer is not None, "no peer all-reduce between the two GPUs"
        out = {}
        for mode in MODES:
            if mode != "NCCL":
                cuda_ops._k.set_all_reduce_push(not mode.endswith("pull"))
                ll = cuda_ops._k.ALL_REDUCE_LL_MAX_BYTES if mode.endswith("LL") else 0
                cuda_ops._k.set_all_reduce_ll_bytes(ll)
            for rows in row_counts:
                if mode.endswith("LL") and rows * HIDDEN * 2 > ll:
                    continue  # past the LL kernel's sizes
                x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
                res = torch.zeros_like(x)
                assert mode == "NCCL" or tp.peer.fits(x), f"{rows} rows exceed the peer buffer"

                def calls() -> None:
                    for _ in range(CALLS):
                        if mode == "NCCL":
                            part = x.clone()
                            dist.all_reduce(part)
                            res.add_(part)
                        else:
                            tp.all_reduce_into(res, x)

                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    calls()  # warm-up outside the capture
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    calls()
                for _ in range(5):
                    graph.replay()
                dist.barrier(group=tp.host_group)
                torch.cuda.synchronize()
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(REPLAYS):
                    graph.replay()
                end.record()
                end.synchronize()
                out[f"{mode}|{rows}"] = start.elapsed_time(end) * 1e3 / (REPLAYS * CALLS)
                del graph
        if rank == 0:
            results.put(out)
    finally:
        tp.leave()


def write_report(out: Path, r: dict) -> None:
    row_counts = r["rows"]
    rows = ["# Tensor-parallel all-reduce (2 GPUs, bf16, residual add fused)", "",
            f"{r['device']} x 2; `python benchmarks/gpu_all_reduce.py --out DIR`. Microseconds "
            f"per call: {CALLS} calls a graph (a 32-layer decode step's), {REPLAYS} replays, "
            f"rows of {HIDDEN}. All rows from one run.", "",
            "| rows | " + " | ".join(MODES) + " |",
            "| ---: |" + " ---: |" * len(MODES)]
    for n in row_counts:
        cells = (r["us"].get(f"{m}|{n}") for m in MODES)
        rows.append(f"| {n} | " + " | ".join("" if c is None else f"{c:.1f}" for c in cells) + " |")
    rows += ["", "docs/engine.md, Tensor parallel; native/cuda/all_reduce.cu."]
    (out / "all_reduce.md").write_text("\n".join(rows) + "\n")
    (out / "all_reduce.json").write_text(json.dumps(r, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=list(ROWS),
                    help="message sizes in rows of 4096")
    args = ap.parse_args()
    row_counts = tuple(args.rows)
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        raise SystemExit("all-reduce benchmark: needs 2 CUDA devices")
    import os

    import torch.multiprocessing as mp

    # every size through the peer kernel (the ranks read it at import)
    os.environ["TURBOMQ_PEER_ALL_REDUCE_BYTES"] = str(max(row_counts) * HIDDEN * 2)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    procs = [ctx.Process(target=_rank, args=(r, port, results, row_counts)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    if results.empty() or any(p.exitcode for p in procs):
        raise SystemExit("all-reduce benchmark: a rank failed")
    r = {"device": torch.cuda.get_device_name(0), "rows": list(row_counts), "us": results.get()}
    write_report(args.out, r)
    print((args.out / "all_reduce.md").read_text())


if __name__ == "__main__":
    main()
