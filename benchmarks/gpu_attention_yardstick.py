"""The paged prefill-attention kernel against PyTorch's fused attention
(cuDNN and FlashAttention backends of scaled_dot_product_attention) on one
CUDA GPU, as a yardstick: Llama-3-8B heads (32 query, 8 KV, head_dim 128),
bf16, new tokens over a history (the 128-token turn on 4k, 8k and 16k
sessions, 129 rows with the reply's last token; a 1024-token chunk over 7k).

The kernel reads K/V through a block table (64-token blocks, shuffled);
SDPA reads contiguous K/V with enable_gqa and no mask, so it computes the
whole rectangle of new tokens x keys (the causal corner it adds is under 1%
of the turns' work, 6% of the chunk's). TFLOP/s count the causal work
(4 x keys seen x heads x head_dim) for every backend. Timing: CUDA graphs of
5 calls, median of 10 replays (benchmarks/gpu_kernels.py's time_graph).

    python benchmarks/gpu_attention_yardstick.py --out DIR

Writes attention_yardstick.md and attention_yardstick.json into DIR.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from turbomq.worker.model.ops import cuda as cuda_ops

_spec = importlib.util.spec_from_file_location("gpu_kernels",
                                               Path(__file__).with_name("gpu_kernels.py"))
gpu_kernels = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_kernels)
H, KV, D = gpu_kernels.NUM_HEADS, gpu_kernels.NUM_KV_HEADS, gpu_kernels.HEAD_DIM
CASES = gpu_kernels.HISTORY_CASES
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


def bench_case(name: str, n: int, ctx: int) -> dict:
    hist = ctx - n
    q, kv, batch = gpu_kernels.history_case(n, ctx)
    flops = 4 * sum(hist + i + 1 for i in range(n)) * H * D
    row = {"case": name, "new": n, "keys": ctx}
    t = gpu_kernels.time_graph(lambda i: cuda_ops.paged_attention(q, kv, batch, D ** -0.5),
                               calls=5, reps=10)
    row["turbomq"] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12}
    qd = q.transpose(0, 1).unsqueeze(0).contiguous()
    kd = torch.randn((1, KV, ctx, D), dtype=torch.bfloat16, device="cuda")
    vd = torch.randn_like(kd)
    for backend, kind in BACKENDS.items():
        try:
            with sdpa_kernel(kind):
                t = gpu_kernels.time_graph(
                    lambda i: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True),
                    calls=5, reps=10)
            row[backend] = {"us": t * 1e6, "TFLOPs": flops / t / 1e12}
        except RuntimeError as e:  # this PyTorch or GPU lacks the backend
            row[backend] = {"error": str(e).splitlines()[0][:160]}
    print(json.dumps(row), flush=True)
    return row


def markdown(device: str, rows: list[dict]) -> str:
    lines = [f"# Attention yardstick ({device})", "",
             "`python benchmarks/gpu_attention_yardstick.py --out DIR`: the paged",
             "prefill-attention kernel (64-token blocks through a block table) against",
             "PyTorch's scaled_dot_product_attention on contiguous K/V (enable_gqa, no",
             "mask: the whole rectangle), one run. µs a call (TFLOP/s of the causal work).",
             "", "| case | new tokens | keys | turbomq | cuDNN | FlashAttention |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        cells = []
        for b in ("turbomq", *BACKENDS):
            v = r[b]
            cells.append("n/a" if "error" in v else f"{v['us']:.0f} ({v['TFLOPs']:.0f})")
        lines.append(f"| {r['case']} | {r['new']} | {r['keys']} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks")
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    rows = [bench_case(*case) for case in CASES]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention_yardstick.json").write_text(
        json.dumps({"device": device, "torch": torch.__version__, "cases": rows}, indent=2) + "\n")
    text = markdown(device, rows)
    (out / "attention_yardstick.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
