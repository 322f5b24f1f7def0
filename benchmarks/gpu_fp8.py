"""FP8 weights against bf16, in one run on one GPU: a Llama-3-8B-shaped model
with random bf16 weights (benchmarks/gpu_engine.py) and the same weights
converted to FP8 at load (`quantization="fp8"`, and "fp8-lm-head": the LM
head too), each with the bf16 KV cache; and both bf16 and fp8-lm-head again
with the 8-bit KV cache (`kv_dtype="int8"`), FP8 serving with every large
read in 8 bits.

Figures, per mode: batch-1 decode tok/s (128-token prompt, 256 generated)
and offline ShareGPT-like output tok/s (N requests submitted at once); and,
on the real SmolLM2-135M-Instruct, the FP8 logits' error against bf16 over
the fixed prompt set of tests/model/test_fp8.py (top-1 agreement, KL). A
profile of one eager 128-token prefill per mode shows where the time to
first token goes.

    python benchmarks/gpu_fp8.py --out DIR [--requests 1000] [--modes NAME ...] [--spans]
        [--mixed-graph-tokens N]

Writes fp8.md, fp8.json and fp8_prefill_profile.txt into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
from gpu_engine import (GREEDY, LLAMA3_8B, ab_arguments, ab_engine, ab_speed_rows,  # noqa: E402
                        ceilings, random_tensors, sharegpt_like, span_rows, speeds, sync_time)

from turbomq.worker import SamplingParams  # noqa: E402
from turbomq.worker.model.catalog import FetchError  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402


# name -> (quantization, kv_dtype); "bf16" is every other mode's baseline.
MODES = {"bf16": (None, "auto"), "fp8": ("fp8", "auto"), "fp8-lm-head": ("fp8-lm-head", "auto"),
         "bf16, int8 KV": (None, "int8"), "fp8-lm-head, int8 KV": ("fp8-lm-head", "int8")}


def logits_error(base, other, tok, texts, kv_dtype=None) -> dict:
    """`other`'s logits against `base`'s (bf16 KV) over `texts`: top-1
    agreement of every position, and the KL divergence per prompt."""
    from helpers import our_logits

    agree = total = 0
    kls = []
    for text in texts:
        ids = torch.tensor(tok.encode(text))
        a = our_logits(base, ids, [len(ids)]).float()
        b = our_logits(other, ids, [len(ids)], kv_dtype=kv_dtype).float()
        kls.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1),
                                              log_target=True, reduction="batchmean").item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    return {"top1_agreement": agree / total, "positions": total, "kl_per_prompt": kls}


def real_model_error() -> dict:
    sys.path.insert(0, str(HERE.parent / "tests" / "model"))
    from helpers import smollm2_gguf
    from test_fp8 import TEXTS
    from turbomq.worker.engine.tokenizer import Tokenizer
    from turbomq.worker.model.weights import load_checkpoint

    path = smollm2_gguf()
    ck, tok = load_checkpoint(path), Tokenizer.from_dir(path)
    base = LlamaModel(ck.config, ck.tensors, "cuda", torch.bfloat16)
    fp8 = LlamaModel(ck.config, ck.tensors, "cuda", torch.bfloat16, quantization="fp8")
    r = logits_error(base, fp8, tok, TEXTS)
    r["with_int8_kv"] = logits_error(base, fp8, tok, TEXTS, kv_dtype=torch.int8)
    return r


def prefill_profile(engine, label: str) -> str:
    """The top kernels (CUDA time) and the wall time of one eager 128-token
    prefill: where a mode's time to first token goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    params = SamplingParams(max_tokens=1, **GREEDY)
    prompt = list(range(2000, 2128))
    engine.generate(input_ids=[prompt], params=params)  # warm
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = sync_time()
        engine.generate(input_ids=[prompt], params=params)
        wall = (sync_time() - t0) * 1e3
    return (f"{label}: one 128-token prefill, {wall:.1f} ms wall (profiled)\n"
            + prof.key_averages().table(sort_by="cuda_time_total", row_limit=14))


def error_line(label: str, e: dict) -> str:
    return (f"{label}: top-1 agreement {e['top1_agreement']:.1%} of {e['positions']} positions, "
            f"KL per prompt {', '.join(f'{k:.4f}' for k in e['kl_per_prompt'])}.")


def main() -> None:
    def more(ap):
        ap.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                        help="the modes to run (bf16 always runs first)")
        ap.add_argument("--spans", action="store_true",
                        help="time each offline step's GPU span and the host's launch (StepSpans)")
        ap.add_argument("--mixed-graph-tokens", type=int, default=0,
                        help="EngineConfig.mixed_graph_tokens of every mode's engine")

    args = ab_arguments(__doc__.split("\n\n")[0], more)
    cfg = LLAMA3_8B
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "requests": args.requests,
               "mixed_graph_tokens": args.mixed_graph_tokens, "ceilings": ceilings(), "modes": {}}
    profiles = []
    names = ["bf16"] + [m for m in args.modes if m != "bf16"]
    for name in names:
        quant, kv_dtype = MODES[name]
        tensors = random_tensors(cfg)  # the same weights each time (seeded)
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, quantization=quant)
        del tensors  # an FP8 model holds its own copies of what it quantized
        gc.collect()
        engine = ab_engine(model, args.max_batch_size, quantization=quant, kv_dtype=kv_dtype,
                           mixed_graph_tokens=args.mixed_graph_tokens)
        r = speeds(engine, cfg, results["ceilings"], work if args.requests else [], name,
                   args.spans)
        results["modes"][name] = r
        profiles.append(prefill_profile(engine, name))
        engine.close()
        del engine, model
        gc.collect()
        torch.cuda.empty_cache()
    try:
        results["real_model_error"] = real_model_error()
    except FetchError as e:  # an offline GPU machine without .models/
        results["real_model_error"] = {"skipped": str(e)[:200]}
    print("real model", results["real_model_error"], flush=True)
    (args.out / "fp8.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "fp8_prefill_profile.txt").write_text("\n\n".join(profiles) + "\n")
    print("\n\n".join(profiles))
    modes = results["modes"]
    lines = ["# FP8 weights against bf16", "",
             f"{results['device']}; Llama-3-8B shape, random weights, greedy; one run: "
             f"`python benchmarks/gpu_fp8.py --out DIR --requests {args.requests}"
             + (f" --mixed-graph-tokens {args.mixed_graph_tokens}" if args.mixed_graph_tokens
                else "") + "`. "
             "Each mode against bf16 with the bf16 KV cache; the FP8 mode with the 8-bit KV "
             "cache also against bf16 with it."]
    pairs = [("bf16", m) for m in names[1:]]
    if "bf16, int8 KV" in modes and "fp8-lm-head, int8 KV" in modes:
        pairs.append(("bf16, int8 KV", "fp8-lm-head, int8 KV"))
    for base, mode in pairs:
        targets = (">= 1.7", ">= 1.4") if base == "bf16" and mode.startswith("fp8") else ()
        lines += ["", f"| figure | {base} | {mode} | {mode} / {base} |"
                  + (" target |" if targets else ""),
                  "| --- | ---: | ---: | ---: |" + (" ---: |" if targets else "")]
        lines += ab_speed_rows(modes[base], modes[mode], args.requests, targets)
    spans = [(m, r["offline"]["step_spans"]) for m, r in modes.items()
             if "step_spans" in r.get("offline", {})]
    if spans:
        lines += [""] + span_rows(spans)
    e = results["real_model_error"]
    if "skipped" in e:
        lines += ["", f"SmolLM2-135M-Instruct error on the GPU: not measured ({e['skipped']})."]
    else:
        lines += ["", error_line("SmolLM2-135M-Instruct, FP8 against bf16 on the GPU over the "
                                 "fixed prompt set", e),
                  "", error_line("The same, FP8 with the 8-bit KV cache against bf16 with the "
                                 "bf16 KV cache", e["with_int8_kv"])]
    (args.out / "fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
