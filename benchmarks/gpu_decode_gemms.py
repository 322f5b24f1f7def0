"""The projections of a decode step at M rows, against the time their
weights take to stream: Llama-3-8B's four projections (qkv, o, gate/up,
down) over 32 layers of distinct weights (so every weight comes from HBM,
as in a step), each form captured in one CUDA graph and replayed.

Products alone: bf16 (F.linear, cuBLAS); FP8 with row-wise scales
(torch._scaled_mm, the scales in its epilogue); FP8 with one scale per
tensor and an fp32 product (the configurations cuBLASLt offers beyond the
row-wise one). As the engine runs them (ops.linear, the norm fused into
qkv's and gate/up's input, silu_mul after gate/up, the o and down products
added into the residual): bf16; FP8 row-wise (x quantized per projection);
FP8 per tensor with the scales and the epilogue in one launch after it
(`FP8_TENSORWISE_MAX_ROWS`). Per projection kind and per step, ms per graph
replay, the median of 20, and the weight-streaming floor (the weights'
bytes at the copy bandwidth measured in the same run).

    python benchmarks/gpu_decode_gemms.py --out DIR [--rows 16 32 64 128 256]

Writes decode_gemms.md and decode_gemms.json into DIR."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import ceilings, median_ms, publish  # noqa: E402

from turbomq.worker.model.ops import cuda as cuda_ops  # noqa: E402
from turbomq.worker.model.ops.fp8 import quantize_rows, quantize_weight  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
FORMS = ("bf16", "fp8 row-wise", "fp8 per tensor, fp32 out",
         "bf16 linear", "fp8 linear, row-wise", "fp8 linear, per tensor")
NORMED = ("qkv", "gate_up")  # the norm fused into their input, as in the model


def weights(layers: int) -> dict[str, list]:
    """kind -> per layer (bf16 weight, FP8 weight), seeded."""
    g = torch.Generator(device="cuda").manual_seed(0)
    out: dict[str, list] = {}
    for kind, (n, k) in SHAPES.items():
        out[kind] = []
        for _ in range(layers):
            w = torch.randn(n, k, generator=g, device="cuda", dtype=torch.bfloat16) * 0.02
            out[kind].append((w, quantize_weight(w)))
    return out


def projection(form: str, kind: str, x, xq, sx, w, w8, one, norm, residual):
    """One projection of `form`; the inputs are prepared outside the graph."""
    if form == "bf16":
        return lambda: F.linear(x, w)
    if form == "fp8 row-wise":
        sw = w8.scale[None, :]
        return lambda: torch._scaled_mm(xq, w8.data.t(), scale_a=sx, scale_b=sw,
                                        out_dtype=torch.bfloat16)
    if form == "fp8 per tensor, fp32 out":
        return lambda: torch._scaled_mm(xq, w8.data.t(), scale_a=one, scale_b=one,
                                        out_dtype=torch.float32)
    kw = dict(norm=norm) if kind in NORMED else dict(residual=residual)
    if kind == "gate_up":
        kw["silu"] = True
    weight = w if form == "bf16 linear" else w8
    return lambda: cuda_ops.linear(x, weight, **kw)


def graph_of(calls) -> torch.cuda.CUDAGraph:
    """The calls captured in order into one graph (after a warm-up run)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    return graph


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 256])
    ap.add_argument("--layers", type=int, default=32)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    bandwidth = ceilings()["copy_GBps"]
    ws = weights(args.layers)
    one = torch.ones((), device="cuda", dtype=torch.float32)
    norm = (torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5, 1e-5)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_GBps": bandwidth, "layers": args.layers, "ms": {}}
    floors = {}  # kind -> (bf16 ms, fp8 ms) of streaming the kind's weights once
    for kind, (n, k) in SHAPES.items():
        params = n * k * args.layers
        floors[kind] = (2 * params / bandwidth / 1e6, params / bandwidth / 1e6)
    floors["step"] = tuple(sum(f[i] for f in floors.values()) for i in (0, 1))
    for m in args.rows:
        xs = {}
        for k in {k for _, k in SHAPES.values()}:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            xs[k] = (x, *quantize_rows(x))
        residual = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        for form in FORMS:
            # captured into the graphs: the per-tensor path or the row-wise one
            cuda_ops.FP8_TENSORWISE_MAX_ROWS = 1 << 30 if form.endswith("per tensor") else 0
            per_kind = {}
            for kind, (n, k) in SHAPES.items():
                x, xq, sx = xs[k]
                per_kind[kind] = [projection(form, kind, x, xq, sx, w, w8, one, norm, residual)
                                  for w, w8 in ws[kind]]
            step = [c for layer in zip(*per_kind.values()) for c in layer]  # layer by layer
            for kind, calls in (*per_kind.items(), ("step", step)):
                graph = graph_of(calls)
                results["ms"][f"{m}|{form}|{kind}"] = median_ms(graph.replay)
                del graph
            print(m, form, {kind: round(results["ms"][f"{m}|{form}|{kind}"], 3)
                            for kind in (*SHAPES, "step")}, flush=True)
    lines = ["# The projections of a decode step against their weights' streaming", "",
             f"{results['device']}, torch {results['torch']}; "
             f"`python benchmarks/gpu_decode_gemms.py --out DIR --rows {' '.join(map(str, args.rows))}`. "
             "Llama-3-8B's projections over "
             f"{args.layers} layers of distinct weights, each form one CUDA graph, ms per replay "
             f"(median of 20); floor: the weights' bytes at the copy bandwidth measured in the "
             f"same run ({bandwidth:,.0f} GB/s), bf16 / FP8. All rows from one run.", ""]
    for kind in (*SHAPES, "step"):
        lines += [f"## {kind} (floor {floors[kind][0]:.3f} / {floors[kind][1]:.3f} ms)", "",
                  "| rows | " + " | ".join(FORMS) + " |", "| ---: |" + " ---: |" * len(FORMS)]
        for m in args.rows:
            lines.append(f"| {m} | " + " | ".join(
                f"{results['ms'][f'{m}|{form}|{kind}']:.3f}" for form in FORMS) + " |")
        lines.append("")
    results["floors_ms"] = floors
    publish(args.out, "decode_gemms", lines, results)


if __name__ == "__main__":
    main()
