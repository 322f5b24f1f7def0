"""The deterministic batch-1 decode step with and without attention's
load-ahead (each warp loading its next 16-token group while it computes the
current one), beside the default mode's step, on a Llama-3-8B-shaped model
(random weights), one GPU.

Each figure is the mean of 300 replays of the batch-1 decode graph (after
30), at 256- and 384-token contexts; the deterministic variants are captured
twice, in opposite orders, the default before and after them.

    python benchmarks/gpu_load_ahead.py --out DIR

Writes load_ahead.md and load_ahead.json into DIR.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_engine  # noqa: E402

from turbomq.worker.model.llama import LlamaModel  # noqa: E402
from turbomq.worker.model.ops import invariant  # noqa: E402

CFG = gpu_engine.LLAMA3_8B
CONTEXTS = (256, 384)


def step_ms(model: LlamaModel, context: int, replays: int = 300) -> float:
    graphs, graph, kv = gpu_engine.batch1_decode_graph(model, context)
    ms = gpu_engine.mean_replay_ms(graph, replays, warmup=30)
    del graphs, graph, kv
    gc.collect()
    torch.cuda.empty_cache()
    return ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    tensors = gpu_engine.random_tensors(CFG)
    steps: dict[str, list[float]] = {}

    def default_steps() -> None:
        model = LlamaModel(CFG, tensors, "cuda", torch.bfloat16)
        for ctx in CONTEXTS:
            steps.setdefault(f"default, {ctx}", []).append(step_ms(model, ctx))
        del model
        gc.collect()
        torch.cuda.empty_cache()

    default_steps()
    det = LlamaModel(CFG, tensors, "cuda", torch.bfloat16, deterministic=True)
    for order in ((False, True), (True, False)):
        for ahead in order:
            invariant.LOAD_AHEAD = ahead
            for ctx in CONTEXTS:
                name = f"deterministic, {'load-ahead' if ahead else 'loads in turn'}, {ctx}"
                steps.setdefault(name, []).append(step_ms(det, ctx))
                print(name, f"{steps[name][-1]:.4f}", flush=True)
    invariant.LOAD_AHEAD = True
    del det
    gc.collect()
    torch.cuda.empty_cache()
    default_steps()

    args.out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    lines = [f"# Deterministic decode step, attention's load-ahead ({device})", "",
             "`python benchmarks/gpu_load_ahead.py --out DIR`: means of 300 graph replays "
             "(ms), two captures each.", "",
             "| step | context | ms | default / this |", "| --- | ---: | ---: | ---: |"]
    for name, times in steps.items():
        label, ctx = name.rsplit(", ", 1)
        ratio = np.mean(steps[f"default, {ctx}"]) / np.mean(times)
        lines.append(f"| {label} | {ctx} | {' / '.join(f'{t:.3f}' for t in times)} | {ratio:.4f} |")
    (args.out / "load_ahead.md").write_text("\n".join(lines) + "\n")
    (args.out / "load_ahead.json").write_text(json.dumps({"device": device, "steps": steps},
                                                         indent=1) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
