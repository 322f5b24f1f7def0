"""The benchmark's figures, named and computed as `vllm bench serve` does:
request, output and total token throughput; TTFT, TPOT (per request, first
token excluded), ITL (every gap between token-bearing chunks) and E2EL, each
as mean, median, std and percentiles in milliseconds; goodput under SLOs.
For multi-turn runs also the cache hit rate (prompt tokens served from
resident KV) and the TTFT of first and later turns."""

from __future__ import annotations

import math
from typing import Iterable, Optional, Sequence

import numpy as np

from .backends import RequestResult

METRICS = ("ttft", "tpot", "itl", "e2el")
NAMES = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
         "itl": "Inter-token Latency", "e2el": "End-to-end Latency"}


def parse_goodput(specs: Iterable[str]) -> dict[str, float]:
    """`ttft:500 tpot:50 e2el:2000` (milliseconds) -> {"ttft": 500.0, ...}."""
    slos = {}
    for spec in specs:
        name, sep, value = spec.partition(":")
        if not sep or name not in ("ttft", "tpot", "e2el"):
            raise ValueError(f"bad SLO {spec!r}: expected ttft:MS, tpot:MS or e2el:MS")
        slos[name] = float(value)
        if not slos[name] > 0:
            raise ValueError(f"bad SLO {spec!r}: the bound must be > 0 ms")
    return slos


def tpot_of(r: RequestResult) -> Optional[float]:
    return (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else None


def _stats(name: str, values_s: Sequence[float], percentiles: Sequence[float]) -> dict:
    ms = np.asarray(values_s, dtype=float) * 1000.0
    if ms.size == 0:
        ms = np.zeros(1)
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    for p in percentiles:
        out[f"p{_pname(p)}_{name}_ms"] = float(np.percentile(ms, p))
    return out


def _pname(p: float) -> str:
    return str(int(p)) if float(p).is_integer() else str(p)


def throughput_series(results: Sequence[RequestResult], start: float,
                      bin_s: float = 1.0) -> list[float]:
    """Output tokens per second in consecutive `bin_s` windows from `start`."""
    end = max((t for r in results for t in r.chunk_times), default=start)
    bins = [0.0] * (int((end - start) / bin_s) + 1)
    for r in results:
        for t, n in zip(r.chunk_times, r.chunk_tokens):
            bins[int((t - start) / bin_s)] += n / bin_s
    return bins


def summarize(results: Sequence[RequestResult], duration: float, start: float,
              percentiles: Sequence[float] = (50, 90, 99),
              slos: Optional[dict] = None, multi_turn: bool = False) -> dict:
    ok = [r for r in results if r.success]
    ttfts = [r.ttft for r in ok if r.chunk_times]
    tpots = [t for t in (tpot_of(r) for r in ok) if t is not None]
    itls = [x for r in ok for x in r.itl]
    e2els = [r.latency for r in ok]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    s = {"completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
         "total_input_tokens": total_in, "total_output_tokens": total_out,
         "request_throughput": len(ok) / duration if duration > 0 else 0.0,
         "output_throughput": total_out / duration if duration > 0 else 0.0,
         "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0}
    series = throughput_series(ok, start)
    s["max_output_tokens_per_s"] = max(series) if series else 0.0
    if slos:
        good = 0
        for r in ok:
            checks = {"ttft": r.ttft, "tpot": tpot_of(r) or 0.0, "e2el": r.latency}
            good += all(checks[k] * 1000.0 <= bound for k, bound in slos.items())
        s["request_goodput"] = good / duration if duration > 0 else 0.0
        s["goodput_slos_ms"] = dict(slos)
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        s.update(_stats(name, values, percentiles))
    s["percentiles"] = list(percentiles)
    if multi_turn:
        later = [r for r in ok if r.turn > 0]
        prompt = sum(r.prompt_tokens for r in ok)
        later_prompt = sum(r.prompt_tokens for r in later)
        s["cache_hit_rate"] = sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0
        s["later_turns_cache_hit_rate"] = (sum(r.cached_tokens for r in later) / later_prompt
                                           if later_prompt else 0.0)
        s["turns"] = 1 + max((r.turn for r in results), default=0)
        # First turns that reused nothing: with a shared system prompt, how
        # often it was prefilled (once per worker when the prefix cache works)
        s["first_turns_without_reuse"] = sum(r.turn == 0 and r.cached_tokens == 0 for r in ok)
        for label, group in (("first_turn", [r for r in ok if r.turn == 0]), ("later_turns", later)):
            values = [r.ttft for r in group if r.chunk_times]
            s.update({k.replace("_ttft_", f"_ttft_{label}_"): v
                      for k, v in _stats("ttft", values, percentiles).items()})
    return s


def format_summary(s: dict, title: str = "Serving Benchmark Result") -> str:
    """The terminal table, laid out like `vllm bench serve`'s."""
    lines = [f"{' ' + title + ' ':=^50}"]

    def row(label: str, value, fmt: str = "{:<10.2f}") -> None:
        lines.append(f"{label:<40}" + (fmt.format(value) if not isinstance(value, int)
                                       else f"{value:<10}"))

    row("Successful requests:", s["completed"])
    if s["failed"]:
        row("Failed requests:", s["failed"])
    row("Benchmark duration (s):", s["duration"])
    row("Total input tokens:", s["total_input_tokens"])
    row("Total generated tokens:", s["total_output_tokens"])
    row("Request throughput (req/s):", s["request_throughput"])
    if "request_goodput" in s:
        row("Request goodput (req/s):", s["request_goodput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Peak output token throughput (tok/s):", s["max_output_tokens_per_s"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    for name in METRICS:
        lines.append(f"{NAMES[name]:-^50}")
        short = name.upper()
        row(f"Mean {short} (ms):", s[f"mean_{name}_ms"])
        row(f"Median {short} (ms):", s[f"median_{name}_ms"])
        for p in s["percentiles"]:
            if _pname(p) != "50":
                row(f"P{_pname(p)} {short} (ms):", s[f"p{_pname(p)}_{name}_ms"])
    if "cache_hit_rate" in s:
        lines.append(f"{'Multi-turn':-^50}")
        row("Turns per conversation:", s["turns"])
        row("Cache hit rate (all turns):", s["cache_hit_rate"], "{:<10.3f}")
        row("Cache hit rate (later turns):", s["later_turns_cache_hit_rate"], "{:<10.3f}")
        row("First turns that reused nothing:", s["first_turns_without_reuse"], "{:<10d}")
        for label, text in (("first_turn", "first turns"), ("later_turns", "later turns")):
            row(f"Mean TTFT, {text} (ms):", s[f"mean_ttft_{label}_ms"])
            row(f"P99 TTFT, {text} (ms):", s[f"p99_ttft_{label}_ms"]
                if f"p99_ttft_{label}_ms" in s else math.nan)
    lines.append("=" * 50)
    return "\n".join(lines)
