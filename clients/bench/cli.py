"""`turbomq bench`: its flags and its run. The `turbomq` command's parser
calls `add_arguments`; nothing heavy is imported until `main` runs."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
from pathlib import Path
from typing import Optional

WORKLOADS = ("sharegpt-synthetic", "sharegpt", "fixed", "multi-turn")


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("target (one of)")
    target.add_argument("--broker", default=None, metavar="ADDR[,ADDR2]",
                        help="a turbomq broker's front endpoint(s): requests go through the "
                             "client library")
    target.add_argument("--base-url", default=None, metavar="URL",
                        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000/v1 "
                             "(turbomq gateway, vLLM, ...)")
    target.add_argument("--curve-secret", default=None, metavar="FILE",
                        help="CurveZMQ client key for --broker (with --broker-key)")
    target.add_argument("--broker-key", default=None, metavar="FILE")
    target.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="for --base-url (default: $OPENAI_API_KEY)")
    target.add_argument("--model", default=None,
                        help="for --base-url (default: the first of /v1/models)")
    target.add_argument("--endpoint", choices=("completions", "chat"), default=None,
                        help="for --base-url: /v1/completions or /v1/chat/completions "
                             "(default: chat for multi-turn, else completions)")
    work = p.add_argument_group("workload")
    work.add_argument("--workload", choices=WORKLOADS, default="sharegpt-synthetic")
    work.add_argument("--dataset-path", default=None, metavar="FILE",
                      help="a ShareGPT JSON file (sharegpt; multi-turn takes its conversations)")
    work.add_argument("--num-prompts", type=int, default=100,
                      help="requests (multi-turn: conversations)")
    work.add_argument("--input-len", type=int, default=128,
                      help="prompt tokens (synthetic: the median; multi-turn: per user turn)")
    work.add_argument("--output-len", type=int, default=128,
                      help="tokens generated per request (synthetic: the median)")
    work.add_argument("--output-sigma", type=float, default=0.0, metavar="S",
                      help="multi-turn: replies log-normal around --output-len with this sigma "
                           "(0: every reply exactly --output-len). Equal replies finish together "
                           "and the next turns all arrive at once")
    work.add_argument("--turns", type=int, default=4, help="multi-turn: turns per conversation")
    work.add_argument("--system-prompt-len", type=int, default=0, metavar="N",
                      help="multi-turn: every conversation opens with the same system message "
                           "of about N tokens")
    work.add_argument("--think-time", type=float, default=1.0,
                      help="multi-turn: mean seconds a user thinks before the next turn "
                           "(exponential)")
    work.add_argument("--multi-turn-mode", default="session", metavar="MODE[,MODE]",
                      help="session (KV kept between turns) or resend (the whole history each "
                           "turn, no session); several: each is run in turn and compared")
    work.add_argument("--tokenizer", default=None, metavar="PATH",
                      help="a model dir or tokenizer.json, for exact prompt lengths (default: "
                           "about one word per token)")
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=float("inf"),
                      help="requests (multi-turn: conversations) per second; inf: all at once")
    load.add_argument("--burstiness", type=float, default=1.0,
                      help="gamma shape of the arrival gaps; 1: Poisson")
    load.add_argument("--max-concurrency", type=int, default=None,
                      help="requests in flight at most")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--ignore-eos", action="store_true",
                      help="generate exactly the output length (the server must support it)")
    load.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    out = p.add_argument_group("results")
    out.add_argument("--metric-percentiles", default="50,90,99",
                     help="percentiles of each latency (comma-separated)")
    out.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                     help="SLOs for goodput, e.g. ttft:500 tpot:50 e2el:5000")
    out.add_argument("--out", default=None, metavar="DIR",
                     help="write results.json and PNG plots (latency CDFs, throughput over time)")
    out.add_argument("--label", default=None, help="this run's name in results and comparisons")
    out.add_argument("--no-progress", action="store_true", help="no progress bar")
    out.add_argument("--compare", nargs="+", default=None, metavar="RESULTS_JSON",
                     help="no run: put earlier runs' results.json side by side in --out DIR "
                          "(compare.md, overlaid CDFs and throughput)")


def _conversations(args, mode_seed: int):
    from . import workloads as W

    rng = random.Random(mode_seed)
    count = W.tokenizer_counter(args.tokenizer) if args.tokenizer else None
    if args.workload == "sharegpt":
        if not args.dataset_path:
            raise ValueError("--workload sharegpt needs --dataset-path")
        return W.sharegpt(args.num_prompts, rng, args.dataset_path, count)
    if args.workload == "fixed":
        return W.fixed(args.num_prompts, rng, args.input_len, args.output_len, count)
    if args.workload == "multi-turn":
        return W.multi_turn(args.num_prompts, rng, args.turns, args.input_len, args.output_len,
                            args.think_time, args.dataset_path, count, args.system_prompt_len,
                            args.output_sigma)
    return W.synthetic_sharegpt(args.num_prompts, rng, args.input_len, args.output_len, count)


async def _run_one(args, mode: Optional[str], percentiles, slos) -> tuple[dict, list, float]:
    from .backends import OpenAIBackend, TurbomqBackend
    from .metrics import summarize
    from .runner import run_workload

    multi = args.workload == "multi-turn"
    if args.broker:
        curve = None
        if args.curve_secret or args.broker_key:
            from turbomq.clients import CurveClient
            curve = CurveClient.load(args.curve_secret, args.broker_key)
        backend = TurbomqBackend([b for b in args.broker.split(",") if b], curve, args.timeout)
    else:
        endpoint = args.endpoint or ("chat" if multi else "completions")
        if multi and endpoint != "chat":
            raise ValueError("multi-turn needs --endpoint chat")
        backend = OpenAIBackend(args.base_url, args.model, args.api_key, endpoint, args.timeout)
    try:
        if isinstance(backend, OpenAIBackend):
            await backend.resolve_model()
        convs = _conversations(args, args.seed)
        sampling = {"temperature": args.temperature}
        if args.ignore_eos:
            sampling["ignore_eos"] = True
        results, duration, start = await run_workload(
            backend, convs, request_rate=args.request_rate, max_concurrency=args.max_concurrency,
            seed=args.seed, burstiness=args.burstiness, mode=mode,
            chat=args.endpoint == "chat" and not multi, sampling=sampling,
            progress=not args.no_progress)
    finally:
        await backend.close()
    summary = summarize(results, duration, start, percentiles, slos, multi_turn=multi)
    return summary, results, start


def _command(argv: Optional[list]) -> str:
    return "turbomq bench " + " ".join(shlex.quote(a) for a in (argv or sys.argv[2:]))


def _config(args, mode: Optional[str], label: str, command: str) -> dict:
    keys = ("broker", "base_url", "model", "endpoint", "workload", "dataset_path", "num_prompts",
            "input_len", "output_len", "output_sigma", "turns", "system_prompt_len", "think_time", "request_rate", "burstiness",
            "max_concurrency", "seed", "temperature", "ignore_eos", "tokenizer")
    cfg = {k: getattr(args, k) for k in keys}
    if cfg["request_rate"] == float("inf"):
        cfg["request_rate"] = "inf"
    cfg.update(label=label, multi_turn_mode=mode, backend="turbomq" if args.broker else "openai",
               command=command)
    return cfg


def _compare(args, argv: Optional[list]) -> int:
    from .report import write_comparison

    if not args.out:
        print("turbomq bench: error: --compare needs --out DIR", file=sys.stderr)
        return 2
    runs = []
    try:
        for path in args.compare:
            doc = json.loads(Path(path).read_text())
            runs.append((doc["config"].get("label") or Path(path).parent.name, doc))
    except (OSError, ValueError, KeyError) as e:
        print(f"turbomq bench: error: cannot read {path}: {e}", file=sys.stderr)
        return 2
    labels = [label for label, _ in runs]
    if len(set(labels)) < len(labels):  # runs of one mode against two targets: name the target
        runs = [(f"{label} ({doc['config'].get('backend', '?')})", doc) for label, doc in runs]
    docs = {}
    for label, doc in runs:
        while label in docs:
            label += "'"
        docs[label] = doc
    Path(args.out).mkdir(parents=True, exist_ok=True)
    print(f"comparison: {write_comparison(Path(args.out), docs, _command(argv))}", flush=True)
    return 0


def main(args: argparse.Namespace, argv: Optional[list] = None) -> int:
    from .metrics import format_summary, parse_goodput

    if args.compare:
        return _compare(args, argv)
    if bool(args.broker) == bool(args.base_url):
        print("turbomq bench: error: give one target: --broker ADDR or --base-url URL",
              file=sys.stderr)
        return 2
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p]
        slos = parse_goodput(args.goodput or [])
        modes = [m for m in args.multi_turn_mode.split(",") if m]
        bad = [m for m in modes if m not in ("session", "resend")]
        if bad or not modes:
            raise ValueError(f"--multi-turn-mode: {', '.join(bad) or 'none'}; "
                             "expected session and/or resend")
        if args.workload != "multi-turn":
            modes = [None]
    except ValueError as e:
        print(f"turbomq bench: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    docs = {}
    for mode in modes:
        label = args.label or mode or args.workload
        if args.label and len(modes) > 1:
            label = f"{args.label} {mode}"
        try:
            summary, results, start = asyncio.run(_run_one(args, mode, percentiles, slos))
        except (ValueError, OSError) as e:
            print(f"turbomq bench: error: {e}", file=sys.stderr)
            return 2
        print(format_summary(summary, f"Serving Benchmark Result: {label}"), flush=True)
        if summary["failed"]:
            errors = sorted({r.error for r in results if not r.success})
            print(f"{summary['failed']} requests failed: {'; '.join(errors[:3])}",
                  file=sys.stderr)
        if out is not None:
            from .report import write_run
            folder = out / mode if len(modes) > 1 else out
            docs[label] = write_run(folder, _config(args, mode, label, _command(argv)), summary,
                                    results, start)
    if out is not None and len(docs) > 1:
        from .report import write_comparison
        path = write_comparison(out, docs, _command(argv))
        print(f"comparison: {path}", flush=True)
    if out is not None:
        print(f"results: {out}/", flush=True)
    return 0 if all(d["summary"]["completed"] for d in docs.values()) or not docs else 1
