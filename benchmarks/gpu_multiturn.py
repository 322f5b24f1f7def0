"""Multi-turn chat on one GPU, every way a client can send it, in one run:
a Llama-3-8B-shaped model (random bf16 weights), C conversations x T turns
that share a system prompt, all live at once (a conversation's next turn
queues behind every turn ready before it), K turns in flight, greedy, a KV
pool that holds about 65% of the conversations' final tokens.

Modes (each on a fresh engine, same workload):
- sessions without prefix cache: the engine before prefix caching (baseline);
- sessions: session ids, prefix caching;
- resend: no session id, the whole history sent every turn (OpenAI-style);
- sessions + host tier: sessions, prefix caching and the host-RAM KV tier.

Figures: later-turn hit rate (some history reused), later-turn TTFT p50/p99,
tokens prefilled, output tokens/s, and how often the shared system prompt
was prefilled.

    python benchmarks/gpu_multiturn.py --out DIR [--conversations 160 --turns 5]

Writes multiturn.md and multiturn.json into DIR (copy them to docs/benchmarks/);
with --trace also trace_MODE.json: every step (duration, decode rows, prefill
tokens, host-tier copies, queue length) and every turn (submitted, first
scheduled, first token, done), for finding where a turn's wait went."""

from __future__ import annotations

import argparse
import json
import queue
import random
from collections import deque
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_engine import LLAMA3_8B, random_tensors  # noqa: E402

from turbomq.worker import Engine, EngineConfig, SamplingParams  # noqa: E402
from turbomq.worker.model.config import ModelConfig  # noqa: E402
from turbomq.worker.model.llama import LlamaModel  # noqa: E402

BLOCK = 64
MODES = {
    "sessions without prefix cache": dict(session=True, prefix_caching=False, host_kv_blocks=0),
    "sessions": dict(session=True, prefix_caching=True, host_kv_blocks=0),
    "resend whole history": dict(session=False, prefix_caching=True, host_kv_blocks=0),
    "sessions + host tier": dict(session=True, prefix_caching=True, host_kv_blocks=None),
    "resend + host tier": dict(session=False, prefix_caching=True, host_kv_blocks=None),
}


@dataclass
class Conversation:
    index: int
    user_turns: list[list[int]]
    turn: int = 0
    history: list[int] = field(default_factory=list)  # what the model has seen and said


@dataclass
class TurnRecord:
    conversation: int
    turn: int
    submitted: float
    history: int = 0  # tokens of earlier turns in this turn's prompt
    first: float = 0.0
    done: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    generated: int = 0
    request_id: str = ""
    scheduled: float = 0.0  # start of the first step that ran it (--trace)


def cpu_tensors(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Random weights on the CPU (for --tiny checks of this script)."""
    from turbomq.worker.model.weights import internal_shapes
    g = torch.Generator().manual_seed(0)
    return {n: (torch.ones(s) if n.endswith("norm.weight") else torch.randn(*s, generator=g) * 0.02)
            for n, s in internal_shapes(cfg).items()}


def workload(args) -> tuple[list[int], list[list[list[int]]]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1000, 120000) for _ in range(args.system_tokens)]
    convs = [[[rng.randrange(1000, 120000) for _ in range(rng.randint(args.user_min, args.user_max))]
              for _ in range(args.turns)] for _ in range(args.conversations)]
    return system, convs


def run_mode(model, name: str, mode: dict, system, convs, args, pool_blocks: int) -> dict:
    config = EngineConfig(model="(random weights)", device=args.device, max_batch_size=args.in_flight,
                          block_size=BLOCK, num_kv_blocks=pool_blocks,
                          max_num_batched_tokens=args.step_tokens, max_model_len=8192,
                          prefix_caching=mode["prefix_caching"],
                          host_kv_blocks=(mode["host_kv_blocks"] if mode["host_kv_blocks"] == 0
                                          else args.host_kv_blocks))
    engine = Engine(config, model=model)
    params = SamplingParams(max_tokens=args.output_tokens, temperature=0.0, ignore_eos=True)
    # warm-up: decode graphs for the batch sizes ahead (tokens the workload never uses)
    engine.generate(input_ids=[[7] * 100] * args.in_flight, params=SamplingParams(max_tokens=4, temperature=0))
    steps: list[dict] = []
    first_step: dict[str, float] = {}
    if args.trace:
        def observe(plan, seconds: float) -> None:
            if plan is None:
                return
            now = time.perf_counter()
            for item in plan.scheduled:
                first_step.setdefault(item.seq.request_id, now - seconds)
            steps.append(dict(t=now, dur=seconds,
                              decode=sum(i.num_new_tokens == 1 for i in plan.scheduled),
                              prefill=sum(i.num_new_tokens for i in plan.scheduled
                                          if i.num_new_tokens > 1),
                              loads=len(plan.loads), spills=len(plan.spills),
                              preempted=len(plan.preempted),
                              waiting=len(engine.scheduler.waiting)))
        engine.step_observer = observe
    engine.start()
    done_q: "queue.Queue[TurnRecord]" = queue.Queue()
    pending = [Conversation(i, turns) for i, turns in enumerate(convs)]
    pending.reverse()
    records: list[TurnRecord] = []

    def submit(conv: Conversation) -> None:
        user = conv.user_turns[conv.turn]
        rec = TurnRecord(conv.index, conv.turn, time.perf_counter())
        if conv.turn == 0:
            conv.history = list(system)
        rec.history = len(conv.history) if conv.turn else 0
        conv.history += user  # everything the model has seen or said so far
        if mode["session"]:  # the session holds the history: send the new turn
            prompt, sid = (system + user if conv.turn == 0 else user), f"c{conv.index}"
        else:
            prompt, sid = list(conv.history), None
        tokens: list[int] = []

        def on_event(event) -> None:
            if event.token_ids and not rec.first:
                rec.first = time.perf_counter()
            tokens.extend(event.token_ids)
            if event.finished:
                rec.done = time.perf_counter()
                rec.prompt_tokens, rec.cached_tokens = (event.usage.prompt_tokens,
                                                        event.usage.cached_tokens)
                rec.generated = len(tokens)
                conv.history += tokens
                done_q.put((rec, conv))

        rec.request_id = engine.submit(input_ids=prompt, params=params, session_id=sid,
                                       callback=on_event)

    # Every conversation is live from the start: ready turns wait in one FIFO
    # and a conversation's next turn joins its back, so between two turns of
    # one conversation come about (conversations - in flight) others, and the
    # KV of all of them outgrows the pool.
    ready = deque(reversed(pending))
    start = time.perf_counter()
    live = 0
    while ready and live < args.in_flight:
        submit(ready.popleft())
        live += 1
    while live:
        rec, conv = done_q.get()
        records.append(rec)
        live -= 1
        conv.turn += 1
        if conv.turn < args.turns:
            ready.append(conv)
        if ready:
            submit(ready.popleft())
            live += 1
    wall = time.perf_counter() - start
    stats = engine.stats()
    engine.close()

    later = [r for r in records if r.turn > 0]
    if args.trace:
        t0 = start
        turns = [dict(conv=r.conversation, turn=r.turn, history=r.history, cached=r.cached_tokens,
                      prompt=r.prompt_tokens, submitted=r.submitted - t0,
                      scheduled=first_step.get(r.request_id, 0.0) - t0, first=r.first - t0,
                      done=r.done - t0) for r in records]
        for s in steps:
            s["t"] -= t0
        name_ = name.replace(" ", "_").replace("+", "")
        (args.out / f"trace_{name_}.json").write_text(json.dumps(dict(turns=turns, steps=steps)))
    ttft = np.array([(r.first - r.submitted) * 1e3 for r in later])
    # a hit: the whole history was reused (up to the partial last block, which
    # a resend recomputes, and the last generated token, which was never fed)
    hits = [r.cached_tokens >= r.history - BLOCK for r in later]
    sys_blocks = args.system_tokens // BLOCK * BLOCK
    return {
        "mode": name,
        "later_turn_hit_rate": float(np.mean(hits)),
        "later_turn_history_reused": sum(min(r.cached_tokens, r.history) for r in later)
                                     / max(sum(r.history for r in later), 1),
        "later_turn_ttft_ms_p50": float(np.percentile(ttft, 50)),
        "later_turn_ttft_ms_p99": float(np.percentile(ttft, 99)),
        "first_turn_ttft_ms_p50": float(np.percentile(
            [(r.first - r.submitted) * 1e3 for r in records if r.turn == 0], 50)),
        "tokens_prefilled": int(sum(r.prompt_tokens - r.cached_tokens for r in records)),
        "output_tok_per_s": sum(r.generated for r in records) / wall,
        "system_prompt_prefills": sum(r.turn == 0 and r.cached_tokens < sys_blocks for r in records),
        "wall_s": wall,
        "evictions": stats["evictions"],
        "host_tier_loaded_blocks": stats.get("host_tier_loaded_blocks", 0),
        "host_tier_blocks": stats.get("host_tier_blocks_total", 0),
        "host_tier_stored_blocks": stats.get("host_tier_stored_blocks", 0),
        "prefix_cache_evictions": stats.get("prefix_cache_evictions", 0),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("build/gpu-results"))
    ap.add_argument("--conversations", type=int, default=160)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--in-flight", type=int, default=64)
    ap.add_argument("--system-tokens", type=int, default=256)
    ap.add_argument("--user-min", type=int, default=300)
    ap.add_argument("--user-max", type=int, default=500)
    ap.add_argument("--output-tokens", type=int, default=80)
    ap.add_argument("--pool-share", type=float, default=0.65)
    ap.add_argument("--step-tokens", type=int, default=8192, help="max_num_batched_tokens")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--host-kv-blocks", type=int, default=None,
                    help="host tier size in the host-tier modes (default: the engine's)")
    ap.add_argument("--trace", action="store_true",
                    help="also write every step and turn's timings (trace_MODE.json)")
    ap.add_argument("--tiny", action="store_true", help="a tiny model, to check the script on a CPU")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    system, convs = workload(args)
    final_tokens = sum(args.system_tokens + sum(len(u) for u in c) + args.turns * args.output_tokens
                       for c in convs)
    pool_blocks = int(final_tokens * args.pool_share) // BLOCK
    shape = LLAMA3_8B
    if args.tiny:
        shape = ModelConfig(vocab_size=128256, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, torch_dtype="float32")
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    weights = random_tensors(shape) if args.device == "cuda" else cpu_tensors(shape)
    model = LlamaModel(shape, weights, args.device, dtype)
    results = {"device": torch.cuda.get_device_name() if args.device == "cuda" else args.device, "conversations": args.conversations,
               "turns": args.turns, "in_flight": args.in_flight,
               "final_tokens": final_tokens, "pool_tokens": pool_blocks * BLOCK, "modes": []}
    for name in args.modes.split(","):
        r = run_mode(model, name, MODES[name], system, convs, args, pool_blocks)
        print(json.dumps(r), flush=True)
        results["modes"].append(r)
    (args.out / "multiturn.json").write_text(json.dumps(results, indent=2) + "\n")
    by = {r["mode"]: r for r in results["modes"]}
    lines = [
        "# Multi-turn chat: sessions, whole-history resends, prefix cache, host-RAM tier",
        "",
        f"{results['device']}; Llama-3-8B shape, random bf16 weights, bf16 KV; "
        f"{args.conversations} conversations x {args.turns} turns sharing a "
        f"{args.system_tokens}-token system prompt (user turns {args.user_min}-{args.user_max} "
        f"tokens, {args.output_tokens} generated, greedy), {args.in_flight} turns in flight; "
        f"KV pool {results['pool_tokens']:,} tokens = {args.pool_share:.0%} of the "
        f"{final_tokens:,} tokens the conversations end with. In-process engine, one run:",
        "`python benchmarks/gpu_multiturn.py --out DIR`.",
        "",
        "| mode | later-turn hits | history reused | later-turn TTFT p50 | p99 | tokens prefilled | out tok/s | system prompt prefilled | host-tier blocks loaded |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in results["modes"]:
        lines.append(f"| {r['mode']} | {r['later_turn_hit_rate']:.1%} | {r['later_turn_history_reused']:.1%} "
                     f"| {r['later_turn_ttft_ms_p50']:.0f} ms "
                     f"| {r['later_turn_ttft_ms_p99']:.0f} ms | {r['tokens_prefilled']:,} "
                     f"| {r['output_tok_per_s']:,.0f} | {r['system_prompt_prefills']} "
                     f"| {r['host_tier_loaded_blocks']:,} |")
    if "sessions" in by and "resend whole history" in by:
        ratio = by["resend whole history"]["later_turn_ttft_ms_p50"] / by["sessions"]["later_turn_ttft_ms_p50"]
        lines += ["", f"Resend vs sessions, later-turn TTFT p50: {ratio:.2f}x (target <= 1.2x)."]
    lines += ["", "A later turn is a hit when its whole history was reused (a resend "
              "recomputes the partial last block). Tokens prefilled count every turn's."]
    if "sessions + host tier" in by:
        lines.append(f"Sessions + host tier, later-turn TTFT p99: "
                     f"{by['sessions + host tier']['later_turn_ttft_ms_p99']:.0f} ms (target <= 150 ms).")
    (args.out / "multiturn.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
