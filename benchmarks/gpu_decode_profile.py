"""Where a small-batch decode step's time goes, on a Llama-3-8B-shaped model
(random bf16 weights), one GPU:

1. projections: the native GEMV (ops.linear) against cuBLAS (F.linear) for
   every weight shape of the model, 1 and 4 rows, and the FP8 GEMV on the
   same weights converted to E4M3 (--quantization fp8's decode path; the LM
   head stays bf16), weights rotated through enough copies that they come
   from HBM, not L2; CUDA-graph replays;
2. decode attention at batch 1 over a 256-token context with partitions
   planned for the graph's 512-token bucket: split-K combine fused or in a
   second launch, and forced partition sizes;
3. the decode graph replay (GPU time of one step) at batch 1 and 4 with the
   default settings, with each decode optimization switched off in turn, and
   the kernels of one replay.

    python benchmarks/gpu_decode_profile.py [--out DIR] [--only linear]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from turbomq.worker.model.cuda_graphs import DecodeGraphs
from turbomq.worker.model.kv_cache import PagedKVCache
from turbomq.worker.model.ops import LayerKV
from turbomq.worker.model.llama import LlamaModel
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops.attention_batch import AttentionBatch
from turbomq.worker.model.ops.fp8 import quantize_weight

_spec = importlib.util.spec_from_file_location("gpu_engine", Path(__file__).with_name("gpu_engine.py"))
gpu_engine = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_engine)
CFG = gpu_engine.LLAMA3_8B


def graph_ms(fn, reps: int = 30) -> float:
    """Median GPU time of one replay of a graph that runs fn once."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return gpu_engine.median_ms(g.replay, reps)


def bench_linear() -> list[dict]:
    h, inter = CFG.hidden_size, CFG.intermediate_size
    shapes = {"qkv": (CFG.q_size + 2 * CFG.kv_size, h), "o": (h, CFG.q_size),
              "gate_up": (2 * inter, h), "down": (h, inter), "lm_head": (CFG.vocab_size, h)}
    rows = []
    for name, (n, k) in shapes.items():
        nbytes = 2 * n * k
        copies = max(1, math.ceil(200e6 / nbytes))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02 for _ in range(copies)]
        wq = [quantize_weight(w) for w in ws] if name != "lm_head" else []
        fp8_bytes = n * k + 4 * n
        for m in (1, 4):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            res = {}
            gemv = lambda a, b: cuda_ops.linear(a, b, native=True)  # noqa: E731
            for impl, fn in (("gemv", gemv), ("cublas", F.linear)):
                ms = graph_ms(lambda: [fn(x, w) for w in ws]) / copies
                res[impl] = ms * 1e3
            row = {"name": name, "n": n, "k": k, "m": m, "gemv_us": res["gemv"],
                   "cublas_us": res["cublas"], "gemv_GBps": nbytes / res["gemv"] / 1e3,
                   "cublas_GBps": nbytes / res["cublas"] / 1e3}
            line = (f"{name:8s} {n:6d}x{k:5d} m={m}: gemv {res['gemv']:7.1f} us "
                    f"({row['gemv_GBps']:5.0f} GB/s)  cublas {res['cublas']:7.1f} us "
                    f"({row['cublas_GBps']:5.0f} GB/s)")
            if wq:
                us = graph_ms(lambda: [cuda_ops.linear(x, w) for w in wq]) / copies * 1e3
                row["fp8_gemv_us"], row["fp8_gemv_GBps"] = us, fp8_bytes / us / 1e3
                line += f"  fp8 gemv {us:7.1f} us ({fp8_bytes / us / 1e3:5.0f} GB/s)"
            rows.append(row)
            print(line, flush=True)
        del ws, wq
    torch.cuda.empty_cache()
    return rows


def bench_attention() -> list[dict]:
    nkv, group, d, bs, ctx, pools = CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads, 128, 64, 256, 64
    nb = ctx // bs
    kvp = LayerKV(torch.randn(pools * nb, nkv, bs, d, device="cuda", dtype=torch.bfloat16),
                  torch.randn(pools * nb, nkv, bs, d, device="cuda", dtype=torch.bfloat16), None, None)
    width = 512 // bs
    batches = []
    for i in range(pools):
        table = np.full((1, width), -1, dtype=np.int64)
        table[0, :nb] = np.arange(i * nb, (i + 1) * nb)
        b = AttentionBatch.build([1], [ctx], table, bs, device="cuda")
        b.max_context_len = 512  # planned for the graph's context bucket
        b.context_lens_host = [512]
        batches.append(b)
    q = torch.randn(1, nkv * group, d, device="cuda", dtype=torch.bfloat16)
    rows = []
    for label, kw in (("planned, fused combine", {}),
                      ("planned, reduce kernel", {"fused_combine": False}),
                      ("P=64 fused", {"partition_size": 64}),
                      ("P=128 fused", {"partition_size": 128}),
                      ("P=256 fused", {"partition_size": 256}),
                      ("P=512 (one partition)", {"partition_size": 512})):
        us = graph_ms(lambda: [cuda_ops.paged_attention(q, kvp, b, d ** -0.5, **kw)
                               for b in batches]) / pools * 1e3
        rows.append({"case": label, "us": us})
        print(f"attention 1x{ctx} (bucket 512) {label:24s}: {us:6.2f} us", flush=True)
    return rows


CONFIGS = [
    ("default", {}),
    ("no programmatic launch", {"PDL": False}),
    ("attention not programmatic", {"ATTENTION_PDL": False}),
    ("norm, silu, add, rotary apart", {"FUSED_GEMV": False}),
    ("GEMV for every projection", {"GEMV_MAX_ROWS": 8, "GEMV_MAX_K": 1 << 30}),
    ("no GEMV (cuBLAS)", {"GEMV_MAX_ROWS": 0}),
    ("split-K reduce kernel", {"FUSED_SPLITK_COMBINE": False}),
    ("rotary, write_kv apart", {"FUSED_ROTARY_WRITE_KV": False}),
    ("none of them", {"GEMV_MAX_ROWS": 0, "FUSED_SPLITK_COMBINE": False, "FUSED_GEMV": False,
                      "FUSED_ROTARY_WRITE_KV": False, "PDL": False, "ATTENTION_PDL": False}),
]


def apply(cfg: dict, saved: dict) -> None:
    for k, v in saved.items():
        if k == "PDL":
            cuda_ops._k.set_programmatic_launch(cfg.get(k, v))
        elif k == "ATTENTION_PDL":
            cuda_ops._k.set_attention_programmatic(cfg.get(k, v))
            setattr(cuda_ops, k, cfg.get(k, v))
        else:
            setattr(cuda_ops, k, cfg.get(k, v))


def bench_decode(out: Path) -> list[dict]:
    model = LlamaModel(CFG, gpu_engine.random_tensors(CFG), "cuda", torch.bfloat16)
    bs, ctx = 64, 256
    kv = PagedKVCache(CFG.num_layers, 64, bs, CFG.num_kv_heads, CFG.head_dim, torch.bfloat16, "cuda")
    saved = {k: (cuda_ops._k.programmatic_launch() if k == "PDL" else getattr(cuda_ops, k))
             for _, cfg in CONFIGS for k in cfg}
    rows, logits = [], {}
    for batch in (1, 4):
        tables = np.arange(batch * 8, dtype=np.int32).reshape(batch, 8)
        ids = list(range(1000, 1000 + batch))
        for label, cfg in CONFIGS:
            apply(cfg, saved)
            graphs = DecodeGraphs(model, kv, 8, 4096, scratch_block=63)
            result = graphs.run(ids, [ctx] * batch, tables).float()
            logits[(batch, label)] = result
            graph = graphs._graphs[(batch, 512)][0]  # buckets 1, 2, 4, 8
            ms = gpu_engine.median_ms(graph.replay, reps=50)
            rows.append({"batch": batch, "config": label, "replay_ms": ms})
            print(f"decode graph batch {batch}, {label:24s}: {ms:6.3f} ms ({1e3 / ms:5.1f} steps/s)",
                  flush=True)
            if batch == 1 and label == "default":
                from torch.profiler import ProfilerActivity, profile
                with profile(activities=[ProfilerActivity.CUDA]) as prof:
                    graph.replay()
                    torch.cuda.synchronize()
                table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=16)
                (out / "decode_profile.txt").write_text(table + "\n")
                print(table)
            del graphs
        a, b = logits[(batch, CONFIGS[0][0])], logits[(batch, CONFIGS[-1][0])]
        print(f"batch {batch}: default vs none: max |dlogit| {(a - b).abs().max().item():.3g}, "
              f"argmax equal {bool((a.argmax(-1) == b.argmax(-1)).all())}", flush=True)
    apply({}, saved)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("build/gpu-results"))
    ap.add_argument("--only", choices=["linear"], help="just the projections")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name()}
    results["linear"] = bench_linear()
    if args.only == "linear":
        (args.out / "decode_profile_linear.json").write_text(json.dumps(results, indent=2) + "\n")
        return
    results["attention"] = bench_attention()
    results["decode"] = bench_decode(args.out)
    (args.out / "decode_profile.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\nsummary")
    for r in results["decode"]:
        print(f"  batch {r['batch']} {r['config']:24s} {r['replay_ms']:.3f} ms")


if __name__ == "__main__":
    main()
