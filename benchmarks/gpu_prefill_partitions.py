"""The prefill-attention kernel's split-K partitions, swept: for a short
turn over a long history (129 new tokens over 4k, 8k, 16k keys) and a
1024-token chunk, µs a call at each number of partitions, beside the
planner's choice (plan_prefill_partitions), Llama-3-8B heads (32 query, 8
KV, head_dim 128), bf16, 64-token blocks through a shuffled block table.
Every plan's output is checked against the planner's (the partitions only
change the order of the sums).

    python benchmarks/gpu_prefill_partitions.py --out DIR [--cases 8k ...]

Timing: CUDA graphs of 5 calls, median of 10 replays (gpu_kernels.time_graph).
Writes prefill_partitions.md and prefill_partitions.json into DIR.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_kernels  # noqa: E402

from turbomq.worker.model.ops import cuda as cuda_ops  # noqa: E402

H, KV, D = gpu_kernels.NUM_HEADS, gpu_kernels.NUM_KV_HEADS, gpu_kernels.HEAD_DIM
CASES = gpu_kernels.HISTORY_CASES
PARTS = [1, 2, 3, 4, 5, 6, 7, 8, 10, 11, 12, 14, 16, 22, 32]


def bench_case(name: str, n: int, ctx: int) -> dict:
    q, kv, batch = gpu_kernels.history_case(n, ctx)
    flops = 4 * sum(ctx - n + i + 1 for i in range(n)) * H * D
    planner = cuda_ops.plan_prefill_partitions
    call = lambda i: cuda_ops.paged_attention(q, kv, batch, D ** -0.5)  # noqa: E731
    tiles = -(-n * (H // KV) // cuda_ops._k.PREFILL_TILE_ROWS)
    planned = planner(tiles * KV, ctx, cuda_ops._sm_count(q.device),
                      cuda_ops.prefill_blocks_per_sm(q, kv))
    want = call(0).float()
    row = {"case": name, "new": n, "keys": ctx, "planned": list(planned), "plans": []}
    try:
        for parts in PARTS:
            size = -(-(-(-ctx // 64)) // parts) * 64  # the kernel's cut: 64-key tiles
            if parts > 1 and -(-ctx // size) != parts:
                continue  # the same partitions as a smaller count
            plan = (0, 1) if parts == 1 else (64, parts)
            cuda_ops.plan_prefill_partitions = lambda *_, plan=plan: plan
            err = (call(0).float() - want).abs().max().item()
            t = gpu_kernels.time_graph(call, calls=5, reps=10)
            row["plans"].append({"parts": parts, "size": size, "us": t * 1e6,
                                 "TFLOPs": flops / t / 1e12, "max_abs_diff": err})
            print(name, parts, f"{t * 1e6:.1f} us", f"diff {err:.2e}", flush=True)
    finally:
        cuda_ops.plan_prefill_partitions = planner
    return row


def markdown(device: str, sm: int, rows: list[dict]) -> str:
    lines = [f"# Prefill attention's split-K partitions ({device}, {sm} SMs)", "",
             "`python benchmarks/gpu_prefill_partitions.py --out DIR`: µs a call (TFLOP/s",
             "of the causal work) at each number of partitions; **bold**: the planner's.", ""]
    for r in rows:
        lines += [f"## {r['case']}: {r['new']} new tokens over {r['keys']} keys", "",
                  "| partitions | keys each | µs | TFLOP/s | max abs diff to the planner's |",
                  "| ---: | ---: | ---: | ---: | ---: |"]
        for p in r["plans"]:
            mark = "**" if p["parts"] == r["planned"][1] else ""
            lines.append(f"| {mark}{p['parts']}{mark} | {p['size']} | {p['us']:.1f} "
                         f"| {p['TFLOPs']:.0f} | {p['max_abs_diff']:.1e} |")
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    ap.add_argument("--cases", nargs="*", default=None,
                    help="run only the cases whose names contain one of these")
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    device, sm = torch.cuda.get_device_name(), cuda_ops._sm_count(torch.device("cuda"))
    rows = [bench_case(*case) for case in CASES
            if args.cases is None or any(c in case[0] for c in args.cases)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "prefill_partitions.json").write_text(
        json.dumps({"device": device, "sm_count": sm, "cases": rows}, indent=2) + "\n")
    text = markdown(device, sm, rows)
    (out / "prefill_partitions.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
