"""What "a 128-token turn on an 8k session <= 1.1x the same turn without
history" asks of the attention over the session's keys, measured in one run
on one CUDA GPU (Llama-3-8B shapes, bf16):

- the turn on a resident 8k session and the same turn as a fresh prompt,
  through the engine with its defaults (prefill graphs on, random weights:
  benchmarks/gpu_engine.py): medians of 3, and each turn's prefill-attention
  kernel time over one profiled turn (benchmarks/gpu_turn_profile.py);
- the attention rates at hand: the prefill-attention kernel and PyTorch's
  fused attention (cuDNN, FlashAttention) on the turn's shape and on shapes
  that favour them, and cuBLAS's bf16 GEMM on 8192^3, which no attention
  kernel outruns (it adds a softmax to the same products);
- from those: the attention time and rate that 1.1x leaves the turn, and the
  ratio the turn would reach with its attention at each measured rate and
  every other kernel and gap as measured.

    python benchmarks/gpu_turn_bound.py --out DIR

Writes turn_bound.md and turn_bound.json into DIR (copy them to
docs/benchmarks/)."""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_attention_yardstick as yardstick  # noqa: E402
import gpu_kernels  # noqa: E402
from gpu_engine import LLAMA3_8B, ceilings, publish  # noqa: E402
from gpu_turn_profile import HISTORY, profiled_turns  # noqa: E402

from turbomq.worker.model.ops import cuda as cuda_ops  # noqa: E402

H, KV, D = yardstick.H, yardstick.KV, yardstick.D
TARGET = 1.1


def causal_flops(new: int, keys: int) -> int:
    """Attention FLOPs of `new` rows that end a causal context of `keys`
    (QK^T and PV, all query heads): 4 x keys seen x heads x head_dim."""
    hist = keys - new
    return 4 * (new * hist + new * (new + 1) // 2) * H * D


def sdpa_rate(backend: str, new: int, keys: int, causal: bool) -> dict:
    """µs and TFLOP/s of PyTorch's fused attention on contiguous K/V."""
    q = torch.randn((1, H, new, D), dtype=torch.bfloat16, device="cuda")
    k = torch.randn((1, KV, keys, D), dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    flops = causal_flops(new, keys) if causal else 4 * new * keys * H * D
    try:
        with sdpa_kernel(yardstick.BACKENDS[backend]):
            t = gpu_kernels.time_graph(
                lambda i: F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                         enable_gqa=True), calls=3, reps=10)
    except RuntimeError as e:  # this PyTorch or GPU lacks the backend
        return {"error": str(e).splitlines()[0][:160]}
    return {"us": t * 1e6, "TFLOPs": flops / t / 1e12}


def own_rate(new: int, keys: int) -> dict:
    """µs and TFLOP/s of the paged prefill-attention kernel."""
    q, kv, batch = gpu_kernels.history_case(new, keys)
    t = gpu_kernels.time_graph(lambda i: cuda_ops.paged_attention(q, kv, batch, D ** -0.5),
                               calls=5, reps=10)
    return {"us": t * 1e6, "TFLOPs": causal_flops(new, keys) / t / 1e12}


def attention_rates() -> list[dict]:
    """Every kernel at hand on the 8k turn's shape and on shapes that favour it."""
    rows = []
    for name, new, keys, causal in (("129 over 8192 (the turn)", 129, 8192, True),
                                    ("1024 over 8192", 1024, 8192, True),
                                    ("8192 causal", 8192, 8192, True),
                                    ("8192 x 8192, no mask", 8192, 8192, False)):
        row = {"case": name}
        row["turbomq"] = own_rate(new, keys) if causal else {"error": "causal only"}
        for backend in yardstick.BACKENDS:
            # the turn and the chunk as the yardstick takes them: the whole
            # rectangle (under 6% more work), TFLOP/s of the causal work
            rect = causal and new < keys
            r = sdpa_rate(backend, new, keys, causal and not rect)
            if rect and "us" in r:
                r["TFLOPs"] = causal_flops(new, keys) / r["us"] / 1e6
            row[backend] = r
        print(row, flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    return rows


def engine_turns() -> dict:
    """The turn on a resident 8k session and the fresh turn: wall-clock
    medians, and one profiled turn of each (total and attention kernel ms)."""
    times, hit, fresh = profiled_turns()
    gc.collect()  # the engine's model and pool
    torch.cuda.empty_cache()

    def attention_ms(kernels: dict) -> float:
        return sum(k["us"] for n, k in kernels.items()
                   if "prefill_attention" in n or "prefill_combine" in n) / 1e3

    return {**times, "hit_kernels_ms": sum(k["us"] for k in hit.values()) / 1e3,
            "fresh_kernels_ms": sum(k["us"] for k in fresh.values()) / 1e3,
            "hit_attention_ms": attention_ms(hit), "fresh_attention_ms": attention_ms(fresh)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    reason = cuda_ops.unavailable_reason()
    if reason:
        raise SystemExit(f"cannot benchmark: {reason}")
    torch.manual_seed(0)
    device = torch.cuda.get_device_name()
    ceil = ceilings()
    print(ceil, flush=True)
    rates = attention_rates()
    turns = engine_turns()
    layers = LLAMA3_8B.num_layers
    # the session's cache holds HISTORY - 1 tokens (the reply's last token is
    # not written yet): the turn prefills it and the 128 new ones
    turn_flops = layers * causal_flops(129, HISTORY + 128)
    hit, fresh = turns["hit_ttft_ms"], turns["fresh_ttft_ms"]
    rest = hit - turns["hit_attention_ms"]  # every kernel and gap but the attention
    allowed = TARGET * fresh - rest
    allowed_alone = TARGET * fresh - (fresh - turns["fresh_attention_ms"])
    best = max((r[b]["TFLOPs"], f"{b}, {r['case']}") for r in rates
               for b in ("turbomq", *yardstick.BACKENDS) if "TFLOPs" in r[b])
    results = {"device": device, "torch": torch.__version__, "ceilings": ceil,
               "attention_rates": rates, "turns": turns, "turn_attention_flops": turn_flops,
               "allowed_attention_ms": allowed, "allowed_attention_ms_nothing_else": allowed_alone}

    def projected(rate_tflops: float) -> str:
        ms = turn_flops / rate_tflops / 1e9
        return f"{ms:.2f} ms, turn {rest + ms:.2f} ms, **{(rest + ms) / fresh:.2f}x**"

    lines = [f"# What 1.1x asks of the turn's attention ({device})", "",
             "`python benchmarks/gpu_turn_bound.py --out DIR`, one run "
             "([turn_bound.json](turn_bound.json)).", "",
             "| the turns (prefill graphs) | on a resident 8k session | fresh |",
             "| --- | ---: | ---: |",
             f"| turn, ms (median of 3) | {hit:.2f} | {fresh:.2f} |",
             f"| kernels of one profiled turn, ms | {turns['hit_kernels_ms']:.2f} | "
             f"{turns['fresh_kernels_ms']:.2f} |",
             f"| prefill attention (32 launches), ms | {turns['hit_attention_ms']:.2f} | "
             f"{turns['fresh_attention_ms']:.2f} |",
             f"| turn on 8k / fresh turn (target <= {TARGET}) | **{hit / fresh:.2f}x** | |", "",
             f"The turn's attention is {turn_flops / 1e9:.0f} GFLOP over {layers} layers "
             f"(129 rows over {HISTORY - 1} cached keys and their own).", "",
             f"- {TARGET}x of the fresh turn leaves it {allowed:.2f} ms with every other "
             f"kernel and gap as measured (the turn less its attention: {rest:.2f} ms): "
             f"**{turn_flops / max(allowed, 1e-9) / 1e9:.0f} TFLOP/s**"
             + ("" if allowed > 0 else " (no time at all: unreachable)") + ".",
             f"- With nothing else differing from the fresh turn it would have "
             f"{allowed_alone:.2f} ms: **{turn_flops / allowed_alone / 1e9:.0f} TFLOP/s**.",
             "", "The rates at hand (µs a call, TFLOP/s); cuBLAS's bf16 GEMM on 8192^3: "
             f"**{ceil['gemm_TFLOPs']:.0f} TFLOP/s**.", "",
             "| case | turbomq | cuDNN | FlashAttention |", "| --- | ---: | ---: | ---: |"]
    for r in rates:
        cells = ["n/a" if "error" in r[b] else f"{r[b]['us']:.0f} ({r[b]['TFLOPs']:.0f})"
                 for b in ("turbomq", *yardstick.BACKENDS)]
        lines.append(f"| {r['case']} | " + " | ".join(cells) + " |")
    own = rates[0]["turbomq"]["TFLOPs"]
    lines += ["", "The turn with its attention at each rate, everything else as measured:", "",
              f"- this kernel on the turn ({own:.0f} TFLOP/s): {projected(own)};",
              f"- the best attention rate above, on any shape ({best[1]}, {best[0]:.0f}): "
              f"{projected(best[0])};",
              f"- cuBLAS's GEMM rate ({ceil['gemm_TFLOPs']:.0f}): "
              f"{projected(ceil['gemm_TFLOPs'])}."]
    publish(args.out, "turn_bound", lines, results)


if __name__ == "__main__":
    main()
