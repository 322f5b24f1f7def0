"""turbomq.clients.bench: `turbomq bench`, a serving benchmark a user aims
at any turbomq broker or OpenAI-compatible server (docs/bench.md).

Workloads (ShareGPT-like synthetic lengths, a ShareGPT file, fixed lengths,
multi-turn conversations as sessions or full-history resends) at a request
rate and a concurrency cap; figures named and computed as `vllm bench
serve` does (throughput, TTFT, TPOT, ITL, E2EL, goodput; cache hit rate for
multi-turn); a terminal table, JSON and PNG plots.

Needs turbomq's [bench] extra (httpx, tqdm, matplotlib); importing
turbomq.clients never imports it, and this package imports its modules only
as a run needs them."""
