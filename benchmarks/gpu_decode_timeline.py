"""Where one batch-1 decode step's time goes, kernel by kernel, on a
Llama-3-8B-shaped model (random weights), one GPU, per weight mode.

One replay of the batch-1 decode graph (256-token context) is profiled, and
each kernel is charged the time from the previous kernel's end to its own
end: with programmatic launch a kernel starts while the one before it runs,
so its duration overstates what it adds to the step, and the charges add
up to the step. Projections are named by their place in the layer (qkv,
o, gate_up, down; the rest by kernel name), summed over the 32
layers, with the weight bytes each projection reads over its charge.

    python benchmarks/gpu_decode_timeline.py --out DIR [--modes bf16 fp8-lm-head deterministic]
        [--replays N]

Besides the profiled replay, the step is timed as the mean of N unprofiled
replays (CUDA events; 300 by default), the figure to compare builds by.

Writes decode_timeline.md and decode_timeline.json into DIR.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from turbomq.worker.model.llama import LlamaModel

_spec = importlib.util.spec_from_file_location("gpu_engine", Path(__file__).with_name("gpu_engine.py"))
gpu_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_engine)
CFG = gpu_engine.LLAMA3_8B
PROJECTIONS = ("o", "gate_up", "down", "qkv")  # the projections after each attention


def weight_bytes(mode: str) -> dict[str, int]:
    h, inter = CFG.hidden_size, CFG.intermediate_size
    per = 1 if mode.startswith("fp8") else 2
    shapes = {"qkv": (CFG.q_size + 2 * CFG.kv_size) * h, "o": h * CFG.q_size,
              "gate_up": 2 * inter * h, "down": h * inter}
    out = {k: n * per for k, n in shapes.items()}
    out["lm_head"] = CFG.vocab_size * h * (1 if mode == "fp8-lm-head" else 2)
    return out


def step_kernels(mode: str, replays: int) -> tuple[list[tuple[str, float, float]], float]:
    """(name, start µs, end µs) of every kernel of one profiled batch-1 decode
    replay, and the mean step of `replays` unprofiled ones (ms)."""
    quant = None if mode in ("bf16", "deterministic") else mode
    model = LlamaModel(CFG, gpu_engine.random_tensors(CFG), "cuda", torch.bfloat16,
                       quantization=quant, deterministic=mode == "deterministic")
    graphs, graph, kv = gpu_engine.batch1_decode_graph(model, 256)
    step_ms = gpu_engine.mean_replay_ms(graph, replays)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    kernels = sorted(((e.name, e.time_range.start, e.time_range.end) for e in prof.events()
                      if e.device_type == DeviceType.CUDA), key=lambda k: k[1])
    del graphs, graph, model, kv
    gc.collect()
    torch.cuda.empty_cache()
    return kernels, step_ms


def short_name(name: str) -> str:
    """A kernel's name without namespaces, template arguments or parameters."""
    base = name.replace("(anonymous namespace)::", "").split("(")[0].split("<")[0]
    return base.split("::")[-1].replace("void ", "") or name[:60]


def label(kernels: list[tuple[str, float, float]]) -> list[str]:
    """Each kernel's place: the projections (GEMV or GEMM) counted from the
    layer's attention (o, gate_up, down, then the next layer's qkv), the
    first layer's qkv before the first attention, the LM head (the last
    projection); any other kernel by its short name."""
    names = []
    since = None  # projections since the last attention
    for name, _, _ in kernels:
        projection = "gemv" in name or "gemm" in name
        if "attention" in name:
            since = 0
            names.append("attention")
        elif projection and since is not None and since < len(PROJECTIONS):
            names.append(PROJECTIONS[since])
            since += 1
        else:
            names.append("qkv" if projection and since is None else short_name(name))
    projections = [i for i, (n, _, _) in enumerate(kernels) if "gemv" in n or "gemm" in n]
    if projections:
        names[projections[-1]] = "lm_head"
    return names


def charges(kernels: list[tuple[str, float, float]]) -> dict[str, dict]:
    names = label(kernels)
    out: dict[str, dict] = defaultdict(lambda: {"count": 0, "charge_us": 0.0, "duration_us": 0.0,
                                                "lead_us": 0.0})
    prev_end = kernels[0][1]
    for name, (_, start, end) in zip(names, kernels):
        r = out[name]
        r["count"] += 1
        r["charge_us"] += max(0.0, end - prev_end)
        r["duration_us"] += end - start
        r["lead_us"] += max(0.0, prev_end - start)  # how long it ran beside the previous kernel
        prev_end = max(prev_end, end)
    return dict(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", nargs="+", default=["bf16", "fp8-lm-head"],
                    choices=["bf16", "fp8", "fp8-lm-head", "deterministic"])
    ap.add_argument("--replays", type=int, default=300)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": torch.cuda.get_device_name(), "modes": {}}
    lines = ["# One batch-1 decode step, kernel by kernel", "",
             f"{results['device']}; Llama-3-8B shape, random weights, 256-token context; "
             "`python benchmarks/gpu_decode_timeline.py --out DIR`. Charge: the time from the "
             "previous kernel's end to this kernel's end, summed over the step; lead: how long "
             "it ran beside the kernel before it."]
    for mode in args.modes:
        kernels, replay_ms = step_kernels(mode, args.replays)
        c = charges(kernels)
        step = kernels[-1][2] - kernels[0][1]
        results["modes"][mode] = {"step_us": step, "replay_step_ms": replay_ms, "kernels": c}
        nbytes = weight_bytes(mode)
        lines += ["", f"## {mode}: step {step / 1e3:.3f} ms (mean of {args.replays} replays: "
                  f"{replay_ms:.3f} ms)", "",
                  "| kernel | count | charge µs (sum) | charge µs (each) | duration µs (each) "
                  "| lead µs (each) | GB/s over the charge |",
                  "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for name, r in sorted(c.items(), key=lambda kv: -kv[1]["charge_us"]):
            n = r["count"]
            gbs = (f"{nbytes[name] * n / r['charge_us'] / 1e3:,.0f}"
                   if name in nbytes and r["charge_us"] > 0 else "")
            lines.append(f"| {name} | {n} | {r['charge_us']:,.1f} | {r['charge_us'] / n:.2f} | "
                         f"{r['duration_us'] / n:.2f} | {r['lead_us'] / n:.2f} | {gbs} |")
        print("\n".join(lines[-len(c) - 4:]), flush=True)
    (args.out / "decode_timeline.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "decode_timeline.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
