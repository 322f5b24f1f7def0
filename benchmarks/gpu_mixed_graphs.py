"""Mixed-step graphs against eager mixed steps, offline, in one run: a
Llama-3-8B-shaped model with random weights serves ShareGPT-like requests
(benchmarks/gpu_engine.py) with `mixed_graph_tokens` 0 (steps with prefill
launched op by op) and 2048 (the default: their pieces replayed between the
layers' attention launches), per mode (bf16, and FP8 with the 8-bit KV cache
by default), each step's GPU span and host launch time recorded.

    python benchmarks/gpu_mixed_graphs.py --out DIR [--requests 1000] [--modes ...]

Writes mixed_graphs.md and mixed_graphs.json into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

import gc
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import (LLAMA3_8B, ab_arguments, ab_engine, random_tensors,  # noqa: E402
                        run_offline, sharegpt_like, span_rows)
from gpu_fp8 import MODES  # noqa: E402

from turbomq.worker.model.llama import LlamaModel  # noqa: E402

SETTINGS = (("eager", 0), ("mixed graphs", 2048))


def main() -> None:
    def more(ap):
        ap.add_argument("--modes", nargs="+", choices=list(MODES),
                        default=["bf16", "fp8-lm-head, int8 KV"])

    args = ab_arguments(__doc__.split("\n\n")[0], more)
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "requests": args.requests, "runs": {}}
    for mode in args.modes:
        quant, kv_dtype = MODES[mode]
        tensors = random_tensors(LLAMA3_8B)
        model = LlamaModel(LLAMA3_8B, tensors, "cuda", torch.bfloat16, quantization=quant)
        del tensors
        gc.collect()
        for setting, tokens in SETTINGS:
            t0 = time.perf_counter()
            engine = ab_engine(model, args.max_batch_size, quantization=quant, kv_dtype=kv_dtype,
                               mixed_graph_tokens=tokens)
            start = time.perf_counter() - t0
            mixed = engine.runner.mixed_graphs
            pieces = mixed.captured if mixed is not None else 0
            del mixed  # holds captured pools: let them go with the engine
            r = run_offline(engine, work, spans=True)
            r.update(start_s=start, mixed_graphs=pieces)
            results["runs"][f"{mode}, {setting}"] = r
            print(mode, setting, {k: v for k, v in r.items() if k != "step_spans"}, flush=True)
            engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()
    (args.out / "mixed_graphs.json").write_text(json.dumps(results, indent=2) + "\n")
    runs = results["runs"]
    rows = [f"# Mixed-step graphs ({results['device']}, Llama-3-8B shape, random weights)", "",
            f"`python benchmarks/gpu_mixed_graphs.py --out DIR --requests {args.requests} "
            f"--modes {' '.join(repr(m) for m in args.modes)}`; one run. Offline output tok/s "
            "with steps that prefill launched op by op (eager) and replayed as pieces between "
            "attention launches (mixed graphs); engine start (load to ready, graph captures "
            "included).", "",
            "| mode | eager tok/s | mixed graphs tok/s | mixed / eager | start s, eager / mixed "
            "| pieces captured |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for mode in args.modes:
        a, b = runs[f"{mode}, eager"], runs[f"{mode}, mixed graphs"]
        rows.append(f"| {mode} | {a['output_tok_per_s']:,.0f} | {b['output_tok_per_s']:,.0f} | "
                    f"{b['output_tok_per_s'] / a['output_tok_per_s']:.3f} | "
                    f"{a['start_s']:.1f} / {b['start_s']:.1f} | {b['mixed_graphs']} |")
    rows += [""] + span_rows([(name, r["step_spans"]) for name, r in runs.items()])
    (args.out / "mixed_graphs.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
