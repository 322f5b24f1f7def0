"""Kernel benchmark on one CUDA GPU.

Decode attention alone (llama-3-8B shapes: 32 query heads, 8 KV heads,
head_dim 128, block 64), bf16 and INT8 KV, batch x context from 1x1k to
256x8k: achieved GB/s (KV bytes read, plus INT8 scales, q, out and block
tables) against the device-to-device copy bandwidth measured in the same run
(bytes read + written). Plus causal prefill (with history, 8k, 16k: both kernels) and the
element-wise kernels against the PyTorch reference.

Timing: CUDA graphs of many calls (launch gaps out of the numbers), CUDA
events, warm-up, median of many replays. Small cases rotate among several KV
pools so the data is not served from L2.

    python benchmarks/gpu_kernels.py --out docs/benchmarks
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

import torch

from turbomq.worker.model.ops import LayerKV
from turbomq.worker.model.ops import cuda as cuda_ops
from turbomq.worker.model.ops import reference as ref
from turbomq.worker.model.ops.attention_batch import AttentionBatch

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 64
CASES = [(1, 1024), (8, 2048), (32, 4096), (64, 4096), (128, 8192), (256, 8192)]
ROTATE_BYTES = 512 << 20  # rotate pools until one graph touches this much
DEV = torch.device("cuda")


def time_graph(fn, calls: int, reps: int = 30) -> float:
    """Median seconds per call of fn(i), i = 0..calls-1, replayed as a graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(calls, 3)):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / calls)
    del graph
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Bytes read + written per second by a 2 GiB device-to-device copy (bf16
    elements, as benchmarks/gpu_engine.py measures it: byte-wise copies run slower)."""
    src = torch.randn((1 << 30,), dtype=torch.bfloat16, device=DEV)
    dst = torch.empty_like(src)
    t = time_graph(lambda i: dst.copy_(src), calls=10, reps=20)
    nbytes = src.numel() * 2
    del src, dst
    return 2 * nbytes / t


def read_bandwidth() -> float:
    """Bytes read per second by a plain reduction: the ceiling of a read-only kernel."""
    x = torch.randn((1 << 31,), dtype=torch.bfloat16, device=DEV)
    t = time_graph(lambda i: x.sum(dtype=torch.float32), calls=10, reps=20)
    nbytes = x.numel() * 2
    del x
    return nbytes / t


def make_pools(batch: int, ctx: int, kv_dtype: torch.dtype, copies: int):
    """`copies` disjoint sets of random (non-contiguous) blocks in one pool."""
    per_seq = math.ceil(ctx / BLOCK)
    num_blocks = copies * batch * per_seq
    shape = (num_blocks, NUM_KV_HEADS, BLOCK, HEAD_DIM)
    if kv_dtype == torch.int8:
        k = torch.randint(-127, 128, shape, dtype=torch.int8, device=DEV)
        v = torch.randint(-127, 128, shape, dtype=torch.int8, device=DEV)
        ks = torch.rand(shape[:-1], device=DEV) * 0.02 + 0.001
        vs = torch.rand(shape[:-1], device=DEV) * 0.02 + 0.001
        kv = LayerKV(k, v, ks, vs)
    else:
        kv = LayerKV(torch.randn(shape, dtype=kv_dtype, device=DEV),
                     torch.randn(shape, dtype=kv_dtype, device=DEV), None, None)
    order = torch.randperm(num_blocks).numpy().reshape(copies, batch, per_seq)
    batches = [AttentionBatch.build([1] * batch, [ctx] * batch, order[c], BLOCK, device=DEV)
               for c in range(copies)]
    return kv, batches


# New tokens over a history (a 128-token turn on 4k, 8k and 16k sessions,
# 129 rows with the reply's last token; a 1024-token chunk over 7k): the
# shapes of gpu_attention_yardstick.py and gpu_prefill_partitions.py.
HISTORY_CASES = [("turn on 4k", 129, 4096), ("turn on 8k", 129, 8192),
                 ("turn on 16k", 129, 16384), ("1024 over 7k", 1024, 8192)]


def history_case(n: int, ctx: int):
    """(q, kv, batch): n new bf16 query rows over ctx keys of one sequence,
    its K/V in random non-contiguous blocks."""
    kv, batches = make_pools(1, ctx, torch.bfloat16, 1)
    tables = batches[0].block_tables.cpu().numpy()
    batch = AttentionBatch.build([n], [ctx], tables, BLOCK, device=DEV)
    q = torch.randn((n, NUM_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
    return q, kv, batch


def attention_bytes(batch: int, ctx: int, kv_dtype: torch.dtype) -> int:
    elem = 1 if kv_dtype == torch.int8 else 2
    per_token = NUM_KV_HEADS * (HEAD_DIM * elem + (4 if kv_dtype == torch.int8 else 0)) * 2
    qo = 2 * batch * NUM_HEADS * HEAD_DIM * 2
    tables = batch * math.ceil(ctx / BLOCK) * 4
    return batch * ctx * per_token + qo + tables


SWEEP_SIZES = [64, 128, 256, 512, 1024, 2048, 4096]


def bench_decode(copy_bw: float, sweep: list[dict]) -> list[dict]:
    """Planner's partitioning for every case; for batch <= 64 also every forced
    partition size (into `sweep`)."""
    rows = []
    scale = HEAD_DIM ** -0.5
    for batch, ctx in CASES:
        times = {}
        for name, kv_dtype in (("bf16", torch.bfloat16), ("int8", torch.int8)):
            nbytes = attention_bytes(batch, ctx, kv_dtype)
            copies = max(1, min(64, math.ceil(ROTATE_BYTES / nbytes)))
            kv, batches = make_pools(batch, ctx, kv_dtype, copies)
            q = torch.randn((batch, NUM_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
            calls = max(copies, 10)
            t = time_graph(lambda i: cuda_ops.paged_attention(q, kv, batches[i % copies], scale),
                           calls)
            if batch <= 64:
                for size in SWEEP_SIZES:
                    if size > ctx:
                        continue
                    ts = time_graph(lambda i: cuda_ops.paged_attention(
                        q, kv, batches[i % copies], scale, partition_size=size), calls, reps=15)
                    sweep.append({"kv": name, "batch": batch, "context": ctx,
                                  "partition_size": size, "partitions": math.ceil(ctx / size),
                                  "us": ts * 1e6, "GBps": nbytes / ts / 1e9})
            tiles = batch
            part, parts = cuda_ops.plan_partitions(tiles * NUM_KV_HEADS, ctx,
                                                   cuda_ops._sm_count(DEV), int8=name == "int8")
            times[name] = t
            rows.append({
                "kernel": "decode_attention", "kv": name, "batch": batch, "context": ctx,
                "us": t * 1e6, "bytes": nbytes, "GBps": nbytes / t / 1e9,
                "frac_of_copy": nbytes / t / copy_bw, "partitions": parts,
                "partition_size": part, "pool_copies": copies})
            del kv, batches, q
            torch.cuda.empty_cache()
        rows[-1]["int8_speedup"] = times["bf16"] / times["int8"]
        rows[-2]["int8_speedup"] = None
    return rows


PREFILL_CASES = [("4 x 512 after 2048", 512, 2048, 4), ("8k causal", 8192, 0, 1),
                 ("16k causal", 16384, 0, 1)]


def bench_prefill() -> list[dict]:
    """Causal prefill attention: 4 sequences x 512 new tokens after 2048 of
    history, and fresh 8k and 16k prompts; attention.cu (bf16 and INT8 KV)
    against prefill_attention.cu (mma.sync and wgmma; wgmma with INT8 KV too,
    and with its tiles loaded by TMA), side by side."""
    rows = []
    scale = HEAD_DIM ** -0.5
    for case, n, hist, seqs in PREFILL_CASES:
        for kernel, name, kv_dtype in (("attention.cu", "bf16", torch.bfloat16),
                                       ("attention.cu", "int8", torch.int8),
                                       ("prefill_attention.cu", "bf16", torch.bfloat16),
                                       ("prefill_attention.cu wgmma", "bf16", torch.bfloat16),
                                       ("prefill_attention.cu wgmma", "int8", torch.int8),
                                       ("prefill_attention.cu wgmma+tma", "bf16",
                                        torch.bfloat16)):
            ctx = n + hist
            kv, batches = make_pools(seqs, ctx, kv_dtype, 1)
            tables = batches[0].block_tables.cpu().numpy()
            batch = AttentionBatch.build([n] * seqs, [ctx] * seqs, tables, BLOCK, device=DEV)
            q = torch.randn((n * seqs, NUM_HEADS, HEAD_DIM), dtype=torch.bfloat16, device=DEV)
            cuda_ops.PREFILL_ATTENTION = kernel.startswith("prefill_attention.cu")
            cuda_ops._k.set_prefill_attention_wgmma("wgmma" in kernel)
            cuda_ops._k.set_prefill_attention_tma(kernel.endswith("tma"))
            try:
                t = time_graph(lambda i: cuda_ops.paged_attention(q, kv, batch, scale), calls=5,
                               reps=10)
            finally:
                cuda_ops.PREFILL_ATTENTION = False
                cuda_ops._k.set_prefill_attention_wgmma(cuda_ops.PREFILL_WGMMA)
                cuda_ops._k.set_prefill_attention_tma(cuda_ops.PREFILL_TMA)
            keys = sum(hist + i + 1 for i in range(n)) * seqs
            flops = 4 * keys * NUM_HEADS * HEAD_DIM
            rows.append({"kernel": kernel, "case": case, "kv": name, "seqs": seqs, "new": n,
                         "history": hist, "us": t * 1e6, "TFLOPs": flops / t / 1e12})
            print(f"prefill {case:20s} {kernel:22s} {name}: {t * 1e6:9.0f} us "
                  f"{rows[-1]['TFLOPs']:6.1f} TFLOP/s", flush=True)
            del kv, batches, q
            torch.cuda.empty_cache()
    return rows


def bench_elementwise() -> list[dict]:
    rows = []
    dt = torch.bfloat16
    hidden, inter = 4096, 14336
    for tokens in (256, 4096):
        x = torch.randn((tokens, hidden), dtype=dt, device=DEV)
        w = torch.randn((hidden,), dtype=dt, device=DEV)
        gu = torch.randn((tokens, 2 * inter), dtype=dt, device=DEV)
        qkv = torch.randn((tokens, (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM), dtype=dt, device=DEV)
        q, k, v = qkv.split([NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM,
                             NUM_KV_HEADS * HEAD_DIM], dim=-1)
        q = q.reshape(tokens, NUM_HEADS, HEAD_DIM)
        k = k.reshape(tokens, NUM_KV_HEADS, HEAD_DIM)
        v = v.reshape(tokens, NUM_KV_HEADS, HEAD_DIM)
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, dtype=torch.float32) / HEAD_DIM))
        fr = torch.outer(torch.arange(8192, dtype=torch.float32), inv)
        table = torch.cat([fr.cos(), fr.sin()], -1).to(DEV)
        pos = torch.randint(0, 8192, (tokens,), device=DEV)
        nblocks = math.ceil(tokens / BLOCK) * 4
        kv16 = LayerKV(torch.zeros((nblocks, NUM_KV_HEADS, BLOCK, HEAD_DIM), dtype=dt, device=DEV),
                       torch.zeros((nblocks, NUM_KV_HEADS, BLOCK, HEAD_DIM), dtype=dt, device=DEV),
                       None, None)
        kv8 = LayerKV(torch.zeros((nblocks, NUM_KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.int8, device=DEV),
                      torch.zeros((nblocks, NUM_KV_HEADS, BLOCK, HEAD_DIM), dtype=torch.int8, device=DEV),
                      torch.zeros((nblocks, NUM_KV_HEADS, BLOCK), device=DEV),
                      torch.zeros((nblocks, NUM_KV_HEADS, BLOCK), device=DEV))
        slots = torch.randperm(nblocks * BLOCK, device=DEV)[:tokens]
        ops = {
            "rms_norm": lambda m: m.rms_norm(x, w, 1e-5),
            "rotary": lambda m: m.rotary(q, k, pos, table),
            "silu_mul": lambda m: m.silu_mul(gu),
            "write_kv_bf16": lambda m: m.write_kv(kv16, k, v, slots),
            "write_kv_int8": lambda m: m.write_kv(kv8, k, v, slots),
        }
        for name, op in ops.items():
            t_native = time_graph(lambda i: op(cuda_ops), calls=20, reps=20)
            t_ref = time_graph(lambda i: op(ref), calls=20, reps=20)
            rows.append({"kernel": name, "tokens": tokens, "us": t_native * 1e6,
                         "reference_us": t_ref * 1e6, "speedup": t_ref / t_native})
    return rows


def markdown(info: dict, decode: list[dict], prefill: list[dict], elem: list[dict],
             sweep: list[dict]) -> str:
    lines = [
        "# Kernel benchmark", "",
        f"Device: {info['device']} ({info['sms']} SMs), torch {info['torch']}. "
        f"Measured in the same run: device-to-device copy **{info['copy_GBps']:.0f} GB/s** "
        f"(bytes read + written), read-only reduction **{info['read_GBps']:.0f} GB/s**. "
        "Produced by `benchmarks/gpu_kernels.py`.", "",
        "## Decode attention (llama-3-8B: 32 q heads, 8 KV heads, head_dim 128, block 64)", "",
        "Bytes = KV read (+ INT8 scales) + q + out + block tables; % = achieved / measured "
        "copy and read bandwidth.", "",
        "| batch x context | KV | partitions | time (us) | GB/s | % of copy | % of read | INT8 speedup |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in decode:
        sp = "" if r.get("int8_speedup") is None else f"{r['int8_speedup']:.2f}x"
        lines.append(f"| {r['batch']} x {r['context']} | {r['kv']} | {r['partitions']} | "
                     f"{r['us']:.1f} | {r['GBps']:.0f} | {100 * r['frac_of_copy']:.0f}% | "
                     f"{100 * r['frac_of_read']:.0f}% | {sp} |")
    if sweep:
        lines += ["", "Forced partition sizes (time in us; the planner's choice is in the table above):",
                  "", "| batch x context | KV | " + " | ".join(str(s) for s in SWEEP_SIZES) + " |",
                  "| --- | --- |" + " --- |" * len(SWEEP_SIZES)]
        keys = sorted({(r["batch"], r["context"], r["kv"]) for r in sweep})
        for b, c, kv in keys:
            cells = {r["partition_size"]: r["us"] for r in sweep
                     if (r["batch"], r["context"], r["kv"]) == (b, c, kv)}
            lines.append(f"| {b} x {c} | {kv} | " + " | ".join(
                f"{cells[s]:.1f}" if s in cells else "" for s in SWEEP_SIZES) + " |")
    lines += ["", "## Prefill attention (causal; one layer, all heads)", "",
              "| case | kernel | KV | time (us) | TFLOP/s |", "| --- | --- | --- | --- | --- |"]
    for r in prefill:
        lines.append(f"| {r['case']} | {r['kernel']} | {r['kv']} | {r['us']:.0f} | "
                     f"{r['TFLOPs']:.1f} |")
    lines += ["", "## Element-wise kernels vs the PyTorch reference (bf16, hidden 4096)", "",
              "| kernel | tokens | native (us) | reference (us) | speedup |",
              "| --- | --- | --- | --- | --- |"]
    for r in elem:
        lines.append(f"| {r['kernel']} | {r['tokens']} | {r['us']:.1f} | "
                     f"{r['reference_us']:.1f} | {r['speedup']:.1f}x |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="docs/benchmarks", help="folder for kernels.md / kernels.json")
    ap.add_argument("--skip-elementwise", action="store_true")
    ap.add_argument("--only", choices=["prefill"],
                    help="just the prefill attention rows (written to kernels_prefill.md/json)")
    args = ap.parse_args()
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(DEV)
    copy_bw = copy_bandwidth()
    read_bw = read_bandwidth()
    info = {"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
            "copy_GBps": copy_bw / 1e9, "read_GBps": read_bw / 1e9}
    print(f"{props.name}: copy {copy_bw / 1e9:.0f} GB/s, read {read_bw / 1e9:.0f} GB/s", flush=True)
    sweep: list[dict] = []
    decode = [] if args.only else bench_decode(copy_bw, sweep)
    for r in decode:
        r["frac_of_read"] = r["GBps"] * 1e9 / read_bw
    prefill = bench_prefill()
    elem = [] if args.skip_elementwise or args.only else bench_elementwise()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = "kernels_prefill" if args.only else "kernels"
    (out / f"{name}.json").write_text(json.dumps(
        {"info": info, "decode_attention": decode, "prefill_attention": prefill,
         "elementwise": elem, "partition_sweep": sweep}, indent=2) + "\n")
    text = markdown(info, decode, prefill, elem, sweep)
    (out / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
