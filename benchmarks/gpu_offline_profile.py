"""Where an engine mode's offline time goes: the top kernels of the same
window of offline steps in each mode (default: the default and the
deterministic mode; --modes picks, e.g. default fp8), one run on one GPU,
the same weights behind every mode (Llama-3-8B shape, random bf16 weights,
benchmarks/gpu_engine.py). The workload is deterministic (greedy, ignore
EOS), so every mode schedules the same steps: steps 120-319 of 600
ShareGPT-like requests submitted at once, at 256 slots.

Kernels launched as programmatic dependents start early and wait for the
kernel before them inside, so their times include that wait (the folded
norm's row-scale kernel after attention, for one). TURBOMQ_PDL=0 launches
every kernel plainly, so each one's time is its own and the group totals
compare between modes (docs/benchmarks/determinism_profile.txt was taken
so); either way compare kernel totals, not their sum with the window's
wall time (the profiler's overhead differs between modes).

    [TURBOMQ_PDL=0] python benchmarks/gpu_offline_profile.py --out DIR [--modes default fp8]

Writes offline_profile.txt into DIR."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import (LLAMA3_8B, ab_engine, profile_steps, random_tensors,  # noqa: E402
                        sharegpt_like, submit_all)

from turbomq.worker.model.llama import LlamaModel  # noqa: E402

WARM_STEPS, STEPS, REQUESTS, SLOTS = 120, 200, 600, 256
# mode -> (LlamaModel and EngineConfig keywords)
MODES = {"default": {}, "deterministic": {"deterministic": True}, "fp8": {"quantization": "fp8"}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--modes", nargs="+", choices=sorted(MODES),
                    default=["default", "deterministic"])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = LLAMA3_8B
    work = sharegpt_like(REQUESTS)
    sections = [f"# {Path(__file__).name}, {torch.cuda.get_device_name()}: steps "
                f"{WARM_STEPS}-{WARM_STEPS + STEPS - 1} of {REQUESTS} offline requests "
                f"at {SLOTS} slots"]
    for name in args.modes:
        options = MODES[name]
        tensors = random_tensors(cfg)  # the same weights each time (seeded)
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, **options)
        del tensors  # an FP8 model holds its own copies of what it quantized
        gc.collect()
        engine = ab_engine(model, SLOTS, **options)
        submit_all(engine, work)
        for _ in range(WARM_STEPS):
            engine.step()
        wall, table = profile_steps(engine, STEPS, rows=22)
        sections.append(f"== {name}: {STEPS} steps {wall * 1e3:.0f} ms (profiled)\n{table}")
        print(sections[-1], flush=True)
        engine.close()  # the rest of the work is not needed
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    (args.out / "offline_profile.txt").write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
