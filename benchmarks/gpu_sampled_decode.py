"""Decode with sampling (temperature 1.0, top-p 0.9: the API's defaults
and a common setting) against greedy, and the sampler's per-row copies as
they were (`torch.tensor(..., device="cuda")`, which synchronizes the stream
on every sampled step) against as they are (pinned memory, asynchronous),
on a Llama-3-8B-shaped model with random bf16 weights, one engine, all rows
from one run. Decode tok/s of `--batch` sequences at once (prompt 128, 256
new tokens each), CUDA graphs on.

    python benchmarks/gpu_sampled_decode.py --out DIR [--batch 1 64]

Writes sampled_decode.md and sampled_decode.json to --out."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from gpu_engine import LLAMA3_8B, ab_engine, publish, random_tensors, sync_time
from turbomq.worker import SamplingParams
from turbomq.worker.model import sampler
from turbomq.worker.model.llama import LlamaModel

NEW_TOKENS = 256
PARAMS = {"greedy": dict(temperature=0.0),
          "sampled": dict(temperature=1.0, top_p=0.9)}


def synchronizing_to_device(values, dtype, device):
    """The sampler's copies as they were: from pageable memory, which
    waits for everything queued on the stream."""
    return torch.tensor(values, dtype=dtype, device=device)


def decode(engine, batch: int, params: dict) -> float:
    """Output tok/s of `batch` sequences decoding together."""
    stamps = []
    for i in range(batch):
        engine.submit(input_ids=list(range(1000 + i, 1128 + i)),
                      params=SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, seed=i,
                                            **params),
                      callback=lambda e: stamps.append((time.perf_counter(), len(e.token_ids))))
    sync_time()
    while engine.has_work():
        engine.step()
    first = min(t for t, _ in stamps)  # the prefill's tokens are out: decode from here
    tokens = sum(n for t, n in stamps if t > first)
    return tokens / (max(t for t, _ in stamps) - first)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model = LlamaModel(LLAMA3_8B, random_tensors(LLAMA3_8B), "cuda", torch.bfloat16)
    engine = ab_engine(model, max(args.batch))
    fast = sampler.to_device
    rows = []
    try:
        for batch in args.batch:
            decode(engine, batch, PARAMS["sampled"])  # the batch's graphs captured
            for copies, to_device in (("synchronizing", synchronizing_to_device),
                                      ("asynchronous", fast)):
                sampler.to_device = to_device
                for mode, params in PARAMS.items():
                    rows.append({"batch": batch, "copies": copies, "mode": mode,
                                 "tok_per_s": decode(engine, batch, params)})
                    print(rows[-1], flush=True)
    finally:
        sampler.to_device = fast
        engine.close()
    results = {"device": torch.cuda.get_device_name(), "new_tokens": NEW_TOKENS, "rows": rows}
    lines = [f"# Sampled decode ({results['device']})", "",
             "`python benchmarks/gpu_sampled_decode.py --out DIR`: output tok/s while every "
             f"sequence decodes ({NEW_TOKENS} new tokens each, prompt 128), Llama-3-8B shape, "
             "random bf16 weights, CUDA graphs; sampled: temperature 1.0, top-p 0.9. The "
             "sampler's per-row copies synchronizing (as they were) or asynchronous (as they "
             "are). All rows from one run.", "",
             "| batch | copies | greedy | sampled | sampled / greedy |",
             "| ---: | --- | ---: | ---: | ---: |"]
    for batch in args.batch:
        for copies in ("synchronizing", "asynchronous"):
            got = {r["mode"]: r["tok_per_s"] for r in rows
                   if r["batch"] == batch and r["copies"] == copies}
            lines.append(f"| {batch} | {copies} | {got['greedy']:,.1f} | {got['sampled']:,.1f} | "
                         f"{got['sampled'] / got['greedy']:.3f} |")
    publish(args.out, "sampled_decode", lines, results)


if __name__ == "__main__":
    main()
