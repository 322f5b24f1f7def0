"""Multi-turn chat through the whole service on one GPU: `turbomq up` (a
broker and one worker) serving a Llama-3-8B-shaped model with random bf16
weights (benchmarks/random_model.py), driven by `turbomq bench`.

The workload: C conversations x T turns that open with one shared system
prompt, user turns around U tokens, replies around R tokens (log-normal,
sigma 0.5, ignore_eos), the user thinking about a second between turns, at
most K turns in flight; the KV pool holds about 65% of the tokens the
conversations end with. Replies of one fixed length (--output-sigma 0) make
every turn in flight finish at the same step, so the next K turns arrive
together, every few seconds, and each waits for the prefill of all of them:
a lockstep no real traffic has.

Modes, each on a freshly started service (nothing cached from the last):
- sessions: session ids, prefix cache, no host-RAM tier;
- sessions + host tier: the same with the host-RAM KV tier;
- resend + host tier: no session id, the whole history every turn.

    python benchmarks/gpu_service_multiturn.py --out DIR [--model DIR]

Writes DIR/<mode>/ (the bench's results, tables and plots), DIR/compare.md
(the modes side by side) and DIR/service_multiturn.md (the targets)."""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
BLOCK = 64
TEMPLATE_TOKENS = 8  # a message's chat-template tokens, about (the demo template)
MODES = {
    "sessions": (["--host-kv-blocks", "0"], "session"),
    "sessions + host tier": ([], "session"),
    "resend + host tier": ([], "resend"),
}
CLI = [sys.executable, "-m", "turbomq.worker.cli"]


def final_tokens(args) -> int:
    """Tokens the conversations end with, from the bench's own workload."""
    from turbomq.clients.bench import workloads as W
    count = W.tokenizer_counter(str(args.model))
    convs = W.multi_turn(args.conversations, random.Random(args.seed), args.turns, args.user_len,
                         args.output_len, args.think_time, count=count,
                         system_len=args.system_len, output_sigma=args.output_sigma)
    per_turn = sum(t.input_len + t.output_len + 2 * TEMPLATE_TOKENS
                   for c in convs for t in c.turns)
    return per_turn + len(convs) * (args.system_len + TEMPLATE_TOKENS)


def folder(mode: str) -> str:
    return mode.replace(" + ", "_").replace(" ", "_")


def start_service(args, pool_blocks: int, flags: list[str], log) -> tuple[subprocess.Popen, list]:
    """`turbomq up`, once it serves; with the /metrics URLs it printed."""
    cmd = CLI + ["up", "--model", str(args.model), "--workers", "1", "--device", args.device,
                 "--front", args.front, "--max-batch-size", str(args.in_flight),
                 "--num-kv-blocks", str(pool_blocks), *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True,
                            start_new_session=True)
    deadline = time.monotonic() + 600
    urls = []
    for line in proc.stdout:
        log.write(line)
        if ", metrics http" in line:
            urls.append((line.split()[0], line.rsplit(" ", 1)[1].strip()))
        if "Ctrl-C stops everything" in line:
            return proc, urls
        if time.monotonic() > deadline:
            break
    stop_service(proc)
    raise RuntimeError(f"turbomq up did not start: {' '.join(cmd)}")


def stop_service(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def profile_worker(out: Path) -> subprocess.Popen:
    """py-spy sampling the worker's threads while they hold the GIL (who keeps
    whom waiting), written to out/worker_gil.speedscope.json on SIGINT."""
    pid = subprocess.run(["pgrep", "-f", "turbomq.worker.cli worker"], capture_output=True,
                         text=True, check=True).stdout.split()[0]
    return subprocess.Popen(["py-spy", "record", "--pid", pid, "--gil", "--threads", "--rate", "200",
                             "--format", "speedscope", "-o", str(out / "worker_gil.speedscope.json")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def bench(args, mode: str, label: str, out: Path) -> dict:
    cmd = CLI + ["bench", "--broker", args.front, "--workload", "multi-turn",
                 "--num-prompts", str(args.conversations), "--turns", str(args.turns),
                 "--input-len", str(args.user_len), "--output-len", str(args.output_len),
                 "--output-sigma", str(args.output_sigma),
                 "--system-prompt-len", str(args.system_len), "--think-time", str(args.think_time),
                 "--max-concurrency", str(args.in_flight), "--multi-turn-mode", mode,
                 "--ignore-eos", "--tokenizer", str(args.model), "--seed", str(args.seed),
                 "--no-progress", "--label", label, "--out", str(out)]
    subprocess.run(cmd, check=True)
    return json.loads((out / "results.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/gpu-results/service_multiturn"))
    ap.add_argument("--model", type=Path, default=Path("build/random-llama3-8b"),
                    help="written by benchmarks/random_model.py when missing")
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--user-len", type=int, default=80)
    ap.add_argument("--output-len", type=int, default=400)
    ap.add_argument("--output-sigma", type=float, default=0.5)
    ap.add_argument("--system-len", type=int, default=256)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--pool-share", type=float, default=0.65)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--front", default="tcp://127.0.0.1:5555")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true",
                    help="sample the worker with py-spy (--gil --threads) during each run")
    ap.add_argument("--tiny", action="store_true", help="a tiny network (to check this on a CPU)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if not (args.model / "model.safetensors").is_file():
        subprocess.run([sys.executable, str(HERE / "random_model.py"), str(args.model)]
                       + (["--tiny"] if args.tiny else []), check=True)
    final = final_tokens(args)
    pool_blocks = int(final * args.pool_share) // BLOCK
    print(f"conversations end with about {final:,} tokens; KV pool {pool_blocks} blocks "
          f"({pool_blocks * BLOCK:,} tokens)", flush=True)
    docs = {}
    for name in args.modes.split(","):
        flags, mode = MODES[name]
        out = args.out / folder(name)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "service.log", "w") as log:
            proc, urls = start_service(args, pool_blocks, flags, log)
            spy = profile_worker(out) if args.profile else None
            try:
                docs[name] = bench(args, mode, name, out)
                if spy is not None:
                    spy.send_signal(signal.SIGINT)  # py-spy writes its profile on SIGINT
                    spy.wait(timeout=120)
                for role, url in urls:  # the service's own view: queue waits, steps, tiers
                    with urllib.request.urlopen(url, timeout=10) as r:
                        (out / f"{role}_metrics.txt").write_bytes(r.read())
            finally:
                stop_service(proc)
    subprocess.run(CLI + ["bench", "--compare",
                          *(str(args.out / folder(n) / "results.json") for n in docs),
                          "--out", str(args.out)], check=True)
    write_report(args, docs, final, pool_blocks)


def write_report(args, docs: dict, final: int, pool_blocks: int) -> None:
    s = {name: doc["summary"] for name, doc in docs.items()}
    lines = [
        "# Multi-turn chat through the service: sessions, host-RAM tier, resends",
        "",
        f"`turbomq up` (broker + one worker, {args.in_flight} slots) on a Llama-3-8B-shaped model "
        f"(random bf16 weights, bf16 KV), driven by `turbomq bench`: {args.conversations} "
        f"conversations x {args.turns} turns opening with one {args.system_len}-token system "
        f"prompt, user turns around {args.user_len} tokens, replies around {args.output_len} "
        f"(log-normal, sigma {args.output_sigma:g}), "
        f"think time {args.think_time:g} s mean, at most {args.in_flight} turns in flight; KV pool "
        f"{pool_blocks * BLOCK:,} tokens = {args.pool_share:.0%} of the ~{final:,} tokens the "
        "conversations end with. Each mode on a freshly started service, one run:",
        "`python benchmarks/gpu_service_multiturn.py --out DIR`.",
        "",
        "| mode | later-turn cache hit rate | later-turn TTFT p50 | p99 | first turns that "
        "reused nothing | output tok/s |",
        "| --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, x in s.items():
        lines.append(f"| {name} | {x['later_turns_cache_hit_rate']:.3f} "
                     f"| {x['median_ttft_later_turns_ms']:.1f} ms | {x['p99_ttft_later_turns_ms']:.1f} ms "
                     f"| {x['first_turns_without_reuse']} | {x['output_throughput']:,.0f} |")
    lines.append("")
    if "sessions + host tier" in s and "resend + host tier" in s:
        ratio = (s["resend + host tier"]["median_ttft_later_turns_ms"]
                 / s["sessions + host tier"]["median_ttft_later_turns_ms"])
        lines.append(f"- Resend vs sessions, later-turn TTFT p50: {ratio:.2f}x (target <= 1.2x).")
    if "sessions + host tier" in s:
        p99 = s["sessions + host tier"]["p99_ttft_later_turns_ms"]
        lines.append(f"- Sessions + host tier, later-turn TTFT p99: {p99:.1f} ms (target <= 150 ms).")
    lines.append("- The shared system prompt is prefilled by the first turns that reused nothing "
                 "(target: once per worker; one worker here).")
    lines += ["", "Side by side: [compare.md](compare.md); per mode: the folders beside it."]
    (args.out / "service_multiturn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
