"""Prefill graphs against eager prefills on one GPU, in one run, on a
Llama-3-8B-shaped model with random bf16 weights (benchmarks/gpu_engine.py):
time to first token of a lone prompt of 16, 128, 256 and 512 tokens (median
of 11 after a warm-up that captures the graph), and of a 128-token turn on
a resident 8k session against the same turn as a fresh prompt
(gpu_engine.multi_turn), with `prefill_graph_tokens` 0 (eager) and 512
(the default).

    python benchmarks/gpu_prefill_graphs.py --out DIR

Writes prefill_graphs.md and prefill_graphs.json into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import (GREEDY, LLAMA3_8B, ab_engine, multi_turn, random_tensors,  # noqa: E402
                        sync_time)

from turbomq.worker import SamplingParams  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402

PROMPTS = (16, 128, 256, 512)
MODES = (("eager prefill", 0), ("prefill graphs", 512))


def lone_ttft_ms(engines: dict, length: int, repeats: int = 11) -> dict:
    """Median TTFT of a lone prompt of `length` tokens per engine, the
    engines taking turns prompt by prompt (so that the machine's drift
    falls on both alike); the first round captures the graph."""
    params = SamplingParams(max_tokens=1, **GREEDY)
    times: dict = {name: [] for name in engines}
    for i in range(repeats + 1):
        prompt = list(range(2000 + 7 * i, 2000 + 7 * i + length))
        for name, engine in engines.items():
            t0 = sync_time()
            engine.generate(input_ids=[prompt], params=params)
            times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: float(np.median(t[1:])) for name, t in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description="prefill graphs against eager prefills")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = LlamaModel(LLAMA3_8B, random_tensors(LLAMA3_8B), "cuda", torch.bfloat16)
    results = {"device": torch.cuda.get_device_name(), "modes": {n: {} for n, _ in MODES}}
    # both engines at once (the second pool takes 80% of what the first left)
    engines = {name: ab_engine(model, 64, prefill_graph_tokens=tokens) for name, tokens in MODES}
    try:
        for n in PROMPTS:
            for name, ms in lone_ttft_ms(engines, n).items():
                results["modes"][name][f"ttft_{n}_ms"] = ms
            print(n, {name: r[f"ttft_{n}_ms"] for name, r in results["modes"].items()}, flush=True)
        for name, engine in engines.items():
            results["modes"][name]["turn_on_8k"] = multi_turn(engine, 8192)
            print(name, results["modes"][name]["turn_on_8k"], flush=True)
    finally:
        for engine in engines.values():
            engine.close()
    (args.out / "prefill_graphs.json").write_text(json.dumps(results, indent=2))
    eager, graphs = (results["modes"][n] for n, _ in MODES)
    rows = [f"# Prefill graphs ({results['device']}, Llama-3-8B shapes, random bf16 weights)", "",
            "`python benchmarks/gpu_prefill_graphs.py --out DIR`; both modes in one run, "
            "one engine each, taking turns prompt by prompt. Time to first token in ms, "
            "medians of 11.", "",
            "| prompt | eager prefill | prefill graphs | graphs / eager |",
            "| --- | ---: | ---: | ---: |"]
    for n in PROMPTS:
        a, b = eager[f"ttft_{n}_ms"], graphs[f"ttft_{n}_ms"]
        rows.append(f"| lone, {n} tokens | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    for key, label in (("hit_ttft_ms", "128-token turn on a resident 8k session"),
                       ("fresh_ttft_ms", "the same turn as a fresh prompt"),
                       ("hit_over_fresh", "turn on 8k / fresh turn")):
        a, b = eager["turn_on_8k"][key], graphs["turn_on_8k"][key]
        unit = "x" if key == "hit_over_fresh" else ""
        rows.append(f"| {label} | {a:.2f}{unit} | {b:.2f}{unit} | |")
    (args.out / "prefill_graphs.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
