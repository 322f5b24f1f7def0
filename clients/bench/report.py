"""What a benchmark leaves behind with `--out DIR`: `results.json` (the
configuration, the summary, the per-second throughput and every request's
times), `latency_cdf.png` (TTFT, TPOT, ITL, E2EL) and `throughput.png`
(output tokens/s over time); for a run of several modes, one folder per mode
and `compare.md` / `compare_latency_cdf.png` / `compare_throughput.png` side
by side. Plots need matplotlib (the [bench] extra), imported only here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from .backends import RequestResult
from .metrics import METRICS, NAMES, _pname, throughput_series, tpot_of


def records(results: Sequence[RequestResult], start: float) -> list[dict]:
    return [{"conversation": r.conversation, "turn": r.turn, "start_s": r.start - start,
             "success": r.success, "error": r.error or None, "ttft_s": r.ttft,
             "tpot_s": tpot_of(r), "e2el_s": r.latency, "prompt_tokens": r.prompt_tokens,
             "cached_tokens": r.cached_tokens, "output_tokens": r.output_tokens,
             "itl_s": [round(x, 6) for x in r.itl]} for r in results]


def write_run(out: Path, config: dict, summary: dict, results: Sequence[RequestResult],
              start: float) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "summary": summary,
           "output_throughput_per_s": throughput_series([r for r in results if r.success], start),
           "requests": records(results, start)}
    (out / "results.json").write_text(_dump(doc))
    plot_runs(out, {config.get("label") or "run": doc})
    return doc


def _dump(doc: dict) -> str:
    """JSON with the configuration and summary indented and one line per request."""
    head = {k: v for k, v in doc.items() if k != "requests"}
    body = json.dumps(head, indent=1)[:-2]  # without the closing "\n}"
    rows = ",\n  ".join(json.dumps(r, separators=(",", ":")) for r in doc["requests"])
    return f'{body},\n "requests": [\n  {rows}\n ]\n}}\n'


def _values(doc: dict, metric: str) -> list[float]:
    ok = [r for r in doc["requests"] if r["success"]]
    if metric == "itl":
        return [x * 1000 for r in ok for x in r["itl_s"]]
    key = {"ttft": "ttft_s", "tpot": "tpot_s", "e2el": "e2el_s"}[metric]
    return [r[key] * 1000 for r in ok if r[key] is not None]


def plot_runs(out: Path, docs: dict, prefix: str = "") -> list[Path]:
    """Latency CDFs and throughput over time of one or more runs (overlaid)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    written = []
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, metric in zip(axes.flat, METRICS):
        for label, doc in docs.items():
            v = np.sort(np.asarray(_values(doc, metric)))
            if v.size:
                ax.step(v, np.arange(1, v.size + 1) / v.size, where="post", label=label)
        ax.set_title(NAMES[metric])
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of " + ("gaps" if metric == "itl" else "requests"))
        ax.grid(alpha=0.3)
        if len(docs) > 1:
            ax.legend()
    fig.tight_layout()
    path = out / f"{prefix}latency_cdf.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)

    fig, ax = plt.subplots(figsize=(10, 3.5))
    for label, doc in docs.items():
        series = doc["output_throughput_per_s"]
        ax.plot(range(len(series)), series, label=label, drawstyle="steps-post")
    ax.set_xlabel("seconds since start")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput over time")
    ax.grid(alpha=0.3)
    if len(docs) > 1:
        ax.legend()
    fig.tight_layout()
    path = out / f"{prefix}throughput.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
    return written


_ROWS = [("Successful requests", "completed", "{:d}"), ("Failed requests", "failed", "{:d}"),
         ("Benchmark duration (s)", "duration", "{:.2f}"),
         ("Total input tokens", "total_input_tokens", "{:d}"),
         ("Total generated tokens", "total_output_tokens", "{:d}"),
         ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
         ("Request goodput (req/s)", "request_goodput", "{:.2f}"),
         ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
         ("Total token throughput (tok/s)", "total_token_throughput", "{:.2f}"),
         ("Cache hit rate (all turns)", "cache_hit_rate", "{:.3f}"),
         ("Cache hit rate (later turns)", "later_turns_cache_hit_rate", "{:.3f}"),
         ("First turns that reused nothing", "first_turns_without_reuse", "{}")]


def compare_table(docs: dict) -> str:
    """A markdown table of several runs' summaries, side by side."""
    labels = list(docs)
    lines = ["| metric | " + " | ".join(labels) + " |",
             "| --- | " + " | ".join("---:" for _ in labels) + " |"]

    def add(name: str, key: str, fmt: str) -> None:
        vals = [docs[l]["summary"].get(key) for l in labels]
        if all(v is None for v in vals):
            return
        lines.append(f"| {name} | " + " | ".join("-" if v is None else fmt.format(v)
                                                 for v in vals) + " |")

    for name, key, fmt in _ROWS:
        add(name, key, fmt)
    percentiles = docs[labels[0]]["summary"]["percentiles"]
    for metric in METRICS:
        for stat in ["mean", "median"] + [f"p{_pname(p)}" for p in percentiles if p != 50]:
            add(f"{stat.capitalize()} {metric.upper()} (ms)", f"{stat}_{metric}_ms", "{:.1f}")
    for label in ("first_turn", "later_turns"):
        for stat in ("mean", "median", "p99"):
            add(f"{stat.capitalize()} TTFT, {label.replace('_', ' ')} (ms)",
                f"{stat}_ttft_{label}_ms", "{:.1f}")
    return "\n".join(lines)


def write_comparison(out: Path, docs: dict, command: str) -> Path:
    plot_runs(out, docs, prefix="compare_")
    path = out / "compare.md"
    commands = [command] + [c for c in dict.fromkeys(d["config"].get("command") for d in
                                                      docs.values()) if c and c != command]
    shown = "\n".join(commands)
    path.write_text(f"# {' vs '.join(docs)}\n\n```sh\n{shown}\n```\n\n{compare_table(docs)}\n\n"
                    "![latency CDFs](compare_latency_cdf.png)\n\n"
                    "![output throughput](compare_throughput.png)\n")
    return path
