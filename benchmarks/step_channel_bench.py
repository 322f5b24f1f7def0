"""How long a tensor-parallel step's inputs take from rank 0 to another rank:
the shared-memory channel (engine/step_channel.py) against the two gloo
broadcasts (header, then body) it replaced, in one run on this host (CPU
only: these are host-side messages).

Messages as engine/ranks.py builds them: a decode step at batch 1 and 64,
and a 128- and a 2048-token prefill, block tables 256 wide. Rank 0 sends one
every 2 ms; the receiver notes when each arrives (CLOCK_MONOTONIC, shared by
the processes). Figures: one-way latency (median, 90th percentile) and rank
0's own time in the send, microseconds.

    python benchmarks/step_channel_bench.py [--out docs/benchmarks]

Writes step_channel.md and step_channel.json into --out."""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import socket
import time
from pathlib import Path

import numpy as np

WIDTH = 256
CASES = {"decode, batch 1": (1, 1), "decode, batch 64": (64, 64),
         "prefill, 128 tokens": (1, 128), "prefill, 2048 tokens": (1, 2048)}
STEPS, WARMUP, PERIOD_S = 400, 50, 0.002


def message(seqs: int, tokens: int) -> np.ndarray:
    header = [2, seqs, tokens, WIDTH, 0, seqs, 0]
    body = np.zeros(tokens + 2 * seqs + seqs * WIDTH, dtype=np.int64)
    return np.concatenate([np.array(header, dtype=np.int64), body])


def _now_ns() -> int:
    return time.monotonic_ns()


def _pace(t_next: float) -> None:
    while time.monotonic() < t_next:
        pass


def paced_sends(sizes: list, send) -> dict:
    """send(message) of each size STEPS times, one every PERIOD_S, each
    stamped with its send time (word 4); rank 0's time in each send."""
    spent_by_size = {}
    for name, n in sizes:
        m = np.zeros(n, dtype=np.int64)
        spent = []
        t_next = time.monotonic()
        for _ in range(STEPS):
            t_next += PERIOD_S
            _pace(t_next)
            t0 = _now_ns()
            m[4] = t0
            send(m)
            spent.append(_now_ns() - t0)
        spent_by_size[name] = spent[WARMUP:]
    return spent_by_size


def _gloo_receiver(port: int, sizes: list, out) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=1, world_size=2)
    lat = {}
    for name, n in sizes:
        header, body = torch.empty(7, dtype=torch.long), torch.empty(n - 7, dtype=torch.long)
        got = []
        for _ in range(STEPS):
            dist.broadcast(header, 0)
            dist.broadcast(body, 0)
            got.append(_now_ns() - int(header[4]))
        lat[name] = got[WARMUP:]
    out.put(lat)
    dist.destroy_process_group()


def _channel_receiver(path: str, pid: int, sizes: list, out) -> None:
    from turbomq.worker.engine.step_channel import StepChannel

    channel = StepChannel.attach(path, 1, 0, pid, timeout=60)
    lat = {}
    for name, _ in sizes:
        got = []
        for _ in range(STEPS):
            m = channel.receive()
            got.append(_now_ns() - int(m[4]))
        lat[name] = got[WARMUP:]
    out.put(lat)
    channel.close()


def run_gloo(sizes: list) -> tuple[dict, dict]:
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_gloo_receiver, args=(port, sizes, out))
    p.start()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2)

    def broadcast(m: np.ndarray) -> None:
        t = torch.from_numpy(m)
        dist.broadcast(t[:7].clone(), 0)
        dist.broadcast(t[7:].clone(), 0)

    send = paced_sends(sizes, broadcast)
    lat = out.get()
    p.join(60)
    dist.destroy_process_group()
    return lat, send


def run_channel(sizes: list) -> tuple[dict, dict]:
    from turbomq.worker.engine.step_channel import StepChannel

    channel = StepChannel.create(1, timeout=60)
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    p = ctx.Process(target=_channel_receiver, args=(channel.name, os.getpid(), sizes, out))
    p.start()
    try:
        send = paced_sends(sizes, channel.send)
        lat = out.get()
        p.join(60)
    finally:
        channel.close()
    return lat, send


def stats(ns: list) -> dict:
    us = np.asarray(ns, dtype=np.float64) / 1e3
    return {"median_us": float(np.median(us)), "p90_us": float(np.percentile(us, 90))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("docs/benchmarks"))
    args = ap.parse_args()
    sizes = [(name, len(message(*shape))) for name, shape in CASES.items()]
    results = {"host": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
               "steps": STEPS - WARMUP, "cases": {}}
    for transport, run in (("gloo", run_gloo), ("channel", run_channel)):
        lat, send = run(sizes)
        for name, n in sizes:
            results["cases"].setdefault(name, {"words": n})[transport] = {
                "latency": stats(lat[name]), "send": stats(send[name])}
    lines = ["# Step inputs from rank 0 to another rank", "",
             f"{results['host']}; `python benchmarks/step_channel_bench.py`, one run, "
             f"{results['steps']} messages a case, one every {PERIOD_S * 1e3:.0f} ms. "
             "Microseconds: one-way latency (sent to received), and rank 0's time in the "
             "send; median / 90th percentile.", "",
             "| step | words | gloo latency | channel latency | gloo send | channel send |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name, c in results["cases"].items():
        def cell(t: str, k: str) -> str:
            s = c[t][k]
            return f"{s['median_us']:.1f} / {s['p90_us']:.1f}"
        lines.append(f"| {name} | {c['words']:,} | {cell('gloo', 'latency')} | "
                     f"{cell('channel', 'latency')} | {cell('gloo', 'send')} | "
                     f"{cell('channel', 'send')} |")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_channel.md").write_text("\n".join(lines) + "\n")
    (args.out / "step_channel.json").write_text(json.dumps(results, indent=2) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
