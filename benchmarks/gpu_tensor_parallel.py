"""Tensor parallelism over two GPUs against one, on a Llama-3-8B-shaped model
with random bf16 weights (written once as a converted checkpoint: every rank
loads its slice from it).

Engines one after the other, in one run, all with CUDA graphs: one GPU (at
--max-batch-size, and 2, 4, 8 and 16 times that); two GPUs with every
all-reduce through NCCL; two GPUs with the small all-reduces through peer
memory, without and with (the default) its low-latency kernel for
decode's, and again with 2, 4, 8 and 16 times the batch (the pool holds
twice the tokens). --only picks the engines of a run. Each: decode at
batch 1 (prompt 128, 256 new tokens), an offline batch of ShareGPT-like
requests (up to --step-tokens a step, 2048), and its KV pool size. --spans
times each offline step on rank 0's stream, by kind of step; --profile adds
torch.profiler tables of each engine's prefill and batch-1 decode on rank 0.

    BENCH=tensor_parallel bash benchmarks/run_gpu.sh   (on a machine with 2 GPUs)

Writes tensor_parallel.md and tensor_parallel.json to --out.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch

from gpu_engine import (GREEDY, LLAMA3_8B, random_tensors, run_offline, sharegpt_like, span_rows,
                        sync_time)
from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.engine import runner
from turbomq.worker.model import parallel
from turbomq.worker.model.weights import Checkpoint, save_converted

# (name, engine config, mode: the all-reduce "nccl", "peer", "peer-no-ll" or
# "peer-8m", or "peer-gather": greedy steps gathering the logits as sampled
# ones do; batch multiple of --max-batch-size)
CASES = [("1 GPU", dict(tensor_parallel=1), "peer", 1),
         ("1 GPU, 2x batch", dict(tensor_parallel=1), "peer", 2),
         ("1 GPU, 4x batch", dict(tensor_parallel=1), "peer", 4),
         ("1 GPU, 8x batch", dict(tensor_parallel=1), "peer", 8),
         ("1 GPU, 16x batch", dict(tensor_parallel=1), "peer", 16),
         ("2 GPUs, NCCL all-reduce", dict(tensor_parallel=2), "nccl", 1),
         ("2 GPUs, peer all-reduce, no LL", dict(tensor_parallel=2), "peer-no-ll", 1),
         ("2 GPUs, peer all-reduce", dict(tensor_parallel=2), "peer", 1),
         ("2 GPUs, peer all-reduce, 2x batch", dict(tensor_parallel=2), "peer", 2),
         ("2 GPUs, peer all-reduce, 4x batch", dict(tensor_parallel=2), "peer", 4),
         ("2 GPUs, peer all-reduce, 8x batch", dict(tensor_parallel=2), "peer", 8),
         ("2 GPUs, peer all-reduce to 8 MiB, 8x batch", dict(tensor_parallel=2), "peer-8m", 8),
         ("2 GPUs, peer all-reduce, 8x batch, logits gathered", dict(tensor_parallel=2),
          "peer-gather", 8),
         ("2 GPUs, peer all-reduce, 16x batch", dict(tensor_parallel=2), "peer", 16)]
# Tokens a step (max_num_batched_tokens). 2048 rather than 8192: one GPU's offline
# figure is the same at both, two GPUs' 4-8% higher on one machine
# (docs/benchmarks/tensor_parallel.md, "The step's token budget").
STEP_TOKENS = 2048


def all_reduce_mode(mode: str, peer_bytes: Optional[int] = None) -> None:
    """Small all-reduces through NCCL or peer memory ("peer-no-ll": without
    the low-latency kernel; the peer kernel takes messages up to `peer_bytes`,
    default the engine's, or 8 MiB for "peer-8m"), here (rank 0) and in the
    rank processes started next (they read the environment); with
    "peer-gather", greedy steps gather the logits instead of reducing the
    ranks' argmax."""
    value = (0 if mode == "nccl" else
             peer_bytes if peer_bytes is not None else
             8 << 20 if mode == "peer-8m" else parallel.PEER_ALL_REDUCE_BYTES_DEFAULT)
    os.environ["TURBOMQ_PEER_ALL_REDUCE_BYTES"] = str(value)
    parallel.PEER_ALL_REDUCE_BYTES = value
    ll = str(0 if mode == "peer-no-ll" else parallel.PEER_ALL_REDUCE_LL_BYTES_DEFAULT)
    os.environ["TURBOMQ_PEER_ALL_REDUCE_LL_BYTES"] = ll
    parallel.PEER_ALL_REDUCE_LL_BYTES = int(ll)
    runner.GREEDY_ARGMAX = mode != "peer-gather"  # rank 0 decides it for every rank


def ttft_ms(engine: Engine, repeats: int = 11) -> dict:
    """Time to the first token of a lone 128-token prompt: the median and the
    fastest of `repeats` (host-bound and noisy at this size)."""
    times = []
    for i in range(repeats):
        t0 = sync_time()
        engine.generate(input_ids=[list(range(2000 + i, 2128 + i))],
                        params=SamplingParams(max_tokens=1, **GREEDY))
        times.append((time.perf_counter() - t0) * 1e3)
    times.sort()
    return {"ttft_ms": times[repeats // 2], "ttft_min_ms": times[0]}


def decode_batch1(engine: Engine, new_tokens: int = 256) -> dict:
    stamps = []
    engine.submit(input_ids=list(range(1000, 1128)),
                  params=SamplingParams(max_tokens=new_tokens, **GREEDY),
                  callback=lambda e: stamps.append(time.perf_counter()))
    sync_time()
    while engine.has_work():
        engine.step()
    return {**ttft_ms(engine), "decode_tok_per_s": (len(stamps) - 1) / (stamps[-1] - stamps[0])}


def profile_decode(engine: Engine, dest: Path, new_tokens: int = 64) -> None:
    """Rank 0's host and GPU time by op over a lone 128-token prefill (the
    time to first token) and over a batch-1 decode (the graph's kernels, the
    broadcasts, the waits for tokens), to `dest`."""
    from torch.profiler import ProfilerActivity, profile

    sections = []
    for label, tokens in (("time to first token: a 128-token prompt, 1 new token", 1),
                          (f"batch-1 decode: a 128-token prompt, {new_tokens} new tokens", new_tokens)):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = sync_time()
            engine.generate(input_ids=[list(range(3000 + tokens, 3128 + tokens))],
                            params=SamplingParams(max_tokens=tokens, **GREEDY))
            wall = (sync_time() - t0) * 1e3
        sections.append(f"{label}, rank 0, {wall:.1f} ms wall (profiled)\n\n"
                        + prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=25)
                        + "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    dest.write_text("\n\n".join(sections) + "\n")


def make_engine(path: str, case: dict, max_batch_size: int,
                step_tokens: int = STEP_TOKENS, graphs_at_start: bool = True) -> Engine:
    """The engine every case runs, warmed up (the graphs the runs use captured)."""
    engine = Engine(EngineConfig(model=path, device="cuda", dtype="bf16",
                                 max_batch_size=max_batch_size, block_size=64,
                                 kv_cache_fraction=0.85, max_num_batched_tokens=step_tokens,
                                 max_model_len=16384, cuda_graphs=True,
                                 graphs_at_start=graphs_at_start, **case))
    for copies in (4, 1):
        engine.generate(input_ids=[list(range(1000, 1128))] * copies,
                        params=SamplingParams(max_tokens=8, **GREEDY))
    return engine


def write_checkpoint(path: str) -> None:
    tensors = {k: v.cpu() for k, v in random_tensors(LLAMA3_8B).items()}
    torch.cuda.empty_cache()
    save_converted(Checkpoint(LLAMA3_8B, tensors), path)


def measure(path: str, case: dict, work: list, max_batch_size: int,
            profile_to: Optional[Path] = None, step_tokens: int = STEP_TOKENS,
            spans: bool = False, graphs_at_start: bool = True) -> dict:
    t0 = time.perf_counter()
    engine = make_engine(path, case, max_batch_size, step_tokens, graphs_at_start)
    try:
        load_s = time.perf_counter() - t0  # with the warm-up
        out = {"load_s": load_s, "kv_tokens_capacity": engine.max_tokens_in_pool}
        out.update(decode_batch1(engine))
        if profile_to is not None:
            profile_decode(engine, profile_to)
        if work:
            out.update(run_offline(engine, work, spans))
        return out
    finally:
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()


def write_report(out: Path, r: dict) -> None:
    rows = ["# Tensor parallelism (Llama-3-8B shapes, random bf16 weights)", "",
            f"{r['device']} x {r['gpus']}; `benchmarks/gpu_tensor_parallel.py` "
            f"(`BENCH=tensor_parallel bash benchmarks/run_gpu.sh`). Decode: batch 1, prompt 128, "
            f"256 new tokens. Offline: {r['requests']} ShareGPT-like requests (ignore EOS), "
            f"up to the batch column at once, up to {r['step_tokens']} tokens a step. "
            f"CUDA graphs throughout"
            + (f", mixed-step graphs up to {r['mixed_graph_tokens']} tokens"
               if r.get("mixed_graph_tokens") else "") + ". All rows from one run.",
            "",
            "| engine | decode tok/s (batch 1) | vs 1 GPU | TTFT ms, median / min | offline output tok/s "
            "| vs 1 GPU | host waiting | batch | KV pool tokens | load s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    base = next(iter(r["cases"].values()))
    for name, c in r["cases"].items():
        rows.append(f"| {name} | {c['decode_tok_per_s']:.1f} | "
                    f"{c['decode_tok_per_s'] / base['decode_tok_per_s']:.2f}x | "
                    f"{c['ttft_ms']:.1f} / {c.get('ttft_min_ms', 0):.1f} | "
                    f"{c.get('output_tok_per_s', 0):,.0f} | "
                    f"{c.get('output_tok_per_s', 0) / base.get('output_tok_per_s', 1):.2f}x | "
                    f"{c.get('host_waiting', 0):.0%} | {c['max_batch_size']} | "
                    f"{c['kv_tokens_capacity']:,} | {c['load_s']:.0f} |")
    rows += ["", "Two GPUs hold the weights once between them, so each has about half "
             "the weight memory free for KV (the pool column counts tokens; every rank "
             "holds its own KV heads of each). TTFT: the median and the fastest "
             "of eleven lone 128-token prompts. Host waiting: the share of the offline run "
             "rank 0's step thread spent blocked on the device for tokens (near 0%: the "
             "host sets the pace). docs/engine.md, Tensor parallel."]
    spans = [(name, c["step_spans"]) for name, c in r["cases"].items() if "step_spans" in c]
    if spans:
        rows += [""] + span_rows(spans)
        rows += ["", "Decode graphs captured during the offline run (a bucket's graph on its "
                 "first step, inside that step's launch), and the host's time in them: " + "; ".join(
                     f"{name}: {r['cases'][name].get('graphs_captured', 0)}, "
                     f"{r['cases'][name].get('graph_capture_s', 0):.2f} s" for name, _ in spans)
                 + "."]
    (out / "tensor_parallel.md").write_text("\n".join(rows) + "\n")
    (out / "tensor_parallel.json").write_text(json.dumps(r, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--max-batch-size", type=int, default=64)
    ap.add_argument("--without-nccl", action="store_true",
                    help="leave out the two-GPU row with every all-reduce through NCCL")
    ap.add_argument("--only", action="append",
                    help="run only the engine of this name (repeat for several)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile each engine's prefill and batch-1 decode (tp_profile_*.txt)")
    ap.add_argument("--checkpoint", type=Path,
                    help="keep the converted checkpoint here (reused where it exists)")
    ap.add_argument("--peer-all-reduce-bytes", type=int,
                    help="the largest message the peer all-reduce takes (default: the engine's)")
    ap.add_argument("--step-tokens", type=int, default=STEP_TOKENS,
                    help="the engines' token budget of a step (max_num_batched_tokens)")
    ap.add_argument("--spans", action="store_true",
                    help="time each offline step's span on rank 0's stream, by kind of step")
    ap.add_argument("--lazy-graphs", action="store_true",
                    help="capture each graph on its first use, not when the engine starts")
    ap.add_argument("--mixed-graph-tokens", type=int, default=0,
                    help="EngineConfig.mixed_graph_tokens of every engine (0: eager steps with prefill)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if torch.cuda.device_count() < 2:
        raise SystemExit("tensor parallel benchmark: needs 2 CUDA devices")
    work = sharegpt_like(args.requests)
    results = {"device": torch.cuda.get_device_name(), "gpus": 2, "requests": args.requests,
               "step_tokens": args.step_tokens, "graphs_at_start": not args.lazy_graphs,
               "mixed_graph_tokens": args.mixed_graph_tokens, "cases": {}}
    with tempfile.TemporaryDirectory(prefix="turbomq-tp-") as tmp:
        path = str(args.checkpoint or tmp)
        if not (args.checkpoint and args.checkpoint.exists()):
            write_checkpoint(path)
        for name, case, mode, batch in CASES:
            if (args.without_nccl and mode == "nccl") or (args.only and name not in args.only):
                continue
            all_reduce_mode(mode, args.peer_all_reduce_bytes)
            batch *= args.max_batch_size
            slug = "".join(c if c.isalnum() else "_" for c in name.lower())
            profile_to = args.out / f"tp_profile_{slug}.txt" if args.profile else None
            case = {**case, "mixed_graph_tokens": args.mixed_graph_tokens}
            results["cases"][name] = {"max_batch_size": batch,
                                      **measure(path, case, work, batch, profile_to,
                                                args.step_tokens, args.spans,
                                                not args.lazy_graphs)}
            print(name, json.dumps(results["cases"][name]), flush=True)
            write_report(args.out, results)  # what is done so far, should a later case fail
    print((args.out / "tensor_parallel.md").read_text())


if __name__ == "__main__":
    main()
