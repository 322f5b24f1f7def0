"""Deterministic mode against the default, in one run on one GPU: a
Llama-3-8B-shaped model with random bf16 weights (benchmarks/gpu_engine.py),
the same weights behind both engines.

Figures, per mode:
- batch-invariance: P prompts generated alone, then inside one batch with
  other requests, greedy; how many come out different, and after how many
  tokens the first difference;
- batch-1 decode tok/s (128-token prompt, 256 generated);
- offline ShareGPT-like throughput (N requests, all submitted at once).
Deterministic mode runs three times: as by default on Hopper (its GEMM's
tiled shape on wgmma, the split shape on mma.sync), on mma.sync only
(TURBOMQ_INVARIANT_WGMMA=0), and with the tiled shape's k tiles loaded by
TMA (TURBOMQ_INVARIANT_TMA=1).

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
from turbomq.worker.model.ops import cuda as cuda_ops  # noqa: E402

# (name, deterministic, the invariant GEMM's tiled shape on wgmma, and with
# TMA loads). The split shape stays on mma.sync; deterministic mode's own
# default is the tiled shape on wgmma on Hopper (cuda.INVARIANT_WGMMA).
MODES = (("default", False, False, False), ("deterministic", True, True, False),
         ("deterministic_mma_sync", True, False, False), ("deterministic_tma", True, True, True))


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
    args = ab_arguments(__doc__.split("\n\n")[0], lambda ap: ap.add_argument(
        "--skip", nargs="*", default=[], choices=[m[0] for m in MODES[2:]],
        help="deterministic variants not to run"))
    cfg = LLAMA3_8B
    tensors = random_tensors(cfg)
    rng = np.random.default_rng(5)
    probes = [rng.integers(1000, 120000, size=int(n)).tolist() for n in rng.integers(20, 600, 8)]
    fillers = [rng.integers(1000, 120000, size=int(n)).tolist() for n in rng.integers(4, 900, 40)]
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "requests": args.requests,
               "ceilings": ceilings(), "modes": {}}
    for name, deterministic, wgmma, tma in MODES:
        if name in args.skip:
            continue
        cuda_ops.set_invariant_wgmma(wgmma)  # before the graphs are captured
        cuda_ops._k.set_gemm_invariant_tma(tma)
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, deterministic=deterministic)
        engine = ab_engine(model, args.max_batch_size, deterministic=deterministic)
        r = {"invariance": invariance(engine, probes, fillers)}
        print(name, "invariance", r["invariance"], flush=True)
        r.update(speeds(engine, cfg, results["ceilings"], work if args.requests else [], name))
        results["modes"][name] = r
        engine.close()
        cuda_ops.set_invariant_wgmma(cuda_ops.INVARIANT_WGMMA)
        cuda_ops._k.set_gemm_invariant_tma(cuda_ops.INVARIANT_TMA)
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
        "Deterministic mode as it runs by default on Hopper: its GEMM's tiled shape on "
        "`wgmma`, the split shape (up to 64 rows) on `mma.sync`:",
        "",
        "| figure | default | deterministic | deterministic / default |",
        "| --- | ---: | ---: | ---: |",
    ]
    inv_d, inv_x = d["invariance"], x["invariance"]
    changed = (f"| prompts whose tokens change inside a batch of {inv_d['batch']} (of "
               f"{inv_d['probes']}, 64 tokens) | {inv_d['differ']} |")
    lines.append(f"{changed} {inv_x['differ']} | |")
    lines += ab_speed_rows(d, x, args.requests)
    for mode, what, label in (
            ("deterministic_mma_sync", "its GEMM on `mma.sync` only (`TURBOMQ_INVARIANT_WGMMA=0`)",
             "mma.sync"),
            ("deterministic_tma", "its GEMM's tiled shape loading by TMA "
             "(`TURBOMQ_INVARIANT_TMA=1`)", "TMA")):
        m = results["modes"].get(mode)
        if m is None:
            continue
        lines += ["", f"Deterministic mode with {what}, same run:", "",
                  f"| figure | default | deterministic ({label}) "
                  f"| deterministic ({label}) / default |",
                  "| --- | ---: | ---: | ---: |",
                  f"{changed} {m['invariance']['differ']} | |"]
        lines += ab_speed_rows(d, m, args.requests)
    lines += ["", f"Default mode: the first difference came after {inv_d['first_difference_at']} "
              "tokens. Targets: deterministic offline >= 0.95x and batch-1 decode >= 0.97x of "
              "the default."]
    (args.out / "determinism.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
