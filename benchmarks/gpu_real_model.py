"""A real checkpoint on one GPU: SmolLM2-135M-Instruct (Q4_1 GGUF, the model
`make serve` serves), in one run:

- parity: max |logit diff| of the CUDA fp32 path against the CPU path and
  against transformers loading the same file; greedy tokens of CUDA fp32 and
  CPU on three chat prompts;
- the answers on the native kernels at the default GPU dtype (fp16) and in
  bf16, beside the CPU's;
- speed at the default dtype: load time, time to first token of a chat question, decode
  tokens/s at batch 1 and at batch 32.

    python benchmarks/gpu_real_model.py --out DIR

Writes real_model.md and real_model.json into DIR (copy them to docs/benchmarks/)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from helpers import our_logits, smollm2_gguf  # noqa: E402

from turbomq.worker import Engine, EngineConfig, SamplingParams  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402
from turbomq.worker.model.weights import load_checkpoint  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Name three primary colours.",
             "Write a haiku about the sea."]
GREEDY = dict(temperature=0.0)


def chat(q: str) -> list[dict]:
    return [{"role": "user", "content": q}]


def answers(path: str, **engine) -> tuple[list[str], list[list[int]]]:
    with Engine(EngineConfig(model=path, max_batch_size=4, **engine)) as e:
        out = e.generate(messages=[chat(q) for q in QUESTIONS],
                         params=SamplingParams(max_tokens=64, **GREEDY))
    return [r.text for r in out], [r.token_ids for r in out]


def parity(path: str) -> dict:
    from transformers import AutoModelForCausalLM

    ckpt = load_checkpoint(path)
    with Engine(EngineConfig(model=path, max_batch_size=1, num_kv_blocks=8)) as e:
        ids = torch.tensor(e.tokenizer.encode(e.chat_template.render(chat(QUESTIONS[0]))))
    cpu = our_logits(LlamaModel(ckpt.config, ckpt.tensors), ids, [len(ids)])
    gpu = our_logits(LlamaModel(ckpt.config, ckpt.tensors, device="cuda"), ids.cuda(),
                     [len(ids)]).cpu()
    folder, name = os.path.split(path)
    hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).cuda()
    with torch.no_grad():
        ref = hf(ids[None].cuda()).logits[0].float().cpu()
    return {"prompt_tokens": len(ids),
            "max_abs_logit_diff_gpu_vs_cpu": (gpu - cpu).abs().max().item(),
            "max_abs_logit_diff_gpu_vs_transformers": (gpu - ref).abs().max().item()}


def speed(path: str) -> dict:
    t0 = time.perf_counter()
    engine = Engine(EngineConfig(model=path, device="cuda", max_batch_size=32))
    load_s = time.perf_counter() - t0
    with engine:
        question = chat(QUESTIONS[0])
        engine.generate(messages=[question], params=SamplingParams(max_tokens=4, **GREEDY))  # warm
        first = {}

        def on_event(event) -> None:
            if event.token_ids and "t" not in first:
                first["t"] = time.perf_counter()
            if event.finished:
                first["done"] = True

        ttfts = []
        for _ in range(10):
            first.clear()
            t0 = time.perf_counter()
            engine.submit(messages=question, params=SamplingParams(max_tokens=1, **GREEDY),
                          callback=on_event)
            while "done" not in first:
                engine.step()
            ttfts.append((first["t"] - t0) * 1e3)
        rates = {}
        for batch in (1, 32):
            params = SamplingParams(max_tokens=256, temperature=0, ignore_eos=True)
            prompts = [[1, 504, 3575 + i] for i in range(batch)]
            engine.generate(input_ids=prompts, params=SamplingParams(max_tokens=8, **GREEDY))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = engine.generate(input_ids=prompts, params=params)
            torch.cuda.synchronize()
            rates[batch] = sum(len(r.token_ids) for r in out) / (time.perf_counter() - t0)
    ttfts.sort()
    return {"load_s": load_s, "ttft_ms_median": ttfts[len(ttfts) // 2],
            "decode_tokens_per_s_batch1": rates[1], "decode_tokens_per_s_batch32": rates[32]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="build/gpu-results")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = smollm2_gguf()
    result = {"model": Path(path).name, "gpu": torch.cuda.get_device_name(),
              "parity": parity(path)}
    cpu_text, cpu_ids = answers(path)
    gpu32_text, gpu32_ids = answers(path, device="cuda")
    fp16_text, _ = answers(path, device="cuda")
    bf16_text, _ = answers(path, device="cuda", dtype="bf16")
    result["greedy_tokens_gpu_fp32_equal_cpu"] = gpu32_ids == cpu_ids
    result["answers"] = [{"question": q, "cpu_fp32": c, "cuda_fp16": h, "cuda_bf16": b}
                         for q, c, h, b in zip(QUESTIONS, cpu_text, fp16_text, bf16_text)]
    result["speed_fp16"] = speed(path)
    (out / "real_model.json").write_text(json.dumps(result, indent=2) + "\n")
    p, s = result["parity"], result["speed_fp16"]
    lines = [
        f"# A real checkpoint on the GPU: {result['model']}",
        "",
        f"{result['gpu']}; `python benchmarks/gpu_real_model.py --out DIR` "
        "(or `BENCH=real_model bash benchmarks/run_gpu.sh`).",
        "",
        "## Parity (fp32)",
        "",
        "| check | value |",
        "| --- | --- |",
        f"| max abs logit diff, CUDA vs CPU path ({p['prompt_tokens']} prompt tokens) "
        f"| {p['max_abs_logit_diff_gpu_vs_cpu']:.2e} |",
        f"| max abs logit diff, CUDA vs transformers (`gguf_file=`) "
        f"| {p['max_abs_logit_diff_gpu_vs_transformers']:.2e} |",
        f"| greedy tokens CUDA fp32 == CPU, 3 chat prompts x 64 tokens "
        f"| {result['greedy_tokens_gpu_fp32_equal_cpu']} |",
        "",
        "## Answers (greedy)",
        "",
        "| question | CPU fp32 | CUDA fp16 (default; native kernels) | CUDA bf16 |",
        "| --- | --- | --- | --- |",
        *[f"| {a['question']} | {a['cpu_fp32']!r} | {a['cuda_fp16']!r} | {a['cuda_bf16']!r} |"
          .replace("\n", " ") for a in result["answers"]],
        "",
        "## Speed (fp16, CUDA graphs)",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| engine load (GGUF read, dequantize, to GPU) | {s['load_s']:.1f} s |",
        f"| time to first token, chat question (median of 10) | {s['ttft_ms_median']:.1f} ms |",
        f"| decode, batch 1 | {s['decode_tokens_per_s_batch1']:.0f} tokens/s |",
        f"| decode, batch 32 | {s['decode_tokens_per_s_batch32']:.0f} tokens/s |",
    ]
    (out / "real_model.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
