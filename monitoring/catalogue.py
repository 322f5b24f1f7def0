"""Every metric turbomq exports: name, type, unit, labels, help, buckets.

The broker and the workers create metrics only from these specs (see
metrics.py), and dashboards may use only these names. docs/metrics.md is the
same table in prose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

COUNTER, GAUGE, HISTOGRAM, INFO = "counter", "gauge", "histogram", "info"

# Buckets span a GPU (milliseconds) and the CPU backend (seconds) in one set,
# so one dashboard reads both.
TTFT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.5, 5.0, 10.0)
REQUEST_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 300.0, 600.0)
QUEUE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
STORE_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BATCH_SEQ_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)

WORKER_INFO_KEYS = ("model", "kv_dtype", "dtype", "device", "version")


@dataclass(frozen=True)
class MetricSpec:
    attr: str                     # attribute on WorkerMetrics / BrokerMetrics
    name: str                     # full exposed family name
    type: str                     # counter | gauge | histogram | info
    unit: str                     # base unit, or what is counted
    help: str
    labels: tuple[str, ...] = ()  # beyond `worker`, which every worker metric has
    label_values: tuple[tuple[str, tuple[str, ...]], ...] = ()  # known values, for docs/tests
    buckets: Optional[tuple[float, ...]] = None
    component: str = "worker"

    @property
    def all_labels(self) -> tuple[str, ...]:
        return (("worker",) if self.component == "worker" else ()) + self.labels

    def series(self) -> tuple[str, ...]:
        """The sample names this family exposes (what PromQL sees)."""
        if self.type == HISTOGRAM:
            return tuple(self.name + s for s in ("_bucket", "_sum", "_count"))
        return (self.name,)


def _w(attr, name, type_, unit, help_, **kw) -> MetricSpec:
    return MetricSpec(attr, name, type_, unit, help_, component="worker", **kw)


def _b(attr, name, type_, unit, help_, **kw) -> MetricSpec:
    return MetricSpec(attr, name, type_, unit, help_, component="broker", **kw)


FINISH_REASONS = ("stop", "length", "cancelled", "error")
SESSION_STATES = ("active", "cached", "evicted")
STORE_OPS = ("get_tokens", "append_tokens", "drop", "set_holder", "metadata", "ping")

WORKER_METRICS: tuple[MetricSpec, ...] = (
    _w("info", "turbomq_worker_info", INFO, "",
       "Static facts about the worker: model, KV cache dtype, compute dtype, device, version.",
       labels=WORKER_INFO_KEYS),
    # capacity and occupancy
    _w("slots_total", "turbomq_batch_slots", GAUGE, "slots",
       "Slots of the persistent batch (most sequences computed per step)."),
    _w("slots_active", "turbomq_batch_slots_active", GAUGE, "slots",
       "Slots holding a running sequence."),
    _w("kv_blocks_total", "turbomq_kv_blocks", GAUGE, "blocks", "KV cache blocks in the pool."),
    _w("kv_blocks_used", "turbomq_kv_blocks_used", GAUGE, "blocks",
       "KV cache blocks owned by active or cached sessions."),
    _w("sessions", "turbomq_sessions", GAUGE, "sessions",
       "Sessions known to the KV cache manager, by state: active (in a slot), cached "
       "(KV resident, no slot), evicted (KV dropped, token IDs kept in the session store).",
       labels=("state",), label_values=(("state", SESSION_STATES),)),
    _w("requests_waiting", "turbomq_requests_waiting", GAUGE, "requests",
       "Requests queued in the engine, waiting for a slot or KV blocks."),
    _w("requests_running", "turbomq_requests_running", GAUGE, "requests",
       "Requests in the persistent batch."),
    # KV cache behaviour
    _w("evictions", "turbomq_kv_evictions_total", COUNTER, "sessions",
       "Cached sessions whose KV was evicted (least recently used first) to free blocks."),
    _w("evicted_tokens", "turbomq_kv_evicted_tokens_total", COUNTER, "tokens",
       "Tokens of KV dropped by evictions."),
    _w("preemptions", "turbomq_preemptions_total", COUNTER, "requests",
       "Running requests pushed back to the queue because KV blocks ran out."),
    _w("cache_hits", "turbomq_session_cache_hits_total", COUNTER, "requests",
       "Session requests whose history KV was resident (only new tokens prefilled)."),
    _w("cache_misses", "turbomq_session_cache_misses_total", COUNTER, "requests",
       "Session requests whose history KV was not resident (history re-prefilled)."),
    _w("reprefilled_tokens", "turbomq_reprefilled_tokens_total", COUNTER, "tokens",
       "History tokens prefilled again because their KV was evicted or held elsewhere."),
    _w("prefix_cache_queries", "turbomq_prefix_cache_queries_total", COUNTER, "requests",
       "Requests admitted without resident KV that looked up their prompt's blocks by name."),
    _w("prefix_cache_hit_blocks", "turbomq_prefix_cache_hit_blocks_total", COUNTER, "blocks",
       "KV blocks those lookups found in the pool and reused instead of prefilling."),
    _w("prefix_cache_blocks", "turbomq_prefix_cache_blocks", GAUGE, "blocks",
       "Full KV blocks named by their content (reusable by any request with that prefix)."),
    _w("prefix_cache_free_blocks", "turbomq_prefix_cache_free_blocks", GAUGE, "blocks",
       "Named blocks no request holds: cached, reused or overwritten in LRU order."),
    _w("prefix_cache_evictions", "turbomq_prefix_cache_evictions_total", COUNTER, "blocks",
       "Cached free blocks given new content because the pool had no unnamed free block."),
    _w("host_tier_blocks_total", "turbomq_kv_host_blocks", GAUGE, "blocks",
       "Blocks of the host-RAM KV tier (0: no tier)."),
    _w("host_tier_blocks_used", "turbomq_kv_host_blocks_used", GAUGE, "blocks",
       "Host-RAM tier blocks holding a named KV block."),
    _w("host_tier_stored_blocks", "turbomq_kv_host_stored_blocks_total", COUNTER, "blocks",
       "Named blocks copied to host RAM before the GPU pool reused their memory."),
    _w("host_tier_loaded_blocks", "turbomq_kv_host_loaded_blocks_total", COUNTER, "blocks",
       "Blocks a prompt found in host RAM and loaded back instead of prefilling (host-tier hits)."),
    _w("host_tier_bytes", "turbomq_kv_host_bytes_total", COUNTER, "bytes",
       "Bytes copied between the GPU pool and the host-RAM tier, both ways."),
    # tokens and requests
    _w("prompt_tokens", "turbomq_prompt_tokens_total", COUNTER, "tokens",
       "Prompt tokens of finished requests."),
    _w("generated_tokens", "turbomq_generated_tokens_total", COUNTER, "tokens",
       "Tokens generated."),
    _w("reused_tokens", "turbomq_reused_tokens_total", COUNTER, "tokens",
       "Prompt tokens served from resident KV instead of being prefilled."),
    _w("requests_finished", "turbomq_requests_finished_total", COUNTER, "requests",
       "Finished requests by finish reason.",
       labels=("reason",), label_values=(("reason", FINISH_REASONS),)),
    # latency and batch shape
    _w("ttft", "turbomq_time_to_first_token_seconds", HISTOGRAM, "seconds",
       "From a request's arrival at the worker to its first generated token.",
       buckets=TTFT_BUCKETS),
    _w("itl", "turbomq_inter_token_latency_seconds", HISTOGRAM, "seconds",
       "Between consecutive generated tokens of one request.", buckets=TOKEN_BUCKETS),
    _w("request_duration", "turbomq_request_duration_seconds", HISTOGRAM, "seconds",
       "End to end at the worker: arrival to final message.", buckets=REQUEST_BUCKETS),
    _w("queue_wait", "turbomq_queue_wait_seconds", HISTOGRAM, "seconds",
       "From arrival to joining the persistent batch.", buckets=QUEUE_BUCKETS),
    _w("step_duration", "turbomq_step_duration_seconds", HISTOGRAM, "seconds",
       "One engine step (one forward over the active slots).", buckets=TOKEN_BUCKETS),
    _w("step_tokens", "turbomq_step_batch_tokens", HISTOGRAM, "tokens",
       "Tokens computed per step (prefill chunks plus decode tokens).",
       buckets=BATCH_TOKEN_BUCKETS),
    _w("step_sequences", "turbomq_step_batch_sequences", HISTOGRAM, "sequences",
       "Sequences computed per step.", buckets=BATCH_SEQ_BUCKETS),
    # broker links
    _w("broker_reconnects", "turbomq_worker_broker_reconnects_total", COUNTER, "connections",
       "Times the worker gave up on a broker (silent past its liveness, or told to "
       "reconnect: it restarted) and registered again, abandoning that broker's requests."),
    # session store
    _w("store_duration", "turbomq_session_store_duration_seconds", HISTOGRAM, "seconds",
       "Session store (Redis) call latency, failed calls included.",
       labels=("op",), label_values=(("op", STORE_OPS),), buckets=STORE_BUCKETS),
    _w("store_errors", "turbomq_session_store_errors_total", COUNTER, "errors",
       "Session store calls that failed (Redis down, timeout, error reply).",
       labels=("op",), label_values=(("op", STORE_OPS),)),
)

REQUEST_OUTCOMES = ("completed", "error", "cancelled", "rejected", "timeout")
ROUTING_DECISIONS = ("affinity", "moved", "new", "prefix", "stateless")
FRAME_REJECT_REASONS = ("malformed", "unknown_type", "bad_version", "too_large", "invalid")

BROKER_METRICS: tuple[MetricSpec, ...] = (
    _b("requests", "turbomq_broker_requests_total", COUNTER, "requests",
       "Client requests by outcome.",
       labels=("outcome",), label_values=(("outcome", REQUEST_OUTCOMES),)),
    _b("tenant_requests", "turbomq_broker_tenant_requests_total", COUNTER, "requests",
       "Client requests by tenant (the client key's name on the allow-list; `plain` without "
       "CURVE) and outcome; rejected includes rate_limited.",
       labels=("tenant", "outcome")),  # tenants are known only as they come
    _b("requests_in_flight", "turbomq_broker_requests_in_flight", GAUGE, "requests",
       "Requests dispatched to a worker and not yet finished."),
    _b("queue_depth", "turbomq_broker_queue_depth", GAUGE, "requests",
       "Requests waiting in the broker for a worker with free capacity."),
    _b("workers_alive", "turbomq_broker_workers_alive", GAUGE, "workers",
       "Workers whose heartbeats are current."),
    _b("routing_decisions", "turbomq_broker_routing_decisions_total", COUNTER, "requests",
       "Dispatch decisions: affinity (to the worker holding the session's KV), moved "
       "(session sent to another worker, KV rebuilt there), new (a session's first turn), "
       "prefix (no session: to the worker its leading prompt hashes to, which likely holds "
       "its prefix in cache), stateless (no session: elsewhere, that worker being full or "
       "over its load bound, or prefix routing off).",
       labels=("decision",), label_values=(("decision", ROUTING_DECISIONS),)),
    _b("redispatches", "turbomq_broker_redispatches_total", COUNTER, "requests",
       "Requests sent again to another worker after their worker was lost."),
    _b("resumed_requests", "turbomq_broker_resumed_requests_total", COUNTER, "requests",
       "Requests a client sent again with the tokens it already had (resume_tokens), "
       "after losing the broker that held them."),
    _b("queue_wait", "turbomq_broker_queue_wait_seconds", HISTOGRAM, "seconds",
       "Time a request waited in the broker's queue for a worker (every dispatch that "
       "waited: no free slot, no worker connected, or its worker lost).",
       buckets=QUEUE_BUCKETS),
    _b("frames_rejected", "turbomq_broker_frames_rejected_total", COUNTER, "frames",
       "Frames refused before routing, by reason.",
       labels=("reason",), label_values=(("reason", FRAME_REJECT_REASONS),)),
    _b("request_duration", "turbomq_broker_request_duration_seconds", HISTOGRAM, "seconds",
       "End to end at the broker: client request in to final message out.",
       buckets=REQUEST_BUCKETS),
)


GATEWAY_ENDPOINTS = ("completions", "chat_completions", "models")
# HTTP statuses the gateway answers with (docs/gateway.md); 499: the client
# went away before the end (its request was cancelled on the worker).
GATEWAY_STATUSES = ("200", "400", "401", "404", "409", "429", "499", "500", "503", "504")
GATEWAY_TOKEN_KINDS = ("prompt", "cached", "completion")


def _g(attr, name, type_, unit, help_, **kw) -> MetricSpec:
    return MetricSpec(attr, name, type_, unit, help_, component="gateway", **kw)


GATEWAY_METRICS: tuple[MetricSpec, ...] = (
    _g("requests", "turbomq_gateway_requests_total", COUNTER, "requests",
       "HTTP API requests by endpoint and status (499: the client disconnected first).",
       labels=("endpoint", "status"),
       label_values=(("endpoint", GATEWAY_ENDPOINTS), ("status", GATEWAY_STATUSES))),
    _g("requests_in_flight", "turbomq_gateway_requests_in_flight", GAUGE, "requests",
       "Generation requests the gateway is serving (streams included)."),
    _g("ttft", "turbomq_gateway_time_to_first_token_seconds", HISTOGRAM, "seconds",
       "From a streamed request's arrival at the gateway to its first text chunk.",
       buckets=TTFT_BUCKETS),
    _g("request_duration", "turbomq_gateway_request_duration_seconds", HISTOGRAM, "seconds",
       "End to end at the gateway: request in to its last byte out.", buckets=REQUEST_BUCKETS),
    _g("tokens", "turbomq_gateway_tokens_total", COUNTER, "tokens",
       "Tokens of finished requests by kind: prompt, cached (of the prompt, served from "
       "resident KV), completion.",
       labels=("kind",), label_values=(("kind", GATEWAY_TOKEN_KINDS),)),
    _g("disconnects", "turbomq_gateway_client_disconnects_total", COUNTER, "requests",
       "Requests whose HTTP client went away before the end; each was cancelled on its worker."),
)


def catalogue() -> list[MetricSpec]:
    """Every metric family (each has .name and .type): workers', broker's, gateway's."""
    return list(WORKER_METRICS + BROKER_METRICS + GATEWAY_METRICS)


def series_names() -> set[str]:
    """Every sample name PromQL can see (histograms add _bucket/_sum/_count)."""
    return {s for spec in catalogue() for s in spec.series()}
