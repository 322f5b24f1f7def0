"""Where deterministic mode's offline time goes: the top kernels of the same
window of offline steps in the default and the deterministic mode, one run
on one GPU, the same weights behind both (Llama-3-8B shape, random bf16
weights, benchmarks/gpu_engine.py). The workload is deterministic (greedy,
ignore EOS), so both modes schedule the same steps: steps 120-319 of 600
ShareGPT-like requests submitted at once.

Kernels launched as programmatic dependents start early and wait for the
kernel before them inside, so their times include that wait (rms_norm's
after the GEMM, for one): compare a kernel's total between the modes, not
the totals' sum with the window's wall time.

    python benchmarks/gpu_determinism_profile.py --out DIR

Writes determinism_profile.txt into DIR."""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import GREEDY, LLAMA3_8B, ab_engine, random_tensors, sharegpt_like  # noqa: E402

from turbomq.worker import SamplingParams  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402

WARM_STEPS, STEPS, REQUESTS = 120, 200, 600


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = LLAMA3_8B
    tensors = random_tensors(cfg)
    work = sharegpt_like(REQUESTS)
    sections = [f"# {Path(__file__).name}, {torch.cuda.get_device_name()}: steps "
                f"{WARM_STEPS}-{WARM_STEPS + STEPS - 1} of {REQUESTS} offline requests"]
    for name, det in (("default", False), ("deterministic", True)):
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, deterministic=det)
        engine = ab_engine(model, 256, deterministic=det)
        for prompt, out_len in work:
            engine.submit(input_ids=prompt, params=SamplingParams(max_tokens=out_len, **GREEDY),
                          callback=lambda e: None)
        for _ in range(WARM_STEPS):
            engine.step()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(STEPS):
                engine.step()
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=22,
                                          max_name_column_width=70)
        sections.append(f"== {name}: {STEPS} steps {wall * 1e3:.0f} ms (profiled)\n{table}")
        print(sections[-1], flush=True)
        while engine.has_work():
            engine.step()
        engine.close()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    (args.out / "determinism_profile.txt").write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
