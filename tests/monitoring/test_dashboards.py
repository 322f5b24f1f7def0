"""The Grafana dashboards: every PromQL expression uses only catalogue
metrics, the way their types demand, and the provisioned datasource and the
`worker` variable consistently; and, against a real broker, two real workers
and a real Prometheus, every expression evaluates without error and returns
data."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from conftest import free_port, require_binary, wait_until
from helpers import demo_model_dir
from turbomq.monitoring import (BROKER_METRICS, COUNTER, GATEWAY_METRICS, HISTOGRAM, WORKER_METRICS,
                                catalogue, series_names)

ROOT = Path(__file__).resolve().parents[2]
GRAFANA = ROOT / "monitoring" / "grafana"
DASHBOARD_DIR = GRAFANA / "dashboards"
DATASOURCES = GRAFANA / "provisioning" / "datasources" / "prometheus.yml"
PROVIDERS = GRAFANA / "provisioning" / "dashboards" / "turbomq.yml"
PROMETHEUS = ROOT / "monitoring" / "prometheus" / "prometheus.yml"

EXPECTED_UIDS = {"turbomq-overview", "turbomq-engine", "turbomq-broker"}
WORKER_FILTER = 'worker=~"$worker"'
RATE_INTERVAL = "30s"  # stands in for $__rate_interval

# What PromQL spells that is not a metric name.
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
            "and", "or", "unless", "inf", "nan"}

WORKER_FAMILIES = {spec.name: spec for spec in WORKER_METRICS}
BROKER_FAMILIES = {spec.name: spec for spec in BROKER_METRICS}
GATEWAY_FAMILIES = {spec.name: spec for spec in GATEWAY_METRICS}


# ---------------------------------------------------------------- reading
def load_dashboards() -> dict[str, dict]:
    files = sorted(DASHBOARD_DIR.glob("*.json"))
    assert files, f"no dashboards in {DASHBOARD_DIR}"
    return {f.name: json.loads(f.read_text()) for f in files}


def all_panels(dashboard: dict) -> list[dict]:
    """Every panel, those inside collapsed rows included."""
    out = []
    for panel in dashboard.get("panels", []):
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def panel_exprs() -> list[tuple[str, str, str]]:
    """(dashboard file, panel title, expr) for every query target."""
    out = []
    for name, dashboard in load_dashboards().items():
        for panel in all_panels(dashboard):
            for target in panel.get("targets", []):
                out.append((name, panel["title"], target["expr"]))
    return out


def spec_of(family: str):
    return WORKER_FAMILIES.get(family) or BROKER_FAMILIES.get(family) or GATEWAY_FAMILIES.get(family)


def family_of(series: str) -> str:
    """The catalogue family a sample name belongs to (histogram suffixes off)."""
    for suffix in ("_bucket", "_sum", "_count"):
        base = series.removesuffix(suffix)
        if base != series and spec_of(base) is not None and spec_of(base).type == HISTOGRAM:
            return base
    return series


def metric_names(expr: str) -> list[str]:
    """Metric names an expression selects: identifiers outside strings, label
    matchers, ranges and grouping clauses that are not called as functions."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = []
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", text):
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or m.group(0).lower() in KEYWORDS:
            continue
        if m.start() > 0 and (text[m.start() - 1].isdigit() or text[m.start() - 1] == "."):
            continue  # the exponent or unit of a number literal
        names.append(m.group(0))
    return names


def selectors(expr: str) -> list[tuple[str, str, int]]:
    """(metric name, its label matchers, offset) for every turbomq selector."""
    return [(m.group(1), m.group(2) or "", m.start())
            for m in re.finditer(r"\b(turbomq_[a-z0-9_]+)(\{[^}]*\})?", expr)]


def alert_exprs() -> list[str]:
    rules = yaml.safe_load((ROOT / "monitoring" / "prometheus" / "alerts.yml").read_text())
    return [rule["expr"] for group in rules["groups"] for rule in group["rules"]]


def datasource_uid() -> str:
    config = yaml.safe_load(DATASOURCES.read_text())
    (source,) = config["datasources"]
    assert source["type"] == "prometheus"
    return source["uid"]


def concrete(expr: str, worker: str = ".*") -> str:
    """The expression as Grafana sends it, for one value of the variables."""
    return expr.replace("$__rate_interval", RATE_INTERVAL).replace("$worker", worker)


# ----------------------------------------------------------- static checks
def test_dashboards_are_provisioned_with_unique_ids():
    dashboards = load_dashboards()
    assert {d["uid"] for d in dashboards.values()} == EXPECTED_UIDS
    assert len({d["title"] for d in dashboards.values()}) == len(dashboards)
    for name, dashboard in dashboards.items():
        ids = [p["id"] for p in all_panels(dashboard)]
        assert len(ids) == len(set(ids)), f"{name}: duplicate panel ids"
        assert all(p["title"] for p in all_panels(dashboard)), f"{name}: a panel has no title"
        assert "turbomq" in dashboard["tags"]
    providers = yaml.safe_load(PROVIDERS.read_text())["providers"]
    assert [p["type"] for p in providers] == ["file"]
    assert providers[0]["folder"] == "turbomq"


def test_every_metric_is_in_the_catalogue():
    known = series_names()
    for name, title, expr in panel_exprs():
        used = metric_names(expr)
        assert used, f"{name} / {title}: no metric in {expr!r}"
        unknown = [m for m in used if m not in known]
        assert not unknown, f"{name} / {title}: not in the catalogue: {unknown} in {expr!r}"


def test_every_catalogue_metric_is_on_a_dashboard():
    shown = {family_of(m) for _, _, expr in panel_exprs() for m in metric_names(expr)}
    missing = [spec.name for spec in catalogue() if spec.name not in shown]
    assert not missing, f"catalogue metrics on no dashboard: {missing}"


def test_broker_dashboard_shows_every_routing_decision():
    """The routing panel splits by decision and its description names each
    one; the cached-KV panel shows affinity (sessions) and prefix (the rest)."""
    from turbomq.monitoring.catalogue import ROUTING_DECISIONS
    panels = {p["title"]: p for p in all_panels(load_dashboards()["turbomq-broker.json"])}
    routing = panels["Routing decisions / s"]
    assert "sum by (decision)" in routing["targets"][0]["expr"]
    for decision in ROUTING_DECISIONS:
        assert f"{decision}:" in routing["description"], decision
    cached = " ".join(t["expr"] for t in panels["Routed to cached KV"]["targets"])
    assert 'decision="affinity"' in cached and 'decision="prefix"' in cached


def test_counters_are_rated_and_gauges_are_not():
    for name, title, expr in panel_exprs():
        for metric, _, start in selectors(expr):
            spec = spec_of(family_of(metric))
            if spec is None:
                continue  # reported by test_every_metric_is_in_the_catalogue
            rated = re.search(r"\b(rate|increase)\(\s*$", expr[:start]) is not None
            if spec.type in (COUNTER, HISTOGRAM):
                assert rated, f"{name} / {title}: {metric} is a {spec.type}; wrap it in rate()"
            else:
                assert not rated, f"{name} / {title}: rate() of the {spec.type} {metric}"


def test_quantiles_aggregate_buckets_by_le():
    pattern = re.compile(r"histogram_quantile\(\s*([0-9.]+)\s*,\s*sum by \(([^)]*)\)\s*"
                         r"\(rate\((turbomq_[a-z0-9_]+)_bucket(\{[^}]*\})?\[\$__rate_interval\]\)\)\)")
    for name, title, expr in panel_exprs():
        calls = expr.count("histogram_quantile(")
        found = pattern.findall(expr)
        assert len(found) == calls, f"{name} / {title}: quantile not of the form " \
            f"histogram_quantile(q, sum by (le, ...) (rate(x_bucket[$__rate_interval]))): {expr!r}"
        for q, by, metric, _ in found:
            assert 0 < float(q) < 1
            assert "le" in [label.strip() for label in by.split(",")]
            assert spec_of(metric) is not None and spec_of(metric).type == HISTOGRAM, metric
        for window in re.findall(r"\[([^\]]*)\]", expr):
            assert window == "$__rate_interval", f"{name} / {title}: fixed range [{window}]"


def test_worker_variable_filters_every_worker_metric():
    for name, dashboard in load_dashboards().items():
        (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "worker"]
        assert var["type"] == "query" and var["includeAll"] and var["allValue"] == ".*"
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        m = re.fullmatch(r"label_values\((turbomq_[a-z0-9_]+), worker\)", query)
        assert m and m.group(1) in WORKER_FAMILIES, f"{name}: worker variable query {query!r}"
    for name, title, expr in panel_exprs():
        for metric, matchers, _ in selectors(expr):
            if family_of(metric) in WORKER_FAMILIES:
                assert WORKER_FILTER in matchers, f"{name} / {title}: {metric} not filtered by $worker"
            else:
                assert "$worker" not in matchers, f"{name} / {title}: {metric} has no worker label"


def test_one_datasource_everywhere():
    uid = datasource_uid()
    for name, dashboard in load_dashboards().items():
        for var in dashboard["templating"]["list"]:
            assert var["datasource"]["uid"] == uid, f"{name}: variable {var['name']}"
        for panel in all_panels(dashboard):
            if panel["type"] == "row":
                continue
            assert panel["datasource"]["uid"] == uid, f"{name} / {panel['title']}"
            for target in panel["targets"]:
                assert target["datasource"]["uid"] == uid, f"{name} / {panel['title']}"


def test_expressions_parse(tmp_path):
    """promtool's PromQL parser accepts every expression."""
    promtool = require_binary("promtool")
    rules = [{"record": f"turbomq:panel_{i}", "expr": concrete(expr)}
             for i, (_, _, expr) in enumerate(panel_exprs())]
    path = tmp_path / "rules.yml"
    path.write_text(json.dumps({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = subprocess.run([promtool, "check", "rules", str(path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr


# ------------------------------------------------------------ live check
LIFETIME_S = 120  # no process of the live check outlives this, whatever happens
TURBOMQ = [sys.executable, "-m", "turbomq.worker.cli"]
WORKERS = ("dash-w1", "dash-w2")


class Stack:
    """A real broker, two real workers (demo model, CPU, Redis) and a real
    gateway, each serving /metrics on a port chosen here, so Prometheus knows
    them up front (the gateway serves it on its HTTP port)."""

    def __init__(self, tmp: Path, redis_url: str):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.metrics_ports: dict[str, int] = {}
        env = dict(os.environ, OMP_NUM_THREADS="1")
        port = self.metrics_ports["broker"] = free_port()
        broker = self._spawn("broker", ["broker", "--front", "tcp://127.0.0.1:*",
                                        "--back", "tcp://127.0.0.1:*", "--heartbeat-interval", "0.2",
                                        "--metrics-port", str(port), "--log-level", "WARNING"],
                             env, stdout=subprocess.PIPE)
        line = broker.stdout.readline()
        if not line:
            raise RuntimeError(f"broker did not start: {self.logs()}")
        endpoints = json.loads(line)
        self.front, self.back = endpoints["front"], endpoints["back"]
        for worker_id in WORKERS:
            port = self.metrics_ports[worker_id] = free_port()
            # A small KV pool, so the load below evicts and re-prefills.
            self._spawn(worker_id, ["worker", "--model", demo_model_dir(), "--device", "cpu",
                                    "--broker", self.back, "--redis-url", redis_url,
                                    "--worker-id", worker_id, "--metrics-port", str(port),
                                    "--max-batch-size", "2", "--block-size", "16",
                                    "--num-kv-blocks", "8", "--log-level", "WARNING"], env)
        port = self.metrics_ports["gateway"] = free_port()
        self.gateway = f"http://127.0.0.1:{port}"
        self._spawn("gateway", ["gateway", "--broker", self.front, "--port", str(port),
                                "--served-model-name", "demo", "--log-level", "WARNING"], env)

    def _spawn(self, name: str, args: list[str], env: dict, **kw) -> subprocess.Popen:
        log = open(self.tmp / f"{name}.log", "w")
        kw.setdefault("stdout", log)
        proc = subprocess.Popen(["timeout", "-s", "KILL", str(LIFETIME_S)] + TURBOMQ + args,
                                stderr=log, text=True, env=env, start_new_session=True, **kw)
        log.close()
        self.procs[name] = proc
        return proc

    @property
    def targets(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.metrics_ports.values()]

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in self.tmp.glob("*.log"))

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
            if proc.stdout:
                proc.stdout.close()


def drive_load(front: str, gateway: str) -> int:
    """Stateless requests (some through the gateway) and multi-turn sessions;
    returns the requests sent."""
    import openai

    from turbomq.clients import Client

    sent = 0
    with Client(front, timeout=60) as client:
        wait_until(lambda: client.health(timeout=5)["workers"] == len(WORKERS), 60,
                   "both workers registered with the broker", interval=0.2)
        api = openai.OpenAI(base_url=gateway + "/v1", api_key="none", max_retries=3)
        for i in range(2):
            for _ in api.completions.create(model="demo", prompt=f"Through the gateway {i}",
                                            max_tokens=4, temperature=0, stream=True):
                pass
            sent += 1
        for i in range(4):
            client.generate(f"The harbour town woke slowly {i}", max_tokens=8, temperature=0)
            sent += 1
        # Turns interleaved across sessions: each turn finds its session cached,
        # or evicted by the others from the small KV pool.
        sessions = [client.session(f"dash-session-{s}", max_tokens=6, temperature=0) for s in range(4)]
        for turn in range(3):
            for session in sessions:
                session.send(f"Turn {turn} of a conversation about the lighthouse keeper.")
                sent += 1
    return sent


def value(sample: dict) -> float:
    return float(sample["value"][1])


def test_every_panel_query_returns_data_from_a_live_stack(tmp_path, redis_server, prometheus):
    stack = Stack(tmp_path, redis_server.url)
    try:
        prom = prometheus(stack.targets, interval="1s")
        try:
            prom.wait_targets_up(timeout=60)
            sent = drive_load(stack.front, stack.gateway)
        except Exception as e:
            raise AssertionError(f"{e}\n{stack.logs()}\n--- prometheus\n{prom.log()}") from e
        # Every request is finished and scraped, twice, so each rate() has points.
        prom.wait_for(f'sum(turbomq_broker_requests_total{{outcome="completed"}}) >= {sent}', timeout=20)
        time.sleep(2.5)

        empty, errors = [], []
        for name, title, expr in panel_exprs():
            try:
                if not prom.query(concrete(expr)):
                    empty.append(f"{name} / {title}: {expr}")
            except Exception as e:  # an API error names the expression it failed on
                errors.append(f"{name} / {title}: {expr}: {e}")
        assert not errors, "queries failed:\n" + "\n".join(errors)
        assert not empty, "queries returned no data:\n" + "\n".join(empty)
        for expr in alert_exprs():  # alerts need not fire, but must evaluate
            prom.query(expr)

        # Every catalogue series is exposed by the running broker and workers.
        scraped = set(prom.api("label/__name__/values"))
        missing = sorted(set(series_names()) - scraped)
        assert not missing, f"catalogue series no process exposes: {missing}"

        # The variable lists both workers; one worker's value selects only it.
        for dashboard in load_dashboards().values():
            (var,) = [v for v in dashboard["templating"]["list"] if v["name"] == "worker"]
            metric = re.search(r"label_values\(([^,]+),", var["query"]["query"]).group(1)
            assert set(WORKERS) <= set(prom.api("label/worker/values", **{"match[]": metric}))
        one = prom.query(concrete('sum by (worker) (rate(turbomq_generated_tokens_total{worker=~"$worker"}'
                                  '[$__rate_interval]))', worker=WORKERS[0]))
        assert [s["metric"]["worker"] for s in one] == [WORKERS[0]]

        # What the load did shows up as numbers, not only as series.
        assert value(prom.query("turbomq_broker_workers_alive")[0]) == len(WORKERS)
        assert value(prom.query(concrete("sum(rate(turbomq_generated_tokens_total[$__rate_interval]))"))[0]) > 0
        assert value(prom.query(concrete(
            'sum(rate(turbomq_broker_requests_total{outcome="completed"}[$__rate_interval]))'))[0]) > 0
        assert value(prom.query(concrete(
            "sum(rate(turbomq_session_cache_hits_total[$__rate_interval]))"))[0]) > 0
        for metric in ("turbomq_time_to_first_token_seconds", "turbomq_request_duration_seconds",
                       "turbomq_broker_request_duration_seconds"):
            q = concrete(f"histogram_quantile(0.5, sum by (le) (rate({metric}_bucket[$__rate_interval])))")
            assert math.isfinite(value(prom.query(q)[0])), q
    finally:
        stack.close()


def test_alerts_use_catalogue_metrics():
    config = yaml.safe_load(PROMETHEUS.read_text())
    assert config["rule_files"] == ["alerts.yml"]
    rules = yaml.safe_load((PROMETHEUS.parent / "alerts.yml").read_text())
    known = series_names() | {"up"}  # `up`: Prometheus' own, per target
    exprs = [rule["expr"] for group in rules["groups"] for rule in group["rules"]]
    assert exprs
    for expr in exprs:
        unknown = set(metric_names(expr)) - known
        assert not unknown, f"not in the catalogue: {unknown} in {expr!r}"
