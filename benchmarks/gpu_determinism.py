"""Deterministic mode against the default, in one run on one GPU: a
Llama-3-8B-shaped model with random bf16 weights (benchmarks/gpu_engine.py),
the same weights behind both engines.

Figures, per mode:
- batch-invariance: P prompts generated alone, then inside one batch with
  other requests, greedy; how many come out different, and after how many
  tokens the first difference;
- batch-1 decode tok/s (128-token prompt, 256 generated);
- offline ShareGPT-like throughput (N requests, all submitted at once).

    python benchmarks/gpu_determinism.py --out DIR [--requests 1000]

Writes determinism.md and determinism.json into DIR (copy them to docs/benchmarks/)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import (GREEDY, LLAMA3_8B, ab_arguments, ab_engine, ab_speed_rows, ceilings,  # noqa: E402
                        random_tensors, sharegpt_like, speeds)

from turbomq.worker import Engine, SamplingParams  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402

MODES = (("default", False), ("deterministic", True))  # (name, deterministic)


def invariance(engine: Engine, probes: list[list[int]], fillers: list[list[int]]) -> dict:
    params = SamplingParams(max_tokens=64, **GREEDY)
    alone = [engine.generate(input_ids=[p], params=params)[0].token_ids for p in probes]
    mixed = engine.generate(input_ids=fillers[:len(fillers) // 2] + probes
                            + fillers[len(fillers) // 2:], params=params)
    batched = [r.token_ids for r in mixed[len(fillers) // 2:len(fillers) // 2 + len(probes)]]
    firsts = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None)
              for x, y in zip(alone, batched)]
    differ = [f for f in firsts if f is not None]
    return {"probes": len(probes), "batch": len(probes) + len(fillers),
            "differ": len(differ), "first_difference_at": differ}


def main() -> None:
    args = ab_arguments(__doc__.split("\n\n")[0])
    cfg = LLAMA3_8B
    tensors = random_tensors(cfg)
    rng = np.random.default_rng(5)
    probes = [rng.integers(1000, 120000, size=int(n)).tolist() for n in rng.integers(20, 600, 8)]
    fillers = [rng.integers(1000, 120000, size=int(n)).tolist() for n in rng.integers(4, 900, 40)]
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "requests": args.requests,
               "ceilings": ceilings(), "modes": {}}
    for name, deterministic in MODES:
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, deterministic=deterministic)
        engine = ab_engine(model, args.max_batch_size, deterministic=deterministic)
        r = {"invariance": invariance(engine, probes, fillers)}
        print(name, "invariance", r["invariance"], flush=True)
        r.update(speeds(engine, cfg, results["ceilings"], work if args.requests else [], name))
        results["modes"][name] = r
        engine.close()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    (args.out / "determinism.json").write_text(json.dumps(results, indent=2) + "\n")
    write_report(args, results)


def write_report(args, results: dict) -> None:
    d, x = results["modes"]["default"], results["modes"]["deterministic"]
    lines = [
        "# Deterministic mode against the default",
        "",
        f"{results['device']}; Llama-3-8B shape, random bf16 weights, bf16 KV, greedy; the same "
        "weights behind both engines, one run: `python benchmarks/gpu_determinism.py --out DIR`.",
        "",
        "| figure | default | deterministic | deterministic / default |",
        "| --- | ---: | ---: | ---: |",
    ]
    inv_d, inv_x = d["invariance"], x["invariance"]
    changed = (f"| prompts whose tokens change inside a batch of {inv_d['batch']} (of "
               f"{inv_d['probes']}, 64 tokens) | {inv_d['differ']} |")
    lines.append(f"{changed} {inv_x['differ']} | |")
    lines += ab_speed_rows(d, x, args.requests)
    lines += ["", f"Default mode: the first difference came after {inv_d['first_difference_at']} "
              "tokens. Targets: deterministic offline >= 0.95x and batch-1 decode >= 0.97x of "
              "the default."]
    (args.out / "determinism.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
