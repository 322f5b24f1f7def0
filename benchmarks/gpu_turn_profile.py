"""Where a 128-token turn on a resident 8k session spends its GPU time,
against the same turn as a fresh prompt: both through the engine with its
defaults (prefill graphs on), on a Llama-3-8B-shaped model with random bf16
weights (benchmarks/gpu_engine.py). Each turn's kernels are summed by name
over one profiled turn (torch.profiler, kernels inside graph replays
included), after three unprofiled rounds that capture the graphs and give
the turns' times (medians, synchronized wall clock).

    python benchmarks/gpu_turn_profile.py --out DIR

Writes turn_profile.txt and turn_profile.json into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import GREEDY, LLAMA3_8B, ab_engine, multi_turn, random_tensors  # noqa: E402

from turbomq.worker import SamplingParams  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402

HISTORY = 8192


def kernels_of(run) -> dict[str, dict]:
    """GPU time (µs) and count of each kernel `run()` launches, by name."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict[str, dict] = defaultdict(lambda: {"us": 0.0, "count": 0})
    for e in prof.key_averages():
        us = getattr(e, "self_device_time_total", None)
        if us is None:
            us = e.self_cuda_time_total
        if e.device_type.name != "CUDA" or not us:
            continue
        out[e.key]["us"] += us
        out[e.key]["count"] += e.count
    return dict(out)


def short(name: str) -> str:
    name = name.replace("turbomq::cuda::(anonymous namespace)::", "")
    return name[:70]


def profiled_turns() -> tuple[dict, dict, dict]:
    """On a fresh engine with its defaults: the turns' times (multi_turn,
    which also captures the graphs), then the kernels of one profiled turn
    on a resident session and of the same turn fresh."""
    model = LlamaModel(LLAMA3_8B, random_tensors(LLAMA3_8B), "cuda", torch.bfloat16)
    engine = ab_engine(model, 64)
    try:
        times = multi_turn(engine, HISTORY)
        print(times, flush=True)
        rng = np.random.default_rng(7)
        params = SamplingParams(max_tokens=1, **GREEDY)
        history = rng.integers(1000, 120000, size=HISTORY - 64).tolist()
        turn = rng.integers(1000, 120000, size=128).tolist()
        engine.generate(input_ids=[history], params=SamplingParams(max_tokens=64, **GREEDY),
                        session_id="p")
        hit = kernels_of(lambda: engine.generate(input_ids=[turn], params=params,
                                                 session_id="p"))
        engine.end_session("p")
        fresh = kernels_of(lambda: engine.generate(input_ids=[turn], params=params))
    finally:
        engine.close()
    return times, hit, fresh


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    times, hit, fresh = profiled_turns()
    names = sorted(set(hit) | set(fresh),
                   key=lambda n: -(hit.get(n, {}).get("us", 0) - fresh.get(n, {}).get("us", 0)))
    zero = {"us": 0.0, "count": 0}
    total_hit = sum(k["us"] for k in hit.values())
    total_fresh = sum(k["us"] for k in fresh.values())
    lines = [f"{torch.cuda.get_device_name()}; `python benchmarks/gpu_turn_profile.py --out DIR`",
             f"turns (medians of 3, ms): on a resident {HISTORY}-token session "
             f"{times['hit_ttft_ms']:.2f}, fresh {times['fresh_ttft_ms']:.2f} "
             f"({times['hit_over_fresh']:.2f}x)",
             f"kernel time of one profiled turn (ms): on the session {total_hit / 1e3:.3f}, "
             f"fresh {total_fresh / 1e3:.3f}", "",
             f"{'kernel':70s} {'session us':>11s} {'n':>5s} {'fresh us':>10s} {'n':>5s} "
             f"{'more us':>9s}"]
    for n in names:
        a, b = hit.get(n, zero), fresh.get(n, zero)
        lines.append(f"{short(n):70s} {a['us']:11.1f} {a['count']:5d} {b['us']:10.1f} "
                     f"{b['count']:5d} {a['us'] - b['us']:9.1f}")
    text = "\n".join(lines)
    (args.out / "turn_profile.txt").write_text(text + "\n")
    (args.out / "turn_profile.json").write_text(json.dumps(
        {"device": torch.cuda.get_device_name(), "times": times,
         "session_kernels": hit, "fresh_kernels": fresh}, indent=2) + "\n")
    print(text)


if __name__ == "__main__":
    main()
