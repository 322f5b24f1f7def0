"""FP8 weights against bf16, in one run on one GPU: a Llama-3-8B-shaped model
with random bf16 weights (benchmarks/gpu_engine.py) and the same weights
converted to FP8 at load (`quantization="fp8"`, and "fp8-lm-head": the LM
head too).

Figures, per mode: batch-1 decode tok/s (128-token prompt, 256 generated)
and offline ShareGPT-like output tok/s (N requests submitted at once); and,
on the real SmolLM2-135M-Instruct, the FP8 logits' error against bf16 over
the fixed prompt set of tests/model/test_fp8.py (top-1 agreement, KL). A
profile of one eager 128-token prefill per mode shows where the time to
first token goes.

    python benchmarks/gpu_fp8.py --out DIR [--requests 1000]

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
                        ceilings, random_tensors, sharegpt_like, speeds, sync_time)

from turbomq.worker import SamplingParams  # noqa: E402
from turbomq.worker.model.catalog import FetchError  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402


def real_model_error() -> dict:
    sys.path.insert(0, str(HERE.parent / "tests" / "model"))
    from helpers import our_logits, smollm2_gguf
    from test_fp8 import TEXTS
    from turbomq.worker.engine.tokenizer import Tokenizer
    from turbomq.worker.model.weights import load_checkpoint

    path = smollm2_gguf()
    ck, tok = load_checkpoint(path), Tokenizer.from_dir(path)
    base = LlamaModel(ck.config, ck.tensors, "cuda", torch.bfloat16)
    fp8 = LlamaModel(ck.config, ck.tensors, "cuda", torch.bfloat16, quantization="fp8")
    agree = total = 0
    kls = []
    for text in TEXTS:
        ids = torch.tensor(tok.encode(text))
        a, b = our_logits(base, ids, [len(ids)]).float(), our_logits(fp8, ids, [len(ids)]).float()
        kls.append(torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1),
                                              log_target=True, reduction="batchmean").item())
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    return {"top1_agreement": agree / total, "positions": total, "kl_per_prompt": kls}


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


def main() -> None:
    args = ab_arguments(__doc__.split("\n\n")[0])
    cfg = LLAMA3_8B
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "requests": args.requests,
               "ceilings": ceilings(), "modes": {}}
    profiles = []
    for name, quant in (("bf16", None), ("fp8", "fp8"), ("fp8-lm-head", "fp8-lm-head")):
        tensors = random_tensors(cfg)  # the same weights each time (seeded)
        model = LlamaModel(cfg, tensors, "cuda", torch.bfloat16, quantization=quant)
        del tensors  # an FP8 model holds its own copies of what it quantized
        gc.collect()
        engine = ab_engine(model, args.max_batch_size, quantization=quant)
        r = speeds(engine, cfg, results["ceilings"], work if args.requests else [], name)
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
    b = results["modes"]["bf16"]
    lines = ["# FP8 weights against bf16", "",
             f"{results['device']}; Llama-3-8B shape, random weights, bf16 KV, greedy; one run: "
             "`python benchmarks/gpu_fp8.py --out DIR`."]
    for mode in ("fp8", "fp8-lm-head"):
        lines += ["", f"| figure | bf16 | {mode} | {mode} / bf16 | target |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        lines += ab_speed_rows(b, results["modes"][mode], args.requests, (">= 1.7", ">= 1.4"))
    e = results["real_model_error"]
    if "skipped" in e:
        lines += ["", f"SmolLM2-135M-Instruct error on the GPU: not measured ({e['skipped']})."]
    else:
        lines += ["", f"SmolLM2-135M-Instruct, FP8 against bf16 on the GPU over the fixed prompt "
                  f"set: top-1 agreement {e['top1_agreement']:.1%} of {e['positions']} positions, "
                  f"KL per prompt {', '.join(f'{k:.4f}' for k in e['kl_per_prompt'])}."]
    (args.out / "fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
