"""Host-side cost of one engine step at 256 concurrent sequences, model
compute excluded: scheduling, KV manager calls, block tables, the step's
attention metadata, and committing the sampled tokens.

    .venv/bin/python benchmarks/scheduler_bench.py

Prints a table and writes docs/benchmarks/scheduler.{md,json}. Target: <= 1 ms per step."""

from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

from turbomq._native import KVCacheManager
from turbomq.worker.model.ops import AttentionBatch
from turbomq.worker.engine.sampling_params import SamplingParams
from turbomq.worker.engine.scheduler import Scheduler, SchedulerConfig, Sequence

OUT = Path(__file__).resolve().parent.parent / "docs" / "benchmarks"
BLOCK = 64


def host_step(sched: Scheduler, manager: KVCacheManager) -> int:
    plan = sched.schedule()
    q_lens, ctx_lens, keys, ids = [], [], [], []
    for item in plan.scheduled:
        seq = item.seq
        ids.extend(seq.tokens[seq.num_computed:seq.num_computed + item.num_new_tokens])
        q_lens.append(item.num_new_tokens)
        ctx_lens.append(seq.num_computed + item.num_new_tokens)
        keys.append(seq.kv_key)
    width = (max(ctx_lens) + BLOCK - 1) // BLOCK
    tables = manager.block_tables(keys, width)
    AttentionBatch.build(q_lens, ctx_lens, tables, BLOCK)
    sampling = [item.seq for item in plan.scheduled if item.samples]
    sched.commit(plan)
    for seq in sampling:
        sched.deliver(seq, 7)
    return len(plan.scheduled)


def run(num_seqs: int, prompt_len: int, steps: int) -> dict:
    manager = KVCacheManager(num_seqs * 16, BLOCK)
    sched = Scheduler(SchedulerConfig(max_batch_size=num_seqs, max_num_batched_tokens=1 << 20,
                                      max_model_len=1 << 20, block_size=BLOCK), manager)
    params = SamplingParams(max_tokens=1 << 20, temperature=0.0)
    for i in range(num_seqs):
        sched.add(Sequence(request_id=str(i), kv_key=i + 1, session_id=None,
                           tokens=list(range(prompt_len)), prompt_len=prompt_len, params=params))
    host_step(sched, manager)  # prefill everything; afterwards every step is pure decode
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        n = host_step(sched, manager)
        times.append(time.perf_counter() - t0)
        assert n == num_seqs
    manager.check()
    times.sort()
    return {"sequences": num_seqs, "prompt_len": prompt_len, "steps": steps,
            "mean_ms": statistics.fmean(times) * 1e3, "p50_ms": times[len(times) // 2] * 1e3,
            "p99_ms": times[int(len(times) * 0.99)] * 1e3}


def main() -> None:
    rows = [run(n, 512, 500) for n in (1, 32, 256)]
    header = "| sequences | mean ms/step | p50 ms | p99 ms |\n|---:|---:|---:|---:|\n"
    table = header + "".join(f"| {r['sequences']} | {r['mean_ms']:.3f} | {r['p50_ms']:.3f} | "
                             f"{r['p99_ms']:.3f} |\n" for r in rows)
    print(table)
    OUT.mkdir(parents=True, exist_ok=True)
    meta = {"machine": platform.processor() or platform.machine(), "python": platform.python_version()}
    (OUT / "scheduler.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    (OUT / "scheduler.md").write_text(
        "# Scheduler + KV manager bookkeeping per decode step\n\n"
        "Host work of one step, model compute excluded: `Scheduler.schedule()` (KV manager\n"
        "`reserve` per sequence), block tables, `AttentionBatch.build`, `Scheduler.commit`.\n"
        "Decode steps after a 512-token prompt; 500 steps each.\n"
        "Command: `.venv/bin/python benchmarks/scheduler_bench.py`. Target: <= 1 ms at 256.\n\n"
        + table)


if __name__ == "__main__":
    main()
