"""Engine benchmarks on one GPU, on a Llama-3-8B-shaped model with random
bf16 weights (values do not change speed), in one run:

- ceilings: device-to-device copy bandwidth and bf16 GEMM rate;
- decode at batch 1 (prompt 128, 256 new tokens): tokens/s and MBU;
- offline throughput on a seeded ShareGPT-like workload (ignore EOS), beside
  HF transformers' continuous batching on the same workload;
- multi-turn: TTFT of a turn on a resident 8k session, after its eviction,
  and of a fresh prompt of the turn's length.

    python benchmarks/gpu_engine.py --out DIR [--requests 1000] [--hf-requests 1000]

Writes engine.md, engine.json and engine.png into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

from typing import Optional

import argparse
import gc
import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from turbomq.worker import Engine, EngineConfig, SamplingParams
from turbomq.worker.model.config import ModelConfig, RopeScaling
from turbomq.worker.model.cuda_graphs import DecodeGraphs
from turbomq.worker.model.kv_cache import PagedKVCache
from turbomq.worker.model.llama import LlamaModel

LLAMA3_8B = ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                        num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                        rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
                        max_position_embeddings=16384, bos_token_id=128000,
                        eos_token_ids=(128001,), torch_dtype="bfloat16")
GREEDY = dict(temperature=0.0, ignore_eos=True)


def sync_time() -> float:
    torch.cuda.synchronize()
    return time.perf_counter()


def publish(out: Path, stem: str, lines: list[str], results) -> None:
    """A benchmark's report: `lines` to OUT/STEM.md and printed, `results`
    to OUT/STEM.json."""
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    (out / f"{stem}.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


def median_ms(fn, reps: int = 20) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return float(np.median(times))


def batch1_decode_graph(model: LlamaModel, context: int = 256):
    """`model`'s batch-1 decode graph at `context` tokens on a fresh pool:
    (graphs, graph, kv); keep all three alive while the graph replays."""
    cfg = model.config
    kv = PagedKVCache(cfg.num_layers, 64, 64, cfg.num_kv_heads, cfg.head_dim, torch.bfloat16,
                      "cuda")
    graphs = DecodeGraphs(model, kv, 8, 4096, scratch_block=63)
    graphs.run([1000], [context], np.arange(8, dtype=np.int32).reshape(1, 8))
    return graphs, next(iter(graphs._graphs.values()))[0], kv


def mean_replay_ms(graph: torch.cuda.CUDAGraph, replays: int, warmup: int = 20) -> float:
    """Mean time of `replays` replays of `graph` after `warmup` (CUDA events)."""
    for _ in range(warmup):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays


def ceilings() -> dict:
    n = 1 << 30  # 2 GiB of bf16 per buffer
    src = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    dst = torch.empty_like(src)
    copy_ms = median_ms(lambda: dst.copy_(src))
    read_ms = median_ms(lambda: src.view(torch.int64).sum())
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    gemm_ms = median_ms(lambda: a @ b)
    del a, b
    nbytes = 2 * n
    return {"copy_GBps": 2 * nbytes / copy_ms / 1e6, "read_GBps": nbytes / read_ms / 1e6,
            "gemm_TFLOPs": 2 * 8192 ** 3 / gemm_ms / 1e9}


def random_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    g = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int, std: float = 0.02) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16) * std)

    h, qkv = cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size
    t = {"embed.weight": w(cfg.vocab_size, h), "norm.weight": torch.ones(h, dtype=torch.bfloat16, device="cuda"),
         "lm_head.weight": w(cfg.vocab_size, h)}
    for i in range(cfg.num_layers):
        t[f"layers.{i}.attn_norm.weight"] = torch.ones(h, dtype=torch.bfloat16, device="cuda")
        t[f"layers.{i}.mlp_norm.weight"] = torch.ones(h, dtype=torch.bfloat16, device="cuda")
        t[f"layers.{i}.qkv.weight"] = w(qkv, h)
        t[f"layers.{i}.o.weight"] = w(h, cfg.q_size)
        t[f"layers.{i}.gate_up.weight"] = w(2 * cfg.intermediate_size, h)
        t[f"layers.{i}.down.weight"] = w(h, cfg.intermediate_size)
    return t


def weight_bytes_per_token(cfg: ModelConfig, quantization: Optional[str] = None) -> int:
    """Bytes a decode step must read per token at batch 1: every weight but the
    embedding table (one row of it), plus that row. FP8: the projections (and,
    with fp8-lm-head, the LM head) at one byte a weight plus a float scale per
    output row."""
    h, inter = cfg.hidden_size, cfg.intermediate_size
    rows = (cfg.q_size + 2 * cfg.kv_size) + h + 2 * inter + h  # qkv, o, gate_up, down
    projections = (cfg.q_size + 2 * cfg.kv_size) * h + h * cfg.q_size + 3 * inter * h
    per_weight, per_row = (1, 4) if quantization else (2, 0)
    per_layer = projections * per_weight + rows * per_row + 2 * h * 2
    lm_head = (cfg.vocab_size * (h + 4) if quantization == "fp8-lm-head"
               else 2 * cfg.vocab_size * h)
    return cfg.num_layers * per_layer + lm_head + 2 * (2 * h)


def sharegpt_like(n: int, seed: int = 0) -> list[tuple[list[int], int]]:
    """Lognormal lengths with means ~250 in / ~250 out, clipped to [4, 1024]."""
    rng = np.random.default_rng(seed)
    sigma = 0.9
    mu = math.log(275) - sigma ** 2 / 2  # clipping pulls the means to ~250
    ins = np.clip(rng.lognormal(mu, sigma, n), 4, 1024).astype(int)
    outs = np.clip(rng.lognormal(mu, sigma, n), 4, 1024).astype(int)
    return [(rng.integers(1000, 120000, size=i).tolist(), int(o)) for i, o in zip(ins, outs)]


# kernel name fragments -> the group a kernel's CUDA time is summed into (first match)
KERNEL_GROUPS = (("attention", ("attention",)),
                 ("GEMM", ("nvjet", "gemm", "gemv", "cutlass", "sm90_xmma")),
                 ("quantize", ("quantize",)), ("all-reduce, peer", ("all_reduce",)),
                 ("NCCL", ("nccl",)))


def kernel_groups(events) -> str:
    """A torch.profiler key_averages() summed by kind of kernel (ms), the
    rest as "other"."""
    sums: dict[str, float] = {}
    for e in events:
        us = e.self_device_time_total
        if us <= 0:
            continue
        name = e.key.lower()
        group = next((g for g, keys in KERNEL_GROUPS if any(k in name for k in keys)), "other")
        sums[group] = sums.get(group, 0.0) + us / 1e3
    return "kernel time by group (ms): " + ", ".join(f"{g} {ms:.0f}" for g, ms in sums.items())


def profile_steps(engine: Engine, steps: int, rows: int = 25) -> tuple[float, str]:
    """Run `steps` engine steps under torch.profiler (CUDA kernels): the
    wall seconds, and the kernel time by kind (kernel_groups) above the
    top `rows` kernels."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    events = prof.key_averages()
    table = events.table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70)
    return wall, f"{kernel_groups(events)}\n{table}"


def span_rows(spans: list[tuple[str, dict]]) -> list[str]:
    """Markdown rows of StepSpans results, (engine name, kinds) each."""
    rows = ["Where each offline run's time goes, by kind of step, on rank 0's compute "
            "stream: span, from the event before a step's launch to the one after it (its "
            "GPU time, or the host's launch time where the host queues kernels slower than "
            "they run); idle, the GPU's wait for the host before the step; launch, the host's "
            "time in the launch call (its work, and any wait in it for the device).", "",
            "| engine | steps | tokens / step | span s | span ms / step | idle s | launch s |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for name, kinds in spans:
        for kind, k in kinds.items():
            rows.append(f"| {name}, {kind} | {k['steps']:,} | {k['tokens'] / k['steps']:,.0f} | "
                        f"{k['span_s']:.2f} | {1e3 * k['span_s'] / k['steps']:.2f} | "
                        f"{k['gap_s']:.2f} | {k['host_s']:.2f} |")
    return rows


def submit_all(engine: Engine, work: list[tuple[list[int], int]], callback=lambda e: None) -> None:
    """Submit every (prompt, output length) of `work` at once, greedy."""
    for prompt, out_len in work:
        engine.submit(input_ids=prompt, params=SamplingParams(max_tokens=out_len, **GREEDY),
                      callback=callback)


class StepSpans:
    """Each step's span on the compute stream of rank 0: events recorded
    before and after `runner.launch` queues it. A step's span is its GPU
    time, or the host's launch time where the host queues its kernels slower
    than they run (an eager step); the gap before it, the time the GPU sat
    idle waiting for the host to queue it; host, the host's time in the
    launch call (its work, and any wait in it for the device). `close()`:
    per kind of step (decode graph; with prefill, in mixed-step graphs or
    eager), the steps, tokens and seconds."""

    def __init__(self, engine: Engine):
        self.runner, self.launch = engine.runner, engine.runner.launch
        self.steps = []  # (kind, tokens, host seconds, start event, end event)
        engine.runner.launch = self._launch

    def _launch(self, step, *args, **kwargs):
        mixed = self.runner.mixed_graphs
        replays = mixed.replays if mixed is not None else 0
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        t0 = time.perf_counter()
        out = self.launch(step, *args, **kwargs)
        host = time.perf_counter() - t0
        end.record()
        if step.graphed:
            kind = "decode graph"
        elif mixed is not None and mixed.replays > replays:
            kind = "with prefill, mixed graphs"
        else:
            kind = "with prefill, eager"
        self.steps.append((kind, len(step.ids), host, start, end))
        return out

    def close(self) -> dict:
        self.runner.launch = self.launch
        torch.cuda.synchronize()
        kinds: dict = {}
        prev_end = None
        for kind, tokens, host, start, end in self.steps:
            k = kinds.setdefault(kind, {"steps": 0, "tokens": 0, "host_s": 0.0, "span_s": 0.0,
                                        "gap_s": 0.0})
            k["steps"] += 1
            k["tokens"] += tokens
            k["host_s"] += host
            k["span_s"] += start.elapsed_time(end) / 1e3
            if prev_end is not None:
                k["gap_s"] += max(0.0, prev_end.elapsed_time(start) / 1e3)
            prev_end = end
        return kinds


def run_offline(engine: Engine, work: list[tuple[list[int], int]], spans: bool = False) -> dict:
    """Every request of `work` at once, stepped to the end: output tok/s,
    the share of the run the host waited for tokens, the decode graphs it
    captured, and with `spans` each kind of step's GPU spans (StepSpans)."""
    done = {"n": 0, "tokens": 0}

    def on_event(event) -> None:
        done["tokens"] += len(event.token_ids)
        if event.finished:
            done["n"] += 1

    waited = engine.counters["token_wait_seconds"]
    graphs = engine.runner.graphs

    def captured() -> tuple[int, float]:  # decode graphs held so far, the host's time capturing
        return (graphs.captured, graphs.capture_seconds) if graphs is not None else (0, 0.0)

    captured_before = captured()
    recorder = StepSpans(engine) if spans else None
    t0 = sync_time()
    submit_all(engine, work, on_event)
    while engine.has_work():
        engine.step()
    elapsed = sync_time() - t0
    assert done["n"] == len(work)
    # the share of the run the host spent waiting for the device (near 0: host-bound)
    waited = engine.counters["token_wait_seconds"] - waited
    count, seconds = captured()
    out = {"seconds": elapsed, "output_tokens": done["tokens"],
           "output_tok_per_s": done["tokens"] / elapsed, "req_per_s": len(work) / elapsed,
           "host_waiting": waited / elapsed,
           # decode graphs captured during the run (each on its bucket's first step)
           "graphs_captured": count - captured_before[0],
           "graph_capture_s": seconds - captured_before[1]}
    if recorder is not None:
        out["step_spans"] = recorder.close()
    return out


def decode_batch1(engine: Engine, cfg: ModelConfig, bandwidth: dict) -> dict:
    prompt = list(range(1000, 1128))
    stamps = []
    engine.submit(input_ids=prompt, params=SamplingParams(max_tokens=256, **GREEDY),
                  callback=lambda e: stamps.append((time.perf_counter(), len(e.token_ids))))
    t0 = sync_time()
    while engine.has_work():
        engine.step()
    ttft = stamps[0][0] - t0
    decode_s = stamps[-1][0] - stamps[0][0]
    tok_s = (256 - 1) / decode_s
    nbytes = weight_bytes_per_token(cfg, engine.config.quantization)
    return {"ttft_ms": ttft * 1e3, "decode_tok_per_s": tok_s, "bytes_per_token": nbytes,
            "mbu_copy": tok_s * nbytes / (bandwidth["copy_GBps"] * 1e9),
            "mbu_read": tok_s * nbytes / (bandwidth["read_GBps"] * 1e9),
            "roofline_tok_per_s_copy": bandwidth["copy_GBps"] * 1e9 / nbytes}


def ab_arguments(description: str, more=None) -> argparse.Namespace:
    """--out (created), --requests and --max-batch-size of an A/B run, and
    what `more(parser)` adds."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=1000, help="offline requests; 0: none")
    ap.add_argument("--max-batch-size", type=int, default=256)
    if more is not None:
        more(ap)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    return args


def ab_engine(model: LlamaModel, max_batch_size: int, **config) -> Engine:
    """An engine for A/B runs on an injected Llama-3-8B-shaped model, its
    batch-4 and batch-1 decode graphs captured (none falls in a timed run)."""
    engine = Engine(EngineConfig(model="(random weights)", device="cuda",
                                 max_batch_size=max_batch_size, block_size=64,
                                 kv_cache_fraction=0.8, max_num_batched_tokens=8192,
                                 max_model_len=16384, **config), model=model)
    for copies in (4, 1):
        engine.generate(input_ids=[list(range(1000, 1128))] * copies,
                        params=SamplingParams(max_tokens=8, **GREEDY))
    return engine


def speeds(engine: Engine, cfg: ModelConfig, bandwidth: dict, work: list, label: str,
           spans: bool = False) -> dict:
    """Batch-1 decode and, given `work`, offline throughput (with `spans`,
    its StepSpans too); printed as measured."""
    r = {"decode_batch1": decode_batch1(engine, cfg, bandwidth)}
    print(label, "decode", r["decode_batch1"], flush=True)
    if work:
        r["offline"] = run_offline(engine, work, spans)
        print(label, "offline", r["offline"], flush=True)
    return r


def ab_speed_rows(base: dict, other: dict, requests: int, targets: tuple[str, str] = ()) -> list[str]:
    """Markdown rows of two `speeds` results side by side: batch-1 decode,
    and offline when measured; base | other | other / base [| target]."""
    def row(name: str, x: float, y: float, fmt: str, i: int) -> str:
        target = f" {targets[i]} |" if targets else ""
        return f"| {name} | {x:{fmt}} | {y:{fmt}} | {y / x:.3f} |{target}"

    rows = [row("batch-1 decode (tok/s)", base["decode_batch1"]["decode_tok_per_s"],
                other["decode_batch1"]["decode_tok_per_s"], ",.1f", 0)]
    if "offline" in base:
        rows.append(row(f"offline ShareGPT-like, {requests} requests (output tok/s)",
                        base["offline"]["output_tok_per_s"], other["offline"]["output_tok_per_s"],
                        ",.0f", 1))
    return rows


def multi_turn(engine: Engine, history_len: int, repeats: int = 3) -> dict:
    """TTFT of a 128-token turn on a session of `history_len` tokens: resident
    (hit), after eviction (miss: re-prefill), and a fresh 128-token prompt.
    Medians over `repeats` sessions (the first also warms up the shapes)."""
    rng = np.random.default_rng(1)
    params = SamplingParams(max_tokens=1, **GREEDY)

    def ttft(**kw) -> float:
        t0 = sync_time()
        engine.generate(params=params, **kw)
        return (sync_time() - t0) * 1e3

    hits, misses, fresh = [], [], []
    for r in range(repeats + 1):
        history = rng.integers(1000, 120000, size=history_len - 64).tolist()
        turn = rng.integers(1000, 120000, size=128).tolist()
        sid = f"s{history_len}-{r}"
        engine.generate(input_ids=[history], params=SamplingParams(max_tokens=64, **GREEDY), session_id=sid)
        hit = ttft(input_ids=[turn], session_id=sid)
        engine.evict_session(sid)
        miss = ttft(input_ids=[turn], session_id=sid)
        new = ttft(input_ids=[turn])
        engine.end_session(sid)
        if r:  # the first round warms up
            hits.append(hit), misses.append(miss), fresh.append(new)
    hit, miss, new = (float(np.median(x)) for x in (hits, misses, fresh))
    return {"history_tokens": history_len, "turn_tokens": 128, "hit_ttft_ms": hit,
            "evicted_ttft_ms": miss, "fresh_ttft_ms": new, "hit_over_fresh": hit / new}


def profile(engine: Engine, out: Path) -> dict:
    """Where the time goes: GPU time of one batch-1 decode graph replay, and
    the top kernels of an eager decode step and of a 128-token turn over 8k
    tokens of history."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    graphs = engine.runner.graphs
    replay_ms = None
    if graphs is not None and (1, 512) in graphs._graphs:
        graph = graphs._graphs[(1, 512)][0]
        replay_ms = median_ms(graph.replay, reps=50)
    rng = np.random.default_rng(2)
    history = rng.integers(1000, 120000, size=8000).tolist()
    engine.generate(input_ids=[history], params=SamplingParams(max_tokens=2, **GREEDY), session_id="p")
    tables = []
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(input_ids=[rng.integers(1000, 120000, size=128).tolist()],
                        params=SamplingParams(max_tokens=1, **GREEDY), session_id="p")
        torch.cuda.synchronize()
    tables.append("128-token turn over 8k history:\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=12))
    engine.end_session("p")
    saved, engine.runner.graphs = engine.runner.graphs, None
    engine.generate(input_ids=[list(range(1000, 1128))], params=SamplingParams(max_tokens=4, **GREEDY))
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        engine.generate(input_ids=[list(range(1000, 1128))], params=SamplingParams(max_tokens=9, **GREEDY))
        torch.cuda.synchronize()
    engine.runner.graphs = saved
    tables.append("eager batch-1 steps (1 prefill + 8 decode):\n" + prof.key_averages().table(
        sort_by="cuda_time_total", row_limit=15))
    text = "\n\n".join(tables)
    (out / "engine_profile.txt").write_text(text + "\n")
    print(text)
    return {"decode_graph_replay_ms": replay_ms}


def hf_offline(cfg: ModelConfig, work: list) -> dict:
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    hf_cfg = LlamaConfig(**{k: v for k, v in cfg.to_hf().items()
                            if k not in ("architectures", "model_type", "torch_dtype", "eos_token_id")})
    hf_cfg.eos_token_id = None
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        hf = LlamaForCausalLM(hf_cfg).eval()
    torch.set_default_dtype(torch.float32)
    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(o for _, o in work),
                               eos_token_id=None, pad_token_id=0)
    mode = "per-request max_new_tokens (ContinuousBatchingManager)"
    t0 = sync_time()
    try:
        out_tokens = 0
        with hf.continuous_batching_context_manager(generation_config=gen_cfg, block=True,
                                                    timeout=5) as manager:
            for i, (prompt, n) in enumerate(work):
                manager.add_request(prompt, request_id=f"r{i}", max_new_tokens=n)
            finished = 0
            while finished < len(work):
                result = manager.get_result(timeout=1)
                if result is not None and result.is_finished():
                    finished += 1
                    out_tokens += len(result.generated_tokens)
                elif result is None and not manager.is_running():
                    raise RuntimeError("HF continuous batching stopped")
    except Exception as exc:  # API differences between transformers releases
        print(f"HF manager path failed ({exc!r}); falling back to generate_batch with max_new_tokens")
        mode = "generate_batch, one max_new_tokens per output-length group"
        out_tokens = 0
        t0 = sync_time()
        groups: dict[int, list] = {}
        for prompt, n in work:
            groups.setdefault(n, []).append(prompt)
        for n, prompts in groups.items():
            res = hf.generate_batch(inputs=prompts, generation_config=gen_cfg, max_new_tokens=n)
            out_tokens += sum(len(r.generated_tokens) for r in res.values())
    elapsed = sync_time() - t0
    del hf
    gc.collect()
    torch.cuda.empty_cache()
    return {"seconds": elapsed, "output_tokens": out_tokens, "output_tok_per_s": out_tokens / elapsed,
            "req_per_s": len(work) / elapsed, "mode": mode}


def write_report(out: Path, results: dict) -> None:
    c, d, o, m = results["ceilings"], results["decode_batch1"], results["offline"], results["multi_turn"]
    hf = results.get("hf_offline")
    lines = [
        "# Engine benchmarks (Llama-3-8B shapes, random bf16 weights)", "",
        f"Device: {results['device']}. Command: `python benchmarks/gpu_engine.py --out DIR` "
        "(via `benchmarks/run_gpu.sh`).", "",
        "## Ceilings (same run)", "",
        "| copy GB/s (read+write) | read-only GB/s | bf16 GEMM TFLOP/s |", "|---:|---:|---:|",
        f"| {c['copy_GBps']:.0f} | {c['read_GBps']:.0f} | {c['gemm_TFLOPs']:.0f} |", "",
        "## Decode, batch 1 (prompt 128, 256 new tokens)", "",
        "| tokens/s | MBU vs copy | MBU vs read | roofline tok/s (copy) | TTFT ms |",
        "|---:|---:|---:|---:|---:|",
        f"| {d['decode_tok_per_s']:.1f} | {d['mbu_copy']:.2f} | {d['mbu_read']:.2f} | "
        f"{d['roofline_tok_per_s_copy']:.0f} | {d['ttft_ms']:.1f} |", "",
        f"## Offline throughput ({results['requests']} requests, ShareGPT-like, ignore EOS)", "",
        "| engine | output tok/s | req/s | seconds |", "|---|---:|---:|---:|",
        f"| turbomq | {o['output_tok_per_s']:.0f} | {o['req_per_s']:.2f} | {o['seconds']:.1f} |",
    ]
    if hf:
        lines.append(f"| HF transformers continuous batching ({hf['mode']}) on "
                     f"{results['hf_requests']} requests | {hf['output_tok_per_s']:.0f} | "
                     f"{hf['req_per_s']:.2f} | {hf['seconds']:.1f} |")
        if "offline_hf_subset" in results:
            s = results["offline_hf_subset"]
            lines.append(f"| turbomq on the same {results['hf_requests']} requests | "
                         f"{s['output_tok_per_s']:.0f} | {s['req_per_s']:.2f} | {s['seconds']:.1f} |")
        lines += ["", f"Speed-up over HF (same requests): {results['speedup_vs_hf']:.1f}x"]
    lines += ["", "## Multi-turn TTFT (128-token turn; medians of 3 sessions)", "",
              "| session tokens | resident (hit) ms | after eviction ms | fresh 128-token prompt ms | hit / fresh |",
              "|---:|---:|---:|---:|---:|"]
    for mt in (results["multi_turn_2k"], m):
        lines.append(f"| {mt['history_tokens']} | {mt['hit_ttft_ms']:.1f} | {mt['evicted_ttft_ms']:.1f} | "
                     f"{mt['fresh_ttft_ms']:.1f} | {mt['hit_over_fresh']:.2f} |")
    replay = results["profile"]["decode_graph_replay_ms"]
    if replay:
        lines += ["", f"GPU time of one batch-1 decode graph replay: {replay:.2f} ms "
                  f"(= {1e3 / replay:.0f} tok/s if the host added nothing); kernel profiles in "
                  "engine_profile.txt."]
    lines.append("")
    (out / "engine.md").write_text("\n".join(lines) + "\n")
    (out / "engine.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(1, 2, figsize=(10, 4))
        names = ["turbomq"] + (["HF CB"] if hf else [])
        vals = [results.get("offline_hf_subset", o)["output_tok_per_s"]] + ([hf["output_tok_per_s"]] if hf else [])
        ax[0].bar(names, vals)
        ax[0].set_title("offline output tokens/s (same requests)")
        ax[1].bar(["hit", "evicted", "fresh"], [m["hit_ttft_ms"], m["evicted_ttft_ms"], m["fresh_ttft_ms"]])
        ax[1].set_title("multi-turn TTFT, ms")
        fig.tight_layout()
        fig.savefig(out / "engine.png", dpi=100)
    except ImportError:
        print("matplotlib not installed: no plot")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--hf-requests", type=int, default=1000)
    ap.add_argument("--max-batch-size", type=int, default=256)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    cfg = LLAMA3_8B
    results: dict = {"device": torch.cuda.get_device_name(), "requests": args.requests,
                     "hf_requests": args.hf_requests}
    results["ceilings"] = ceilings()
    print("ceilings", results["ceilings"], flush=True)
    model = LlamaModel(cfg, random_tensors(cfg), "cuda", torch.bfloat16)
    engine_cfg = EngineConfig(model="(random weights)", device="cuda", max_batch_size=args.max_batch_size,
                              block_size=64, kv_cache_fraction=0.85, max_num_batched_tokens=8192,
                              max_model_len=16384)
    engine = Engine(engine_cfg, model=model)
    results["kv_tokens_capacity"] = engine.stats()["kv_tokens_capacity"]
    # warm-up: captures the decode graphs used below (batch 4 and batch 1), so
    # no capture falls inside a timed run
    for copies in (4, 1):
        engine.generate(input_ids=[list(range(1000, 1128))] * copies,
                        params=SamplingParams(max_tokens=8, **GREEDY))
    results["decode_batch1"] = decode_batch1(engine, cfg, results["ceilings"])
    print("decode", results["decode_batch1"], flush=True)
    results["profile"] = profile(engine, args.out)
    results["multi_turn"] = multi_turn(engine, 8192)
    results["multi_turn_2k"] = multi_turn(engine, 2048)
    print("multi-turn", results["multi_turn"], results["multi_turn_2k"], flush=True)
    if not args.requests:  # quick runs: latency figures only
        print(json.dumps(results, indent=2))
        return
    work = sharegpt_like(args.requests)
    results["offline"] = run_offline(engine, work)
    print("offline", results["offline"], flush=True)
    hf_work = work[:args.hf_requests]
    if args.hf_requests and args.hf_requests != args.requests:
        results["offline_hf_subset"] = run_offline(engine, hf_work)
    ours = results.get("offline_hf_subset", results["offline"])
    del engine, model
    gc.collect()
    torch.cuda.empty_cache()
    if args.hf_requests:
        results["hf_offline"] = hf_offline(cfg, hf_work)
        results["speedup_vs_hf"] = ours["output_tok_per_s"] / results["hf_offline"]["output_tok_per_s"]
    write_report(args.out, results)


if __name__ == "__main__":
    main()
