"""Metric objects built from the catalogue, one set per process registry.

Each process creates its own CollectorRegistry (never the global default), so
two workers in one process or on one host never share or collide.
"""

from __future__ import annotations

import itertools
from typing import Mapping

from prometheus_client import (CollectorRegistry, Counter, Gauge, Histogram, Info,
                               disable_created_metrics)

from .catalogue import (BROKER_METRICS, COUNTER, GATEWAY_METRICS, GAUGE, HISTOGRAM, INFO,
                        WORKER_INFO_KEYS, WORKER_METRICS, MetricSpec)


def _make(spec: MetricSpec, registry: CollectorRegistry, **bound: str):
    """Create the metric; with known label values, create every child at 0 so
    rate() and absent-series checks work before the first event."""
    # `_created` series would be names outside the catalogue; a turbomq process
    # exports nothing else, so turning them off process-wide is safe.
    disable_created_metrics()
    metric = _new(spec, registry)
    if spec.label_values and spec.type != INFO:
        names = [name for name, _ in spec.label_values]
        for values in itertools.product(*(vals for _, vals in spec.label_values)):
            metric.labels(**bound, **dict(zip(names, values)))
    return metric


def _new(spec: MetricSpec, registry: CollectorRegistry):
    # prometheus-client adds `_total` / `_info` itself; the catalogue keeps full names.
    labels = spec.all_labels
    if spec.type == COUNTER:
        return Counter(spec.name.removesuffix("_total"), spec.help, labels, registry=registry)
    if spec.type == GAUGE:
        return Gauge(spec.name, spec.help, labels, registry=registry)
    if spec.type == HISTOGRAM:
        return Histogram(spec.name, spec.help, labels, registry=registry, buckets=spec.buckets)
    if spec.type == INFO:  # the info keys are the value, not label names
        return Info(spec.name.removesuffix("_info"), spec.help,
                    [l for l in labels if l not in spec.labels], registry=registry)
    raise ValueError(f"unknown metric type {spec.type!r} for {spec.name}")


class _WorkerBound:
    """A worker metric with extra labels: `.labels(reason="stop")` fills in
    the worker label."""

    def __init__(self, metric, worker_id: str) -> None:
        self.metric = metric
        self.worker_id = worker_id

    def labels(self, **labels):
        return self.metric.labels(worker=self.worker_id, **labels)


class WorkerMetrics:
    """Every worker metric, already bound to this worker's `worker` label.

    Metrics whose only label is `worker` are children ready to use
    (`m.ttft.observe(0.2)`, `m.slots_active.set(3)`); those with more labels
    take them through `.labels(...)` (`m.requests_finished.labels(reason="stop").inc()`).
    Attribute names are the catalogue's `attr` fields.
    """

    # engine.stats() key -> (attribute, kind); counters there are cumulative.
    _STATS_GAUGES = {"slots_total": "slots_total", "slots_active": "slots_active",
                     "kv_blocks_total": "kv_blocks_total", "kv_blocks_used": "kv_blocks_used",
                     "waiting": "requests_waiting",
                     "prefix_cache_blocks": "prefix_cache_blocks",
                     "prefix_cache_free_blocks": "prefix_cache_free_blocks",
                     "host_tier_blocks_total": "host_tier_blocks_total",
                     "host_tier_blocks_used": "host_tier_blocks_used"}
    _STATS_COUNTERS = {"evictions": "evictions", "evicted_tokens": "evicted_tokens",
                       "preemptions": "preemptions", "cache_hits": "cache_hits",
                       "cache_misses": "cache_misses", "prompt_tokens": "prompt_tokens",
                       "generated_tokens": "generated_tokens", "reused_tokens": "reused_tokens",
                       "reprefilled_tokens": "reprefilled_tokens",
                       "prefix_cache_queries": "prefix_cache_queries",
                       "prefix_cache_hit_blocks": "prefix_cache_hit_blocks",
                       "prefix_cache_evictions": "prefix_cache_evictions",
                       "host_tier_stored_blocks": "host_tier_stored_blocks",
                       "host_tier_loaded_blocks": "host_tier_loaded_blocks",
                       "host_tier_bytes": "host_tier_bytes"}

    def __init__(self, registry: CollectorRegistry, worker_id: str) -> None:
        if not worker_id:
            raise ValueError("worker_id must be a non-empty string")
        self.registry = registry
        self.worker_id = worker_id
        self.families = {}
        for spec in WORKER_METRICS:
            metric = _make(spec, registry, worker=worker_id)
            self.families[spec.attr] = metric
            if spec.type == INFO or not spec.labels:
                setattr(self, spec.attr, metric.labels(worker=worker_id))
            else:
                setattr(self, spec.attr, _WorkerBound(metric, worker_id))
        self._last_counts: dict[str, float] = {}

    def set_info(self, **info: str) -> None:
        unknown = set(info) - set(WORKER_INFO_KEYS)
        if unknown:
            raise ValueError(f"unknown worker info keys {sorted(unknown)}; known: {WORKER_INFO_KEYS}")
        self.info.info({k: str(v) for k, v in info.items()})

    def observe_store(self, op: str, seconds: float, ok: bool) -> None:
        """Plugs into RedisSessionStore.observe."""
        self.store_duration.labels(op=op).observe(seconds)
        if not ok:
            self.store_errors.labels(op=op).inc()

    def sync_engine_stats(self, stats: Mapping[str, float]) -> None:
        """Copy Engine.stats() into the gauges, and its cumulative counts into
        the counters (by difference since the previous call)."""
        for key, attr in self._STATS_GAUGES.items():
            if key in stats:
                getattr(self, attr).set(stats[key])
        if "slots_active" in stats:
            self.requests_running.set(stats["slots_active"])
        for state in ("active", "cached", "evicted"):
            key = f"sessions_{state}"
            if key in stats:
                self.sessions.labels(state=state).set(stats[key])
        for key, attr in self._STATS_COUNTERS.items():
            if key not in stats:
                continue
            delta = stats[key] - self._last_counts.get(key, 0)
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_counts[key] = stats[key]


class _CatalogueMetrics:
    """Every metric of one catalogue list (no worker label), registered in
    `registry`; attribute names are the catalogue's `attr` fields."""

    SPECS: tuple[MetricSpec, ...] = ()

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        for spec in self.SPECS:
            setattr(self, spec.attr, _make(spec, registry))


class BrokerMetrics(_CatalogueMetrics):
    """Every broker metric."""

    SPECS = BROKER_METRICS


class GatewayMetrics(_CatalogueMetrics):
    """Every gateway metric."""

    SPECS = GATEWAY_METRICS
