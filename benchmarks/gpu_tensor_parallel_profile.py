"""Where tensor parallelism's offline time goes: the top kernels of rank 0
over the same window of offline steps on one GPU and on two (Llama-3-8B
shape, random bf16 weights, the engines of benchmarks/gpu_tensor_parallel.py
at --max-batch-size slots). The workload is deterministic (greedy, ignore
EOS), so both engines schedule the same steps: after --warm steps of
--requests ShareGPT-like requests submitted at once, --steps steps timed
without a profiler, --steps under cProfile (rank 0's host functions), and
--steps under torch.profiler (its kernels, summed by kind too).

Kernels launched as programmatic dependents start early and wait inside for
the kernel before them, so their times include that wait: compare a
kernel's total between the engines, not the totals' sum with the wall time.

    python benchmarks/gpu_tensor_parallel_profile.py --out DIR   (on a machine with 2 GPUs)

Writes tp_offline_profile.txt into DIR."""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import profile_steps, sharegpt_like, submit_all  # noqa: E402
from gpu_tensor_parallel import all_reduce_mode, make_engine, write_checkpoint  # noqa: E402

ENGINES = (("1 GPU", dict(tensor_parallel=1)), ("2 GPUs", dict(tensor_parallel=2)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-batch-size", type=int, default=512)
    ap.add_argument("--requests", type=int, default=1500)
    ap.add_argument("--warm", type=int, default=150)
    ap.add_argument("--steps", type=int, default=100)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        raise SystemExit("tensor parallel profile: needs 2 CUDA devices")
    work = sharegpt_like(args.requests)
    w, n = args.warm, args.steps
    sections = [f"# {Path(__file__).name}, {torch.cuda.get_device_name()}: rank 0, "
                f"{args.requests} offline requests at {args.max_batch_size} slots; steps "
                f"{w}-{w + n - 1} unprofiled, {w + n}-{w + 2 * n - 1} under cProfile, "
                f"{w + 2 * n}-{w + 3 * n - 1} under torch.profiler"]
    all_reduce_mode("peer")
    with tempfile.TemporaryDirectory(prefix="turbomq-tp-") as path:
        write_checkpoint(path)
        for name, case in ENGINES:
            engine = make_engine(path, case, args.max_batch_size)
            submit_all(engine, work)
            for _ in range(args.warm):
                engine.step()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):  # the same number of steps unprofiled, for the wall
                engine.step()
            torch.cuda.synchronize()
            plain = time.perf_counter() - t0
            host = cProfile.Profile()  # rank 0's host time by function
            host.enable()
            for _ in range(args.steps):
                engine.step()
            torch.cuda.synchronize()
            host.disable()
            text = io.StringIO()
            pstats.Stats(host, stream=text).sort_stats("tottime").print_stats(25)
            wall, table = profile_steps(engine, args.steps)
            sections.append(f"== {name}: {args.steps} steps {plain * 1e3:.0f} ms unprofiled, the "
                            f"next {args.steps} {wall * 1e3:.0f} ms profiled\n{table}\n"
                            f"rank 0's host functions over the {args.steps} steps between:\n"
                            f"{text.getvalue()}")
            print(sections[-1], flush=True)
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
    (args.out / "tp_offline_profile.txt").write_text("\n\n".join(sections) + "\n")


if __name__ == "__main__":
    main()
