"""docker-compose.yml and the images: the file validates, every turbomq
command in it is accepted by the real CLI, the healthchecks work against real
processes, and Prometheus, Grafana and the Dockerfiles agree with it. No
Docker engine is needed: `docker-compose config` only reads files."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry

from conftest import free_port, require_binary
from turbomq.clients.keys import init_deployment
from turbomq.monitoring import WorkerMetrics, serve_metrics

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / "docker-compose.yml"
PROMETHEUS_CONFIG = ROOT / "monitoring" / "prometheus" / "prometheus.yml"
GRAFANA = ROOT / "monitoring" / "grafana"
TURBOMQ = Path(sys.executable).with_name("turbomq")

# Variables docker-compose.yml reads; unset for the defaults.
COMPOSE_VARS = ("MODEL", "DEVICE", "GPU_ID", "REDIS_URL", "WORKER_ID", "MAX_BATCH_SIZE", "KV_DTYPE",
                "MODELS_DIR", "LOG_LEVEL", "BROKER_PORT", "BROKER_QUEUE_BOUND", "PROMETHEUS_PORT",
                "PROMETHEUS_RETENTION", "GRAFANA_PORT", "GRAFANA_ADMIN_PASSWORD",
                "SERVED_MODEL_NAME", "GATEWAY_API_KEYS", "GATEWAY_PORT")


def docker_compose() -> str:
    path = shutil.which("docker-compose")
    if path is None:
        pytest.fail("docker-compose not found on PATH; run `make test`, or: "
                    "apt-get install -y docker-compose", pytrace=False)
    return path


def compose(*args: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in COMPOSE_VARS}
    return subprocess.run([docker_compose(), "--project-directory", str(ROOT), "-f", str(COMPOSE),
                           *args], capture_output=True, text=True, timeout=60, env={**base, **env})


def resolved(**env: str) -> dict:
    """The configuration compose would run, every profile on, variables substituted."""
    out = compose("--profile", "gpu", "config", **env)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)["services"]


def turbomq_commands(services: dict) -> dict[str, list[str]]:
    return {name: [str(a) for a in svc["command"]] for name, svc in services.items()
            if svc.get("command", [None])[0] == "turbomq"}


def flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def ports(service: dict) -> list[tuple[str, str, str]]:
    """(host ip, published, target) of each port; compose prints a string or a map."""
    out = []
    for p in service.get("ports", []):
        if isinstance(p, str):
            parts = p.split(":")
            ip = parts[0] if len(parts) == 3 else ""
            out.append((ip, parts[-2], parts[-1].split("/")[0]))
        else:
            out.append((str(p.get("host_ip", "")), str(p.get("published")), str(p["target"])))
    return out


def mounts(service: dict) -> dict[str, str]:
    """Container path -> host path or volume name; compose prints either form."""
    out = {}
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target = v.split(":")[:2]
        else:
            source, target = v["source"], v["target"]
        out[target] = source
    return out


def parse(argv: list[str]):
    """Parse a `turbomq ...` argv with the parser the CLI uses for it; raises
    AssertionError with argparse's message if it is refused."""
    from turbomq.broker.main import build_parser as broker_parser
    from turbomq.worker.cli.main import build_parser as cli_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            if argv[0] == "broker":  # `turbomq broker` hands its flags to the broker's parser
                return broker_parser().parse_args(argv[1:])
            return cli_parser().parse_args(argv)
    except SystemExit:
        raise AssertionError(f"turbomq {' '.join(argv)}: {err.getvalue()}") from None


# ----------------------------------------------------------------- compose
def test_compose_file_validates():
    for profile in ([], ["--profile", "gpu"]):
        out = compose(*profile, "config", "-q")
        assert out.returncode == 0, out.stderr


def test_plain_up_needs_no_gpu():
    services = resolved()
    assert {"redis", "broker", "worker", "worker-gpu", "prometheus", "grafana"} <= services.keys()
    gpu_users = [n for n, s in services.items() if "deploy" in s]
    assert gpu_users == ["worker-gpu"]
    assert services["worker-gpu"].get("profiles") == ["gpu"]
    for name, svc in services.items():
        if name != "worker-gpu":
            assert not svc.get("profiles"), f"{name} would not start with plain `docker compose up`"
    (device,) = services["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"] and device["driver"] == "nvidia"
    assert flag(turbomq_commands(services)["worker"], "--device") == "cpu"


def test_every_turbomq_command_is_accepted_by_the_cli():
    commands = turbomq_commands(resolved())
    assert {"broker", "worker", "worker-gpu"} <= commands.keys()
    for name, argv in commands.items():
        args = argv[1:]
        parse(args)
        help_out = subprocess.run([str(TURBOMQ), args[0], "--help"], capture_output=True,
                                  text=True, timeout=60)
        assert help_out.returncode == 0, f"{name}: {help_out.stderr}"
        for option in (a for a in args if a.startswith("--")):
            assert option in help_out.stdout, f"{name}: `turbomq {args[0]} --help` lists no {option}"


def test_settings_come_from_the_environment():
    defaults = turbomq_commands(resolved())
    assert flag(defaults["worker"], "--model") == "/opt/turbomq/demo-model"
    assert flag(defaults["worker"], "--redis-url") == "redis://turbomq@redis:6379/0"
    env = {"MODEL": "/models/llama-3-8b", "DEVICE": "cuda:1", "REDIS_URL": "redis://cache:6380/2",
           "WORKER_ID": "gpu-a", "MAX_BATCH_SIZE": "32", "KV_DTYPE": "int8"}
    services = resolved(**env)
    commands = turbomq_commands(services)
    for name in ("worker", "worker-gpu"):
        argv = commands[name]
        assert flag(argv, "--model") == env["MODEL"]
        assert flag(argv, "--redis-url") == env["REDIS_URL"]
        assert flag(argv, "--worker-id") == env["WORKER_ID"]
        assert flag(argv, "--max-batch-size") == env["MAX_BATCH_SIZE"]
        assert flag(argv, "--kv-dtype") == env["KV_DTYPE"]
        parse(argv[1:])
    assert flag(commands["worker-gpu"], "--device") == "cuda:1"
    assert flag(commands["worker"], "--device") == "cpu"


def test_redis_is_durable_and_checked():
    redis = resolved()["redis"]
    assert redis["image"].startswith("redis:7")
    command = [str(a) for a in redis["command"]]
    assert flag(command, "--appendonly") == "yes"
    assert "/data" in mounts(redis)
    assert command[1] == "/keys/redis.conf"  # the ACL user and its generated password
    check = redis["healthcheck"]["test"]
    assert check[0] == "CMD-SHELL" and "redis-cli --user turbomq" in check[1] and "ping" in check[1]


def test_turbomq_services_have_healthchecks_and_order():
    services = resolved()
    for name in ("redis", "broker", "broker-b", "worker", "worker-gpu", "gateway", "prometheus",
                 "grafana"):
        assert services[name].get("healthcheck", {}).get("test"), f"{name} has no healthcheck"
    for name in ("worker", "worker-gpu"):
        depends = services[name]["depends_on"]
        assert {depends[d]["condition"] for d in ("broker", "broker-b", "redis")} == {"service_healthy"}
    depends = services["gateway"]["depends_on"]
    assert {depends[d]["condition"] for d in ("broker", "broker-b")} == {"service_healthy"}


def test_gateway_is_a_curve_client_of_both_brokers_with_api_keys():
    services = resolved()
    argv = turbomq_commands(services)["gateway"]
    assert flag(argv, "--broker") == "tcp://broker:5555,tcp://broker-b:5555"
    assert flag(argv, "--host") == "0.0.0.0" and flag(argv, "--port") == "8000"
    assert flag(argv, "--api-keys") == "/keys/api.keys"  # made by `turbomq keys init`
    assert flag(argv, "--curve-secret") == "/keys/client.key_secret"
    assert flag(argv, "--broker-key") == "/keys/broker.key"
    assert ports(services["gateway"]) == [("127.0.0.1", "8000", "8000")]
    env = {"SERVED_MODEL_NAME": "llama-3-8b", "GATEWAY_PORT": "8080"}
    services = resolved(**env)
    assert flag(turbomq_commands(services)["gateway"], "--served-model-name") == "llama-3-8b"
    assert ports(services["gateway"]) == [("127.0.0.1", "8080", "8000")]


def test_two_brokers_and_workers_register_with_both():
    services = resolved()
    commands = turbomq_commands(services)
    assert commands["broker"] == commands["broker-b"]  # the same broker, twice
    published = {name: ports(services[name]) for name in ("broker", "broker-b")}
    assert published == {"broker": [("127.0.0.1", "5555", "5555")],
                         "broker-b": [("127.0.0.1", "5557", "5555")]}
    for name in ("worker", "worker-gpu"):
        assert flag(commands[name], "--broker") == "tcp://broker:5556,tcp://broker-b:5556"


# ------------------------------------------------------------ healthchecks
def healthcheck_script(service: dict) -> str:
    test = service["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python3", "-c"], test
    return test[3]


def run_check(script: str) -> int:
    return subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=30).returncode


def test_broker_healthcheck_asks_a_real_broker(tmp_path):
    services = resolved()
    command = turbomq_commands(services)["broker"]
    front = flag(command, "--front")
    port = front.rsplit(":", 1)[1]
    script = healthcheck_script(services["broker"])
    assert f"tcp://127.0.0.1:{port}" in script
    local = free_port()
    keys = tmp_path / "keys"
    init_deployment(keys)  # what the keys service makes on first start
    script = script.replace(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{local}")
    script = script.replace("/keys/", f"{keys}/")
    curve = [a.replace("/keys/", f"{keys}/") for name in ("--curve-secret", "--client-keys",
                                                          "--worker-keys")
             for a in (name, flag(command, name))]
    broker = subprocess.Popen([str(TURBOMQ), "broker", "--front", f"tcp://127.0.0.1:{local}",
                               "--back", "tcp://127.0.0.1:*", "--log-level", "WARNING", *curve],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(broker.stdout.readline())["front"].endswith(f":{local}")
        assert run_check(script) == 0
    finally:
        broker.terminate()
        broker.wait(10)
        broker.stdout.close()
    assert run_check(script) != 0, "the broker healthcheck passes with no broker"


def test_gateway_healthcheck_asks_a_real_gateway(tmp_path):
    """The compose gateway's command and healthcheck against a real broker
    (CURVE, the keys `turbomq keys init` makes), an echo worker and a real
    gateway on local ports."""
    services = resolved()
    command = turbomq_commands(services)["gateway"]
    script = healthcheck_script(services["gateway"])
    assert "http://127.0.0.1:8000/health" in script
    keys = tmp_path / "keys"
    init_deployment(keys)
    assert (keys / "api.keys").read_text().startswith("default sk-")
    port = free_port()
    script = script.replace("127.0.0.1:8000", f"127.0.0.1:{port}")
    broker = subprocess.Popen([str(TURBOMQ), "broker", "--front", "tcp://127.0.0.1:*",
                               "--back", "tcp://127.0.0.1:*", "--log-level", "WARNING",
                               "--curve-secret", str(keys / "broker.key_secret"),
                               "--client-keys", str(keys / "clients.allow"),
                               "--worker-keys", str(keys / "workers.allow")],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    procs = [broker]
    try:
        endpoints = json.loads(broker.stdout.readline())
        argv = [a.replace("/keys/", f"{keys}/") for a in command[1:]]
        argv[argv.index("--broker") + 1] = endpoints["front"]
        argv[argv.index("--host") + 1] = "127.0.0.1"
        argv[argv.index("--port") + 1] = str(port)
        gateway = subprocess.Popen([str(TURBOMQ), *argv], stdout=subprocess.PIPE,
                                   stderr=subprocess.DEVNULL, text=True)
        procs.append(gateway)
        assert json.loads(gateway.stdout.readline())["port"] == port
        assert run_check(script) != 0, "healthy with no worker behind the broker"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "turbomq.broker.echo_worker", "--broker", endpoints["back"],
             "--curve-secret", str(keys / "worker.key_secret"),
             "--broker-key", str(keys / "broker.key")], stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + 30
        while run_check(script) != 0:
            assert time.monotonic() < deadline, "the gateway healthcheck never passed"
            time.sleep(0.2)
    finally:
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(10)
            if proc.stdout:
                proc.stdout.close()
    assert run_check(script) != 0, "the gateway healthcheck passes with no gateway"


def test_worker_healthcheck_reads_metrics():
    services = resolved()
    commands = turbomq_commands(services)
    (port,) = {flag(commands[name], "--metrics-port") for name in ("worker", "worker-gpu")}
    (script,) = {healthcheck_script(services[name]) for name in ("worker", "worker-gpu")}
    assert f"http://127.0.0.1:{port}/metrics" in script
    local = free_port()
    script = script.replace(f"127.0.0.1:{port}", f"127.0.0.1:{local}")
    registry = CollectorRegistry()
    WorkerMetrics(registry, "health")
    server, _ = serve_metrics(registry, port=local)
    try:
        assert run_check(script) == 0
    finally:
        server.close()
    assert run_check(script) != 0, "the worker healthcheck passes with nothing serving"


# -------------------------------------------------------------- prometheus
def test_prometheus_config_is_valid():
    out = subprocess.run([require_binary("promtool"), "check", "config", str(PROMETHEUS_CONFIG)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_prometheus_scrapes_every_turbomq_service():
    services = resolved()
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert config["global"]["scrape_interval"] == "5s"
    prom = services["prometheus"]
    assert mounts(prom)["/etc/prometheus"] == str(PROMETHEUS_CONFIG.parent)
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    scraped = {}  # (service name, port) from the config
    for job in jobs.values():
        for static in job.get("static_configs", []):
            for target in static["targets"]:
                host, port = target.rsplit(":", 1)
                scraped[host] = port
        for sd in job.get("dns_sd_configs", []):
            for host in sd["names"]:
                scraped[host] = str(sd["port"])
    for name, argv in turbomq_commands(services).items():
        if name == "keys":
            continue  # a one-shot: nothing to scrape
        # the gateway serves /metrics on its HTTP API's host and port
        host_flag, port_flag = (("--host", "--port") if argv[1] == "gateway"
                                else ("--metrics-host", "--metrics-port"))
        assert flag(argv, host_flag) == "0.0.0.0", f"{name}: metrics not reachable from prometheus"
        assert scraped.get(name) == flag(argv, port_flag), \
            f"{name}: prometheus scrapes {scraped.get(name)}, the service serves {flag(argv, port_flag)}"
    assert set(scraped) <= set(services), f"scraped hosts that are no service: {set(scraped) - set(services)}"


# ----------------------------------------------------------------- grafana


def test_grafana_is_provisioned_from_the_repository():
    services = resolved()
    grafana = services["grafana"]
    binds = mounts(grafana)
    assert binds["/etc/grafana/provisioning"] == str(GRAFANA / "provisioning")
    provider = yaml.safe_load((GRAFANA / "provisioning" / "dashboards" / "turbomq.yml").read_text())
    dashboards_in_container = provider["providers"][0]["options"]["path"]
    assert binds[dashboards_in_container] == str(GRAFANA / "dashboards")
    env = grafana["environment"]
    assert env["GF_AUTH_ANONYMOUS_ENABLED"] == "true" and env["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    home = env["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(dashboards_in_container + "/")
    assert (GRAFANA / "dashboards" / Path(home).name).is_file()
    assert [p[1:] for p in ports(grafana)] == [("3000", "3000")]
    assert env["GF_SECURITY_ADMIN_PASSWORD__FILE"] == "/keys/grafana.password"  # no default admin
    (source,) = yaml.safe_load((GRAFANA / "provisioning" / "datasources" / "prometheus.yml")
                               .read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090" and "prometheus" in services
    assert [p[2] for p in ports(services["prometheus"])] == ["9090"]


# ------------------------------------------------------------------ images
def dockerfiles() -> list[Path]:
    services = resolved()
    files = {ROOT / svc["build"]["dockerfile"] for svc in services.values() if "build" in svc}
    assert files == {ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cuda"}
    return sorted(files)


def test_images_install_like_the_makefile():
    tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11+")
    torch_pin = re.search(r"torch==([0-9][0-9.]*)", (ROOT / "Makefile").read_text()).group(1)
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = set(pyproject["tool"]["scikit-build"]["wheel"]["packages"].values())
    cmake_dir = pyproject["tool"]["scikit-build"]["cmake"]["source-dir"]
    for path in dockerfiles():
        text = path.read_text()
        assert f"ARG TORCH_VERSION={torch_pin}\n" in text, f"{path.name}: torch not pinned to {torch_pin}"
        torch_step = text.index('"torch==${TORCH_VERSION}"')
        assert torch_step < text.index("/wheels/turbomq-"), f"{path.name}: torch must go in first"
        copied = set()
        for line in re.findall(r"^COPY (?!--from)(.+)$", text, re.M):
            *sources, _ = line.split()
            for source in sources:
                assert (ROOT / source).exists(), f"{path.name}: COPY of missing {source}"
                copied.add(source)
        missing = (packages | {cmake_dir, "pyproject.toml", "README.md"}) - copied
        assert not missing, f"{path.name}: the build stage lacks {missing}"
        assert 'ENTRYPOINT ["turbomq-entrypoint"]' in text


def test_dockerignore_keeps_sources():
    ignored = [l.strip() for l in (ROOT / ".dockerignore").read_text().splitlines()
               if l.strip() and not l.startswith("#")]
    for path in dockerfiles():
        for line in re.findall(r"^COPY (?!--from)(.+)$", path.read_text(), re.M):
            for source in line.split()[:-1]:
                assert source not in ignored, f".dockerignore drops {source}, which {path.name} copies"
    for heavy in (".git", ".venv", "build"):
        assert heavy in ignored


# What `docker build` would take from each Dockerfile, checked without an
# engine: the CUDA image cannot be built where CI runs (nor where
# `make compose-test` runs: no nvidia/cuda image), so its mistakes must show here.
INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK", "SHELL"}
BASE_ENV = {"PATH", "HOME", "HOSTNAME"}  # what Docker or every base image sets


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """(line, INSTRUCTION, arguments): continuations joined, comments dropped."""
    out, buf, start = [], "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("#") or (not buf and not line.strip()):
            continue
        assert not re.search(r"\\\s+$", line), f"{path.name}:{n}: blanks after a line continuation"
        if not buf:
            start = n
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        word, _, rest = (buf + line).strip().partition(" ")
        out.append((start, word, rest.strip()))
        buf = ""
    assert not buf, f"{path.name} ends inside a line continuation"
    return out


def test_dockerfiles_lint():
    """Instructions known and upper case; an ARG before the first FROM is used
    only in FROM lines (Docker hides it inside the stages); every upper-case
    variable a stage uses is declared in that stage (ARG, ENV) or set by the
    base; COPY --from names an earlier stage; every RUN is valid sh; CMD and
    ENTRYPOINT are exec-form JSON."""
    for path in dockerfiles():
        global_args: dict[str, str] = {}
        stages: list[str] = []
        declared: set[str] | None = None  # in the current stage
        for n, word, rest in dockerfile_instructions(path):
            where = f"{path.name}:{n}"
            assert word in INSTRUCTIONS, f"{where}: {word} is no Dockerfile instruction (or not upper case)"
            used = {v for v in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", rest) if v.isupper()}
            if word == "FROM":
                image, *alias = rest.split()
                assert alias == [] or (len(alias) == 2 and alias[0] == "AS"), f"{where}: FROM {rest}"
                for v in used:
                    assert global_args.get(v), f"{where}: FROM uses ${v}: no ARG before the first FROM sets it"
                stages.append(alias[1] if alias else "")
                declared = set(BASE_ENV)
                continue
            if declared is None:
                assert word == "ARG", f"{where}: only ARG comes before the first FROM"
                name, _, default = rest.partition("=")
                global_args[name] = default
                continue
            missing = used - declared
            assert not missing, (f"{where}: {word} uses {sorted(missing)}, not declared in this stage "
                                 "(an ARG before the first FROM is seen by FROM lines only)")
            if word == "ARG":
                declared.add(rest.partition("=")[0])
            elif word == "ENV":
                declared.update(re.findall(r"(?:^|\s)([A-Za-z_][A-Za-z0-9_]*)=", rest))
            elif word == "COPY" and rest.startswith("--from="):
                source = rest.split()[0].split("=", 1)[1]
                assert source in stages[:-1], f"{where}: COPY --from={source} names no earlier stage"
            elif word == "RUN":
                assert not rest.startswith("["), f"{where}: RUN in exec form"
                check = subprocess.run(["sh", "-n", "-c", rest], capture_output=True, text=True)
                assert check.returncode == 0, f"{where}: RUN is not valid sh: {check.stderr}"
            elif word in ("CMD", "ENTRYPOINT"):
                argv = json.loads(rest)
                assert isinstance(argv, list) and all(isinstance(a, str) for a in argv), where
        assert len(stages) >= 2 and stages[0], f"{path.name}: a named build stage, then the image"


def test_compose_test_override_changes_only_the_build_network():
    """`make compose-test` adds docker/compose-test.yml to the compose file:
    the build of turbomq:cpu on the host's network, nothing else."""
    plain = resolved()
    out = subprocess.run([docker_compose(), "--project-directory", str(ROOT), "-f", str(COMPOSE),
                          "-f", str(ROOT / "docker" / "compose-test.yml"), "--profile", "gpu",
                          "config"], capture_output=True, text=True, timeout=60,
                         env={k: v for k, v in os.environ.items() if k not in COMPOSE_VARS})
    assert out.returncode == 0, out.stderr
    tested = yaml.safe_load(out.stdout)["services"]
    assert tested["keys"]["build"].pop("network") == "host"
    for services in (plain, tested):  # merging files may reorder a service's volumes
        for svc in services.values():
            svc["volumes"] = sorted(map(str, svc.get("volumes", [])))
    assert tested == plain


def test_entrypoint_writes_the_demo_model_only_when_named(tmp_path):
    entrypoint = ROOT / "docker" / "entrypoint.sh"
    assert os.access(entrypoint, os.X_OK)
    demo = tmp_path / "demo"
    env = dict(os.environ, TURBOMQ_DEMO_MODEL=str(demo), OMP_NUM_THREADS="1",
               PATH=f"{TURBOMQ.parent}{os.pathsep}{os.environ['PATH']}")
    show_args = [sys.executable, "-c", "import sys; print(sys.argv[1:])"]

    out = subprocess.run([str(entrypoint), *show_args, "--model", "/models/other"], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['--model', '/models/other']" and not demo.exists()

    out = subprocess.run([str(entrypoint), *show_args, "--model", str(demo)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(["--model", str(demo)])
    assert (demo / "config.json").is_file() and (demo / "tokenizer.json").is_file()
    written = (demo / "model.safetensors").stat().st_mtime_ns

    out = subprocess.run([str(entrypoint), *show_args, str(demo)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and (demo / "model.safetensors").stat().st_mtime_ns == written
