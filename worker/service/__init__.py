"""turbomq.worker.service: one engine served to the broker.

The service loop (`loop`: WorkerConfig, WorkerService, run_worker) turns
protocol frames into engine requests and engine events into frames; the
broker link (`link`) owns the socket, registration and heartbeats; the
Redis session store (`redis_store`, `store_guard`) mirrors every session's
token IDs so any worker can rebuild it."""
