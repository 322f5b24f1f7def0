"""The metric catalogue: naming rules, exposure over real HTTP, one registry
and one port per process, and a real Prometheus scraping it."""

from __future__ import annotations

import itertools
import re
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from turbomq.monitoring import (BROKER_METRICS, COUNTER, GATEWAY_METRICS, GAUGE, HISTOGRAM, INFO,
                                WORKER_METRICS, BrokerMetrics, GatewayMetrics, WorkerMetrics,
                                catalogue, serve_metrics, series_names)
from turbomq.worker.service.redis_store import RedisSessionStore
from turbomq.worker.engine.session_store import SessionStoreError

NAME = re.compile(r"^turbomq_[a-z0-9]+(_[a-z0-9]+)*$")
LABEL = re.compile(r"^[a-z][a-z0-9_]*$")
# Non-base units Prometheus naming forbids (use seconds and bytes).
BAD_UNITS = ("_ms", "_milliseconds", "_microseconds", "_us", "_ns", "_minutes", "_hours",
             "_kb", "_mb", "_gb", "_kib", "_mib", "_gib", "_percent")


def fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
        return r.read().decode()


def samples(text: str) -> dict[str, list]:
    """sample name -> samples, from exposition text."""
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append(s)
    return out


def touch_all(metrics, specs) -> None:
    for spec in specs:
        if spec.type == INFO:
            metrics.set_info(model="tiny", kv_dtype="int8", dtype="fp16", device="cpu", version="0")
            continue
        metric = getattr(metrics, spec.attr)
        if spec.labels:
            declared = dict(spec.label_values)
            # A label with an open set of values (a tenant) takes any one.
            values = {name: declared[name][0] if name in declared else "t" for name in spec.labels}
            metric = metric.labels(**values)
        {COUNTER: lambda m: m.inc(), GAUGE: lambda m: m.set(2),
         HISTOGRAM: lambda m: m.observe(0.3)}[spec.type](metric)


def test_naming_rules():
    names = [spec.name for spec in catalogue()]
    assert len(names) == len(set(names)), "duplicate metric names"
    assert len({s.attr for s in WORKER_METRICS}) == len(WORKER_METRICS)
    assert len({s.attr for s in BROKER_METRICS}) == len(BROKER_METRICS)
    exposed = series_names()
    for spec in catalogue():
        assert NAME.match(spec.name), spec.name
        assert spec.help and spec.help.strip() == spec.help, spec.name
        assert spec.type in (COUNTER, GAUGE, HISTOGRAM, INFO), spec.name
        assert (spec.type == COUNTER) == spec.name.endswith("_total"), spec.name
        assert (spec.type == INFO) == spec.name.endswith("_info"), spec.name
        assert not spec.name.endswith(("_bucket", "_sum", "_count", "_created")), spec.name
        assert not any(part in spec.name + "_" for part in (u + "_" for u in BAD_UNITS)), spec.name
        stem = spec.name.removesuffix("_total")
        if spec.unit in ("seconds", "bytes"):
            assert stem.endswith("_" + spec.unit), spec.name
        if stem.endswith(("_seconds", "_bytes")):
            assert stem.endswith("_" + spec.unit), spec.name
        assert (spec.buckets is not None) == (spec.type == HISTOGRAM), spec.name
        if spec.buckets:
            assert list(spec.buckets) == sorted(set(spec.buckets)), spec.name
        for label in spec.all_labels:
            assert LABEL.match(label) and label not in ("le", "quantile", "job", "instance"), label
        assert dict(spec.label_values).keys() <= set(spec.labels), spec.name
        # No family's samples collide with another family's name.
        for other in catalogue():
            if other is not spec:
                assert not set(spec.series()) & set(other.series()), (spec.name, other.name)
        assert set(spec.series()) <= exposed
    assert all(s.component == "worker" and s.all_labels[0] == "worker" for s in WORKER_METRICS)
    assert all(s.component == "broker" and s.name.startswith("turbomq_broker_")
               for s in BROKER_METRICS)
    assert not any(s.name.startswith("turbomq_broker_") for s in WORKER_METRICS)
    assert all(s.component == "gateway" and s.name.startswith("turbomq_gateway_")
               for s in GATEWAY_METRICS)
    assert len({s.attr for s in GATEWAY_METRICS}) == len(GATEWAY_METRICS)
    assert not any(s.name.startswith("turbomq_gateway_") for s in WORKER_METRICS + BROKER_METRICS)


@pytest.mark.parametrize("component", ["worker", "broker", "gateway"])
def test_every_metric_is_served(component):
    registry = CollectorRegistry()
    if component == "worker":
        metrics, specs = WorkerMetrics(registry, "w0"), WORKER_METRICS
    elif component == "broker":
        metrics, specs = BrokerMetrics(registry), BROKER_METRICS
    else:
        metrics, specs = GatewayMetrics(registry), GATEWAY_METRICS
    touch_all(metrics, specs)
    server, port = serve_metrics(registry, "127.0.0.1", 0)
    try:
        text = fetch(f"http://127.0.0.1:{port}/metrics")
    finally:
        server.close()
    got = samples(text)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for spec in specs:
        for name in spec.series():
            assert name in got, f"{name} missing from /metrics"
            for s in got[name]:
                labels = set(s.labels) - {"le"}
                assert labels == set(spec.all_labels), (name, s.labels)
                if component == "worker":
                    assert s.labels["worker"] == "w0"
        family = families[spec.name.removesuffix("_total")]
        assert family.documentation == spec.help
        # The text format has no info type: an info is a gauge of value 1.
        assert family.type == (GAUGE if spec.type == INFO else spec.type)
        if spec.type == HISTOGRAM:
            edges = [float(s.labels["le"]) for s in got[spec.name + "_bucket"]
                     if s.labels.get("le") not in (None, "+Inf")]
            assert sorted(set(edges)) == [float(b) for b in spec.buckets]
    # Nothing outside the catalogue is exported.
    assert set(got) <= series_names(), set(got) - series_names()


def test_known_label_values_start_at_zero():
    registry = CollectorRegistry()
    WorkerMetrics(registry, "w0")
    BrokerMetrics(registry)
    GatewayMetrics(registry)
    for spec in catalogue():
        if not spec.label_values:
            continue
        names = [label for label, _ in spec.label_values]
        # every combination of the known values (a metric may have several such labels)
        for values in itertools.product(*(vals for _, vals in spec.label_values)):
            extra = {"worker": "w0"} if spec.component == "worker" else {}
            name = spec.name if spec.type != HISTOGRAM else spec.name + "_count"
            labels = {**extra, **dict(zip(names, values))}
            assert registry.get_sample_value(name, labels) == 0, (name, labels)


def test_two_workers_on_one_host_do_not_collide():
    servers = []
    try:
        texts = {}
        for worker in ("gpu0", "gpu1"):
            registry = CollectorRegistry()
            m = WorkerMetrics(registry, worker)
            m.generated_tokens.inc(7 if worker == "gpu0" else 9)
            server, port = serve_metrics(registry, "127.0.0.1", 0)
            servers.append(server)
            texts[worker] = fetch(f"http://127.0.0.1:{port}/metrics")
        assert servers[0].port != servers[1].port
        for worker, value in (("gpu0", 7), ("gpu1", 9)):
            got = samples(texts[worker])["turbomq_generated_tokens_total"]
            assert [(s.labels, s.value) for s in got] == [({"worker": worker}, value)]
    finally:
        for server in servers:
            server.close()
    # One registry is one process's: a second worker in it is refused, not merged.
    registry = CollectorRegistry()
    WorkerMetrics(registry, "a")
    with pytest.raises(ValueError):
        WorkerMetrics(registry, "b")


def test_worker_info_keys_are_checked():
    m = WorkerMetrics(CollectorRegistry(), "w0")
    with pytest.raises(ValueError, match="unknown worker info keys"):
        m.set_info(colour="blue")


def test_sync_engine_stats_counts_deltas():
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, "w0")
    stats = {"slots_total": 8, "slots_active": 3, "waiting": 2, "kv_blocks_total": 100,
             "kv_blocks_used": 40, "sessions_active": 3, "sessions_cached": 5,
             "sessions_evicted": 1, "evictions": 4, "cache_hits": 10, "cache_misses": 2,
             "generated_tokens": 50, "reprefilled_tokens": 30}
    m.sync_engine_stats(stats)
    m.sync_engine_stats({**stats, "generated_tokens": 80, "evictions": 4})
    value = lambda name, **labels: registry.get_sample_value(name, {"worker": "w0", **labels})
    assert value("turbomq_generated_tokens_total") == 80
    assert value("turbomq_kv_evictions_total") == 4
    assert value("turbomq_reprefilled_tokens_total") == 30
    assert value("turbomq_batch_slots") == 8 and value("turbomq_requests_running") == 3
    assert value("turbomq_requests_waiting") == 2 and value("turbomq_kv_blocks_used") == 40
    assert value("turbomq_sessions", state="cached") == 5


def test_session_store_metrics_from_real_redis(redis_server):
    registry = CollectorRegistry()
    m = WorkerMetrics(registry, "w0")
    store = RedisSessionStore(redis_server.url, "tiny", observe=m.observe_store)
    store.append_tokens("s", [1, 2])
    store.get_tokens("s")
    redis_server.stop()
    with pytest.raises(SessionStoreError):
        store.append_tokens("s", [3])
    store.close()
    value = lambda name, op: registry.get_sample_value(name, {"worker": "w0", "op": op})
    assert value("turbomq_session_store_duration_seconds_count", "append_tokens") == 2
    assert value("turbomq_session_store_duration_seconds_count", "get_tokens") == 1
    assert value("turbomq_session_store_errors_total", "append_tokens") == 1
    assert value("turbomq_session_store_errors_total", "get_tokens") == 0


def test_prometheus_scrapes_two_workers(prometheus):
    servers, ports = [], []
    try:
        for worker, slots in (("gpu0", 8), ("gpu1", 16)):
            registry = CollectorRegistry()
            m = WorkerMetrics(registry, worker)
            m.slots_total.set(slots)
            m.ttft.observe(0.02)
            server, port = serve_metrics(registry, "127.0.0.1", 0)
            servers.append(server)
            ports.append(port)
        prom = prometheus([f"127.0.0.1:{p}" for p in ports])
        prom.wait_targets_up()
        result = prom.wait_for("turbomq_batch_slots", check=lambda r: len(r) == 2)
        assert {r["metric"]["worker"]: float(r["value"][1]) for r in result} == \
            {"gpu0": 8.0, "gpu1": 16.0}
        assert prom.query('sum(turbomq_time_to_first_token_seconds_count)')[0]["value"][1] == "2"
    finally:
        for server in servers:
            server.close()


def test_docs_table_names_every_metric():
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `(turbomq_[a-z0-9_]+)` \|", doc, re.M))
    assert documented == {spec.name for spec in catalogue()}


def test_docs_table_lists_every_known_label_value():
    """Each label with a known set of values is documented with exactly those
    values, `label` (a / b / c), in its metric's row."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| `(turbomq_[a-z0-9_]+)` \|.*$", doc, re.M)}
    for spec in catalogue():
        for label, values in spec.label_values:
            m = re.search(rf"`{label}` \(([^)]*)\)", rows[spec.name])
            assert m, f"{spec.name}: docs/metrics.md does not list the values of {label}"
            assert m.group(1).split(" / ") == list(values), (spec.name, label, m.group(1))
