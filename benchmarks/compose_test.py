"""`docker compose up`, built and run for real, then torn down.

    .venv/bin/python benchmarks/compose_test.py [--no-cache] [--workers N] [--requests N]
    make compose-test                          # COMPOSE_TEST_ARGS=... passes flags

1. A Docker engine: the one DOCKER_HOST (or the default socket) names, or,
   when none answers, a `dockerd` started here (as root) with its own data
   root (/var/lib/turbomq-docker) and socket (/run/turbomq-docker/), stopped
   again at the end.
2. Base images: each image the stack needs that the engine lacks is pulled;
   where no registry answers, a local stand-in is built and tagged under its
   name: a Debian bookworm root (`debootstrap --variant=minbase`, with this
   machine's CA certificates, so pip and apt work behind a TLS-inspecting
   proxy), then python:3.11-slim, redis:7 and prom/prometheus from Debian's
   packages (docker/standins/). Images already there are kept: reruns skip
   this step.
3. Torch: the CPU wheel of the pinned torch (and its dependencies), fetched
   with this machine's pip and served as a package index on 127.0.0.1 for
   the TORCH_INDEX_URL build argument (--torch-index URL uses another index).
   The build runs on the host's network for it (docker/compose-test.yml).
4. `compose build` of turbomq:cpu (timed); `compose up -d` of redis, both
   brokers, N workers (`--scale worker=N`, 2 by default) and prometheus (and
   grafana if its image is there), published on free host ports through the
   compose file's own port settings; it waits until every service is healthy
   (timed) and checks, from the containers' own health logs, that each
   `depends_on` condition held when the dependent started.
5. Through the published ports, with turbomq.clients and the CurveZMQ keys the
   `keys` service made (taken out with `compose run --rm keys cat ...`, as
   docs/operations.md says): `health` on both brokers (each counting every
   worker), no answer to a plain client nor to an unknown key, generations
   through each broker, one streamed, and a two-turn session whose second
   turn must be served from the resident KV with its tokens in Redis.
6. Prometheus: every target of /api/v1/targets `up` (both brokers, every
   worker replica), the alert rules loaded, the brokers' request counters
   scraped. Then `compose down -v`, which must leave no container or volume.
7. The CUDA image: nvidia/cuda is out of reach, so docker/Dockerfile.cuda is
   built up to its first FROM (the file parses, the build stops pulling the
   base); then, where a CUDA toolkit is installed, built whole on stand-ins
   of its bases (Debian + that toolkit: nvidia/cuda:<version>-*-standin),
   and the image must import its kernels.
8. dockerd is stopped if this script started it.

Writes docs/benchmarks/compose.md and docs/benchmarks/compose.json; each
step's log goes to the work folder (--work, /var/tmp/turbomq-compose-test).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs" / "benchmarks"
STANDINS = ROOT / "docker" / "standins"
OVERRIDE = ROOT / "docker" / "compose-test.yml"
PROJECT = "turbomq-compose-test"
DEBIAN_BASE = "turbomq-test/debian:bookworm"
STANDIN_LABEL = "org.turbomq.stand-in"
# The engine started when none answers: its own state, apart from any other.
OWN_DATA_ROOT = Path("/var/lib/turbomq-docker")
OWN_EXEC_ROOT = Path("/run/turbomq-docker")
OWN_SOCKET = OWN_EXEC_ROOT / "docker.sock"
INDEX_PORT = 47401  # the local torch index, on 127.0.0.1
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
STACK = ["redis", "broker", "broker-b", "worker", "gateway", "prometheus"]
T0 = time.monotonic()


def log(msg: str) -> None:
    print(f"[compose-test {time.monotonic() - T0:6.1f}s] {msg}", flush=True)


class Failed(Exception):
    pass


def run(cmd: list[str], *, check: bool = True, timeout: float | None = 600, quiet: bool = False,
        logfile: Path | None = None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run a command; its output is captured (or appended to logfile)."""
    if not quiet:
        log("$ " + " ".join(cmd))
    if logfile is not None:
        with open(logfile, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n")
            f.flush()
            proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, text=True,
                                  timeout=timeout, env=env)
    else:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if check and proc.returncode != 0:
        tail = (logfile.read_text()[-4000:] if logfile else (proc.stdout + proc.stderr)[-4000:])
        raise Failed(f"{' '.join(cmd[:4])} ... exited {proc.returncode}:\n{tail}")
    return proc


# --------------------------------------------------------------- the engine
def docker_answers(timeout: float = 20) -> bool:
    try:
        return run(["docker", "info", "--format", "{{.ServerVersion}}"], check=False, quiet=True,
                   timeout=timeout).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def start_engine(work: Path) -> subprocess.Popen | None:
    """Use the engine that answers, or start one; returns the dockerd started."""
    if docker_answers():
        log(f"Docker engine: {os.environ.get('DOCKER_HOST', 'the default socket')}")
        return None
    os.environ["DOCKER_HOST"] = f"unix://{OWN_SOCKET}"
    if docker_answers():
        log(f"Docker engine: {OWN_SOCKET} (already running; left running)")
        return None
    if os.geteuid() != 0:
        raise Failed("no Docker engine answers, and starting dockerd needs root")
    if shutil.which("dockerd") is None:
        raise Failed("no Docker engine answers and there is no dockerd (apt-get install docker.io)")
    OWN_DATA_ROOT.mkdir(parents=True, exist_ok=True)
    OWN_EXEC_ROOT.mkdir(parents=True, exist_ok=True)
    logfile = open(work / "dockerd.log", "a")
    proc = subprocess.Popen(["dockerd", "--data-root", str(OWN_DATA_ROOT),
                             "--exec-root", str(OWN_EXEC_ROOT / "exec"),
                             "--pidfile", str(OWN_EXEC_ROOT / "dockerd.pid"),
                             "-H", f"unix://{OWN_SOCKET}"],
                            stdout=logfile, stderr=subprocess.STDOUT, start_new_session=True)
    logfile.close()
    deadline = time.monotonic() + 90
    while not docker_answers(5):
        if proc.poll() is not None or time.monotonic() > deadline:
            stop_engine(proc)
            raise Failed(f"dockerd did not start; see {work / 'dockerd.log'}")
        time.sleep(1)
    log(f"Docker engine: started dockerd (pid {proc.pid}), data root {OWN_DATA_ROOT}")
    return proc


def stop_engine(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    # dockerd leaves its default network namespace mounted: ours only.
    netns = OWN_EXEC_ROOT / "exec" / "netns" / "default"
    if os.path.ismount(netns) or netns.exists():
        subprocess.run(["umount", str(netns)], capture_output=True)
    log(f"stopped dockerd (pid {proc.pid})")


def compose_command() -> list[str]:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    raise Failed("neither `docker compose` nor docker-compose is installed")


# ------------------------------------------------------------------- images
def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], check=False, quiet=True).returncode == 0


def debian_base(work: Path, mirror: str) -> None:
    """Debian bookworm (minbase) with this machine's CA certificates."""
    if image_exists(DEBIAN_BASE):
        return
    if os.geteuid() != 0:
        raise Failed("building the Debian base (debootstrap) needs root")
    if shutil.which("debootstrap") is None:
        run(["apt-get", "update", "-q"], logfile=work / "bases.log")
        run(["apt-get", "install", "-y", "-q", "debootstrap"], logfile=work / "bases.log",
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
    rootfs = Path(tempfile.mkdtemp(prefix="rootfs-", dir=work))
    try:
        run(["debootstrap", "--variant=minbase", "--include=ca-certificates", "bookworm",
             str(rootfs), mirror], logfile=work / "bases.log", timeout=1200)
        # The CA bundle of this machine (it may trust a TLS-inspecting proxy),
        # also as a local CA so that an update-ca-certificates run keeps it.
        bundle = Path("/etc/ssl/certs/ca-certificates.crt")
        if bundle.is_file():
            shutil.copy(bundle, rootfs / "etc/ssl/certs/ca-certificates.crt")
            shutil.copy(bundle, rootfs / "usr/local/share/ca-certificates/host-bundle.crt")
        # As Docker's debian images: no service starts inside an image build.
        policy = rootfs / "usr/sbin/policy-rc.d"
        policy.write_text("#!/bin/sh\nexit 101\n")
        policy.chmod(0o755)
        for junk in ("var/lib/apt/lists", "var/cache/apt/archives"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        imp = subprocess.run(["docker", "import", "--change", f"LABEL {STANDIN_LABEL}=true",
                              "--change", f"ENV PATH={DEFAULT_PATH}",
                              "--change", 'CMD ["bash"]', "-", DEBIAN_BASE],
                             stdin=tar.stdout, capture_output=True, text=True)
        tar.stdout.close()
        tar.wait()
        if imp.returncode != 0 or tar.returncode != 0:
            raise Failed(f"docker import failed: {imp.stderr}")
    finally:
        shutil.rmtree(rootfs, ignore_errors=True)


def ensure_image(name: str, standin: str, work: Path, args) -> str:
    """'present', 'pulled' or 'stand-in' (built from docker/standins/<standin>.Dockerfile)."""
    if image_exists(name):
        return "present"
    if args.pull and run(["docker", "pull", name], check=False, timeout=1800,
                         logfile=work / "bases.log").returncode == 0:
        return "pulled"
    log(f"{name}: no registry answers; building a stand-in (docker/standins/{standin}.Dockerfile)")
    debian_base(work, args.debian_mirror)
    run(["docker", "build", "-f", str(STANDINS / f"{standin}.Dockerfile"), "-t", name,
         "--build-arg", f"BASE={DEBIAN_BASE}", "--label", f"{STANDIN_LABEL}=true",
         str(STANDINS)], logfile=work / "bases.log", timeout=1800)
    return "stand-in"


def default_arg(dockerfile: Path, name: str) -> str:
    m = re.search(rf"^ARG {name}=(\S*)$", dockerfile.read_text(), re.M)
    if not m:
        raise Failed(f"{dockerfile.name} declares no ARG {name}=...")
    return m.group(1)


# -------------------------------------------------------------- torch index
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def normalize(project: str) -> str:
    return re.sub(r"[-_.]+", "-", project).lower()


def torch_index(work: Path, version: str) -> tuple[str, subprocess.Popen]:
    """The pinned torch and its dependencies as a PEP 503 index on 127.0.0.1."""
    wheels = work / "wheels"
    wheels.mkdir(exist_ok=True)
    if not list(wheels.glob(f"torch-{version}*.whl")):
        run([sys.executable, "-m", "pip", "download", "-q", f"torch=={version}", "-d", str(wheels)],
            logfile=work / "pip.log", timeout=1800)
    simple = work / "index" / "simple"
    shutil.rmtree(simple.parent, ignore_errors=True)
    for f in wheels.iterdir():
        project = simple / normalize(f.name.split("-")[0])
        project.mkdir(parents=True, exist_ok=True)
        (project / f.name).symlink_to(f)
    # A fixed port while it is free: the index URL is a build argument, part
    # of the torch layer's cache key.
    port = INDEX_PORT
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", port)) == 0:
            port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "http.server", "--bind", "127.0.0.1",
                               str(port), "--directory", str(simple.parent)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}/simple"
    for _ in range(50):
        try:
            urllib.request.urlopen(f"{url}/torch/", timeout=2).read()
            return url, server
        except OSError:
            time.sleep(0.2)
    server.terminate()
    raise Failed("the local torch index did not start")


# ------------------------------------------------------------------ the stack
def parse_time(stamp: str) -> float:
    """Docker's RFC 3339 time (nanoseconds) as a Unix time."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)", stamp)
    if not m:
        raise ValueError(stamp)
    base = dt.datetime.fromisoformat(m.group(1) + (m.group(3).replace("Z", "+00:00")))
    return base.timestamp() + float("0." + (m.group(2) or "0"))


class Watcher:
    """Polls the project's containers while `up` runs; keeps every health probe."""

    def __init__(self):
        self.containers: dict[str, dict] = {}  # id -> latest inspect
        self.probes: dict[str, dict[str, dict]] = {}  # id -> probe start -> probe
        self.replicas: dict[str, int] = {}  # service -> containers expected (default 1)

    def poll(self) -> None:
        ids = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                  check=False, quiet=True).stdout.split()
        if not ids:
            return
        out = run(["docker", "inspect", *ids], check=False, quiet=True)
        if out.returncode != 0:
            return
        for c in json.loads(out.stdout):
            self.containers[c["Id"]] = c
            health = c["State"].get("Health") or {}
            for probe in health.get("Log") or []:
                self.probes.setdefault(c["Id"], {})[probe["Start"]] = probe

    def by_service(self) -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for c in self.containers.values():
            labels = c["Config"]["Labels"]
            if labels.get("com.docker.compose.oneoff") == "True":
                continue
            out.setdefault(labels["com.docker.compose.service"], []).append(c)
        return out

    def ready(self, service: str) -> bool:
        containers = self.by_service().get(service, [])
        if len(containers) < self.replicas.get(service, 1):
            return False
        for c in containers:
            state = c["State"]
            if "Health" in state:
                if state["Health"]["Status"] != "healthy":
                    return False
            elif service == "keys":
                if state["Status"] != "exited" or state["ExitCode"] != 0:
                    return False
            elif state["Status"] != "running":
                return False
        return True

    def first_healthy(self, container: dict) -> float | None:
        passed = [parse_time(p["End"]) for p in self.probes.get(container["Id"], {}).values()
                  if p["ExitCode"] == 0]
        return min(passed) if passed else None


def check_depends_on(watcher: Watcher, config: dict, services: list[str]) -> list[str]:
    """Each dependent started only after its dependencies met their conditions."""
    lines = []
    by_service = watcher.by_service()
    for name in services:
        deps = config[name].get("depends_on") or {}
        for dependent in sorted(by_service.get(name, []), key=lambda c: c["Name"]):
            started = parse_time(dependent["State"]["StartedAt"])
            label = name if len(by_service[name]) == 1 else \
                f"{name} #{dependent['Config']['Labels'].get('com.docker.compose.container-number')}"
            for dep, spec in deps.items():
                condition = spec.get("condition", "service_started") if isinstance(spec, dict) \
                    else "service_started"
                for c in by_service.get(dep, []):
                    if condition == "service_completed_successfully":
                        met = parse_time(c["State"]["FinishedAt"])
                        ok = c["State"]["ExitCode"] == 0 and met <= started
                    elif condition == "service_healthy":
                        met = watcher.first_healthy(c)
                        ok = met is not None and met <= started
                    else:
                        met = parse_time(c["State"]["StartedAt"])
                        ok = met <= started
                    if not ok:
                        raise Failed(f"{name} started before {dep} was {condition}")
                    lines.append(f"{label} started {started - met:.1f} s after {dep}: {condition}")
    return lines


def wait_healthy(compose: list[str], services: list[str], workers: int, timeout: float,
                 work: Path) -> tuple[float, Watcher]:
    watcher = Watcher()
    watcher.replicas["worker"] = workers
    start = time.monotonic()
    up_log = work / "up.log"
    up_log.write_text("")
    with open(up_log, "a") as f:
        up = subprocess.Popen([*compose, "up", "-d", "--no-build", "--scale", f"worker={workers}",
                               *services],
                              stdout=f, stderr=subprocess.STDOUT)
    wanted = ["keys", *services]
    seen = set()
    while True:
        watcher.poll()
        now = time.monotonic() - start
        for s in wanted:
            if s not in seen and watcher.ready(s):
                seen.add(s)
                log(f"  {s} {'done' if s == 'keys' else 'healthy'} at {now:.1f} s")
        if up.poll() is not None and up.returncode != 0:
            raise Failed(f"compose up exited {up.returncode}:\n{up_log.read_text()[-4000:]}")
        if up.poll() is not None and len(seen) == len(wanted):
            return now, watcher
        if now > timeout:
            up.kill()
            raise Failed(f"not healthy after {timeout:.0f} s: {sorted(set(wanted) - seen)}")
        time.sleep(0.5)


def keys_out(compose: list[str], dest: Path) -> tuple[Path, Path]:
    """The client's key pair and the broker's public key, as docs/operations.md takes them out."""
    dest.mkdir(mode=0o700, exist_ok=True)
    paths = []
    for name in ("client.key_secret", "broker.key"):
        out = run([*compose, "run", "--rm", "--no-deps", "-T", "keys", "cat", f"/keys/{name}"])
        path = dest / name
        path.write_text(out.stdout)
        path.chmod(0o600)
        paths.append(path)
    return paths[0], paths[1]


def gateway_check(compose: list[str], port: int) -> dict:
    """One chat completion through the published gateway port, authenticated
    with the API key the `keys` service wrote; and one without a key (401)."""
    import urllib.error
    import urllib.request

    line = run([*compose, "run", "--rm", "--no-deps", "-T", "keys", "cat", "/keys/api.keys"],
               quiet=True).stdout
    key = next(l.split()[1] for l in line.splitlines() if l.strip() and not l.startswith("#"))
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    body = json.dumps({"model": "demo-model", "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Hello"}]}).encode()

    def post(headers: dict) -> tuple[int, dict]:
        req = urllib.request.Request(url, body, {"Content-Type": "application/json", **headers})
        try:
            with urllib.request.urlopen(req, timeout=60) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read() or b"{}")

    status, reply = post({"Authorization": f"Bearer {key}"})
    no_key, _ = post({})
    return {"status": status, "completion_tokens": reply.get("usage", {}).get("completion_tokens"),
            "finish_reason": (reply.get("choices") or [{}])[0].get("finish_reason"),
            "without_key": no_key}


def redis_stored_tokens(compose: list[str], session_key: str) -> int:
    """How many token IDs Redis holds for a session (4-byte IDs)."""
    script = ('redis-cli --user turbomq --pass "$(cat /keys/redis.password)" --no-auth-warning '
              f'STRLEN "turbomq:session:{{{session_key}}}:tokens"')
    out = run([*compose, "exec", "-T", "redis", "sh", "-c", script])
    return int(out.stdout.strip()) // 4


def requests_check(compose: list[str], secret: Path, broker_key: Path, ports: list[int],
                   n: int, workers: int) -> dict:
    from turbomq.clients import Client, CurveClient, Delta, Final

    curve = CurveClient.load(str(secret), str(broker_key))
    sent = ok = 0
    health = {}
    prompts = ["Once upon a time", "The quick brown fox", "Hello, world", "In the beginning"]
    for port in ports:  # every worker registers with both brokers
        with Client(f"tcp://127.0.0.1:{port}", curve=curve, timeout=60) as c:
            deadline = time.monotonic() + 60
            while True:
                health[port] = c.health()
                if health[port]["status"] == "ok" and health[port]["workers"] == workers:
                    break
                if time.monotonic() > deadline:
                    raise Failed(f"broker on {port}: {health[port]}, {workers} workers expected")
                time.sleep(1)
            log(f"  broker on :{port}: {health[port]}")
    # Nobody is served for being on the network: a plain client, and one with
    # a key of its own that no allow-list names, get no answer at all.
    from turbomq.clients.keys import new_keypair
    from turbomq.clients import TurbomqError
    stranger_dir = Path(tempfile.mkdtemp(prefix="stranger-", dir=secret.parent))
    new_keypair(stranger_dir, "stranger")
    refused = {}
    for who, key in (("plain", None),
                     ("unknown key", CurveClient.load(str(stranger_dir / "stranger.key_secret"),
                                                      str(broker_key)))):
        with Client(f"tcp://127.0.0.1:{ports[0]}", curve=key, timeout=3) as c:
            try:
                c.health()
                refused[who] = False
            except TurbomqError as e:
                refused[who] = True
                log(f"  {who} client: no answer ({type(e).__name__})")
    if not all(refused.values()):
        raise Failed(f"a client without an allowed key was answered: {refused}")
    for i in range(n):
        port = ports[i % len(ports)]
        with Client(f"tcp://127.0.0.1:{port}", curve=curve, timeout=60) as c:
            sent += 1
            if i == 0:  # one streamed
                events = list(c.generate(prompt=prompts[i % 4], max_tokens=16, temperature=0,
                                         stream=True))
                final = events[-1]
                text = "".join(e.text for e in events if isinstance(e, Delta))
                good = isinstance(final, Final) and final.usage.completion_tokens > 0 \
                    and final.finish_reason in ("stop", "length")
            else:
                r = c.generate(prompt=prompts[i % 4], max_tokens=16, temperature=0)
                text = r.text
                good = r.usage.completion_tokens > 0 and r.finish_reason in ("stop", "length")
            ok += good
            log(f"  request {i} via :{port}: {'ok' if good else 'FAILED'} {text[:40]!r}")
    # A session: two turns through a client that knows both brokers.
    with Client([f"tcp://127.0.0.1:{p}" for p in ports], curve=curve, timeout=60) as c:
        with c.session() as chat:
            first = chat.send("Hello, my name is", max_tokens=8, temperature=0)
            second = chat.send(" and I like", max_tokens=8, temperature=0)
            stored = redis_stored_tokens(compose, f"default:{chat.session_id}")
        sent += 2
        history = first.usage.prompt_tokens + first.usage.completion_tokens
        session = {
            "first": vars(first.usage), "second": vars(second.usage),
            "history_tokens": history, "redis_tokens": stored,
            "second_turn_served": second.usage.completion_tokens > 0
            and second.usage.prompt_tokens > history and second.usage.cached_tokens > 0
            and stored >= second.usage.prompt_tokens,
        }
        ok += (first.usage.completion_tokens > 0) + session["second_turn_served"]
        log(f"  session: turn 1 {vars(first.usage)}; turn 2 {vars(second.usage)}; "
            f"{stored} tokens in Redis")
    return {"sent": sent, "ok": ok, "health": {str(k): v for k, v in health.items()},
            "session": session, "refused": refused}


def prometheus_check(port: int, workers: int, min_requests: int, timeout: float = 90) -> dict:
    base = f"http://127.0.0.1:{port}/api/v1"

    def get(path: str) -> dict:
        with urllib.request.urlopen(base + path, timeout=5) as r:
            return json.load(r)["data"]

    deadline = time.monotonic() + timeout
    while True:
        targets = get("/targets")["activeTargets"]
        jobs: dict[str, list] = {}
        for t in targets:
            jobs.setdefault(t["labels"]["job"], []).append(t)
        up = sum(t["health"] == "up" for t in targets)
        query = urllib.parse.quote('sum(turbomq_broker_requests_total{outcome="completed"})')
        result = get(f"/query?query={query}")["result"]
        completed = int(float(result[0]["value"][1])) if result else 0
        done = (up == len(targets) and len(jobs.get("turbomq-broker", [])) == 2
                and len(jobs.get("turbomq-workers", [])) == workers and completed >= min_requests)
        if done or time.monotonic() > deadline:
            break
        time.sleep(2)
    rules = sum(len(g["rules"]) for g in get("/rules")["groups"])
    return {
        "targets": len(targets), "up": up,
        "jobs": {job: [f"{t['labels']['instance']} {t['health']}" for t in ts]
                 for job, ts in sorted(jobs.items())},
        "alert_rules": rules, "broker_completed_requests": completed, "all_up": done,
    }


def cuda_check(work: Path) -> dict:
    """docker/Dockerfile.cuda built up to its first FROM, where nvidia/cuda is needed."""
    dockerfile = ROOT / "docker" / "Dockerfile.cuda"
    base = "nvidia/cuda:{}-devel-{}".format(default_arg(dockerfile, "CUDA_VERSION"),
                                            default_arg(dockerfile, "UBUNTU"))
    if image_exists(base):
        return {"parsed": None, "base": base,
                "result": f"{base} is here: `docker compose --profile gpu build` builds it"}
    out = run(["docker", "build", "--pull=false", "-f", str(dockerfile), "-t", "turbomq:cuda-check",
               str(ROOT)], check=False, env={**os.environ, "DOCKER_BUILDKIT": "0"},
              logfile=work / "cuda.log")
    text = (work / "cuda.log").read_text()
    # The legacy builder parses the whole file first ("Step 1/N"), then runs
    # it; here it must stop at the first FROM, pulling the base.
    steps = re.search(r"Step \d+/(\d+) : ", text)
    first_from = re.search(r"Step \d+/\d+ : FROM .*\n(.*)", text)
    parsed = (steps is not None and first_from is not None and out.returncode != 0
              and "Step" not in first_from.group(1) and "RUN" not in text)
    return {"parsed": parsed, "instructions": int(steps.group(1)) if steps else None,
            "base": base,
            "result": (f"the file parses ({steps.group(1)} instructions) and the build stops "
                       f"at its first FROM, pulling `{base}`: {first_from.group(1).strip()[:120]}"
                       if parsed else f"FAILED: see {work / 'cuda.log'}")}


def cuda_toolkit() -> tuple[Path, str] | None:
    """This machine's CUDA toolkit (CUDA_HOME, /usr/local/cuda, or where the
    nvcc on PATH lives) and its version."""
    candidates = [os.environ.get("CUDA_HOME"), "/usr/local/cuda"]
    if shutil.which("nvcc"):
        candidates.append(str(Path(shutil.which("nvcc")).resolve().parents[1]))
    for c in filter(None, candidates):
        root = Path(c).resolve()
        nvcc = root / "bin" / "nvcc"
        if not nvcc.is_file() or not (root / "include" / "cuda_runtime.h").is_file() \
                or not list((root / "lib64").glob("libcudart.so*")):
            continue
        version = re.search(r"release (\d+\.\d+)", run([str(nvcc), "--version"], quiet=True).stdout)
        if version:
            return root, version.group(1)
    return None


def cuda_standin_build(work: Path, index: str, no_cache: bool, mirror: str) -> dict:
    """docker/Dockerfile.cuda built whole on stand-ins of its nvidia/cuda bases
    (Debian + this machine's CUDA toolkit): apt, venv, the kernels compiled by
    nvcc into turbomq._native, the wheel, the runtime stage (torch from the
    local index); then the image imports its kernels."""
    found = cuda_toolkit()
    if found is None:
        return {"built": None, "result": "no CUDA toolkit (nvcc) on this machine: not built"}
    toolkit, version = found
    # The runtime stand-in's context: the CUDA runtime library alone (links followed).
    runtime = work / "cuda-runtime"
    shutil.rmtree(runtime, ignore_errors=True)
    (runtime / "lib64").mkdir(parents=True)
    for lib in (toolkit / "lib64").glob("libcudart.so*"):
        shutil.copy(lib, runtime / "lib64" / lib.name)
    for kind, context in (("devel", toolkit), ("runtime", runtime)):
        name = f"nvidia/cuda:{version}-{kind}-standin"
        if not image_exists(name):
            debian_base(work, mirror)
            run(["docker", "build", "-f", str(STANDINS / f"cuda-{kind}.Dockerfile"), "-t", name,
                 "--build-arg", f"BASE={DEBIAN_BASE}", "--label", f"{STANDIN_LABEL}=true",
                 str(context)], logfile=work / "cuda.log", timeout=1800)
    build = ["docker", "build", "--network", "host", "-f", str(ROOT / "docker" / "Dockerfile.cuda"),
             "--build-arg", f"CUDA_VERSION={version}", "--build-arg", "UBUNTU=standin",
             "--build-arg", f"TORCH_INDEX_URL={index}", "-t", "turbomq:cuda-standin", str(ROOT)]
    if no_cache:
        build.insert(2, "--no-cache")
    t = time.monotonic()
    run(build, logfile=work / "cuda.log", timeout=3600)
    build_s = round(time.monotonic() - t, 1)
    probe = ("import turbomq._native as n; k = sorted(x for x in dir(n.cuda) if not x.startswith('_'));"
             " print(len(k), ' '.join(k))")
    out = run(["docker", "run", "--rm", "turbomq:cuda-standin", "python", "-c", probe])
    kernels = out.stdout.strip()
    return {"built": True, "build_s": build_s, "toolkit": f"CUDA {version} ({toolkit})",
            "kernels": kernels,
            "result": f"built on stand-in bases (Debian bookworm + this machine's CUDA {version} "
                      f"toolkit) in {build_s} s; turbomq._native.cuda holds "
                      f"{kernels.split()[0]} functions"}


# ---------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--no-cache", action="store_true", help="build turbomq:cpu from scratch")
    ap.add_argument("--workers", type=int, default=2, help="CPU worker replicas (--scale worker=N)")
    ap.add_argument("--requests", type=int, default=8, help="generations through the brokers")
    ap.add_argument("--timeout", type=float, default=600, help="seconds to wait for health")
    ap.add_argument("--torch-index", help="the TORCH_INDEX_URL build argument (default: a "
                    "local index of this machine's torch wheel)")
    ap.add_argument("--no-pull", dest="pull", action="store_false",
                    help="build stand-ins for missing base images without trying to pull")
    ap.add_argument("--debian-mirror", default="http://deb.debian.org/debian")
    ap.add_argument("--work", type=Path, default=Path(os.environ.get(
        "COMPOSE_TEST_WORK", "/var/tmp/turbomq-compose-test")), help="cache and logs")
    ap.add_argument("--no-cuda-standin", dest="cuda_standin", action="store_false",
                    help="skip building the CUDA image on stand-in bases")
    ap.add_argument("--no-write", action="store_true", help="do not write docs/benchmarks/")
    args = ap.parse_args()

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("build.log", "bases.log", "cuda.log", "up.log", "pip.log"):
        (work / stale).unlink(missing_ok=True)
    def interrupted(signum, frame):  # SIGTERM cleans up like Ctrl-C
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    results: dict = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs"}
    cleanup: list = []
    failure = None
    try:
        dockerd = start_engine(work)
        if dockerd is not None:
            cleanup.append(lambda: stop_engine(dockerd))
        results["engine"] = run(["docker", "version", "--format", "{{.Server.Version}}"],
                                quiet=True).stdout.strip()
        compose = [*compose_command(), "-p", PROJECT, "--project-directory", str(ROOT),
                   "-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERRIDE)]
        results["compose"] = run([*compose, "version", "--short"], quiet=True).stdout.strip()
        # Host ports through the compose file's own settings: free ones, so that
        # a service already on this machine (5555, 9090, ...) is no obstacle.
        for var in ("BROKER_PORT", "BROKER_B_PORT", "GATEWAY_PORT", "PROMETHEUS_PORT",
                    "GRAFANA_PORT"):
            os.environ.setdefault(var, str(free_port()))
        import yaml
        config = yaml.safe_load(run([*compose, "config"], quiet=True).stdout)["services"]
        # A leftover of an interrupted run goes first.
        run([*compose, "down", "-v", "--remove-orphans"], check=False, quiet=True, timeout=300)
        cleanup.append(lambda: run([*compose, "down", "-v", "--remove-orphans"], check=False,
                                   timeout=300, logfile=work / "up.log"))

        # Base images.
        t = time.monotonic()
        python_image = default_arg(ROOT / "docker" / "Dockerfile", "PYTHON_IMAGE")
        bases = {python_image: ensure_image(python_image, "python", work, args),
                 config["redis"]["image"]: ensure_image(config["redis"]["image"], "redis", work, args),
                 config["prometheus"]["image"]: ensure_image(config["prometheus"]["image"],
                                                             "prometheus", work, args)}
        grafana = config["grafana"]["image"]
        if image_exists(grafana) or (args.pull and run(["docker", "pull", grafana], check=False,
                                                       logfile=work / "bases.log").returncode == 0):
            bases[grafana] = "present"
        else:
            bases[grafana] = "unavailable: not started"
        results["bases"] = bases
        results["bases_s"] = round(time.monotonic() - t, 1)
        for name, how in bases.items():
            log(f"base {name}: {how}")

        # turbomq:cpu.
        torch_version = default_arg(ROOT / "docker" / "Dockerfile", "TORCH_VERSION")
        if args.torch_index:
            index = args.torch_index
        else:
            index, server = torch_index(work, torch_version)
            cleanup.append(server.terminate)
        build = [*compose, "build", "--build-arg", f"TORCH_INDEX_URL={index}"]
        if args.no_cache:
            build.append("--no-cache")
        results["load_before_build"] = round(os.getloadavg()[0], 1)
        t = time.monotonic()
        run([*build, "keys"], logfile=work / "build.log", timeout=3600)
        results["build_s"] = round(time.monotonic() - t, 1)
        built = (work / "build.log").read_text()
        results["build_cached_steps"] = built.count("Using cache")
        size = run(["docker", "image", "inspect", "-f", "{{.Size}}", "turbomq:cpu"], quiet=True)
        results["image_mb"] = round(int(size.stdout) / 2**20)
        log(f"turbomq:cpu built in {results['build_s']} s ({results['image_mb']} MiB)")

        # Up, healthy, in order.
        services = STACK + (["grafana"] if bases[grafana] == "present" else [])
        results["services"] = ["keys", *services]
        results["workers"] = args.workers
        healthy_s, watcher = wait_healthy(compose, services, args.workers, args.timeout, work)
        results["healthy_s"] = round(healthy_s, 1)
        results["depends_on"] = check_depends_on(watcher, config, services)
        for line in results["depends_on"]:
            log(f"  {line}")

        # Requests with the project's client.
        ports = [int(p["published"]) if isinstance(p, dict) else int(str(p).split(":")[-2])
                 for name in ("broker", "broker-b") for p in config[name]["ports"]]
        keydir = Path(tempfile.mkdtemp(prefix="keys-", dir=work))
        cleanup.append(lambda: shutil.rmtree(keydir, ignore_errors=True))
        secret, broker_key = keys_out(compose, keydir)
        results["requests"] = requests_check(compose, secret, broker_key, ports, args.requests,
                                             args.workers)

        # The OpenAI API through the gateway, with the API key the stack made.
        gw = config["gateway"]["ports"][0]
        gw_port = int(gw["published"]) if isinstance(gw, dict) else int(str(gw).split(":")[-2])
        results["gateway"] = gateway_check(compose, gw_port)
        log(f"  gateway: {results['gateway']}")

        # Prometheus.
        prom = config["prometheus"]["ports"][0]
        prom_port = int(prom["published"]) if isinstance(prom, dict) else int(prom.split(":")[-2])
        workers = len(watcher.by_service().get("worker", []))
        results["prometheus"] = prometheus_check(prom_port, workers, args.requests)
        for job, lines in results["prometheus"]["jobs"].items():
            log(f"  prometheus {job}: {', '.join(lines)}")

        # Down before the CUDA builds: `down -v` leaves no container, network or volume.
        run([*compose, "down", "-v", "--remove-orphans"], logfile=work / "up.log", timeout=300)
        left = run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={PROJECT}"],
                   quiet=True).stdout.split()
        volumes = run(["docker", "volume", "ls", "-q", "--filter",
                       f"label=com.docker.compose.project={PROJECT}"], quiet=True).stdout.split()
        results["down_clean"] = not left and not volumes
        log(f"down -v: {len(left)} containers, {len(volumes)} volumes left")

        results["cuda"] = cuda_check(work)
        log(f"CUDA image: {results['cuda']['result']}")
        results["cuda_standin"] = {"built": None, "result": "skipped (--no-cuda-standin)"}
        if args.cuda_standin:
            results["cuda_standin"] = cuda_standin_build(work, index, args.no_cache,
                                                         args.debian_mirror)
            log(f"CUDA image on stand-ins: {results['cuda_standin']['result']}")
    except (Failed, subprocess.TimeoutExpired) as e:
        failure = str(e)
        log(f"FAILED: {failure}")
        results["failure"] = failure
        if "healthy_s" not in results or "requests" not in results:
            dump_logs(work)
    finally:
        for step in reversed(cleanup):
            try:
                step()
            except Exception as e:  # keep cleaning up
                log(f"cleanup: {e}")

    checks = verdict(results)
    results["checks"] = checks
    met = failure is None and all(checks.values())
    results["met"] = met
    for name, good in checks.items():
        log(f"{'ok  ' if good else 'FAIL'} {name}")
    if not args.no_write and failure is None:
        write_docs(results)
    log("all checks met" if met else "NOT met")
    return 0 if met else 1


def dump_logs(work: Path) -> None:
    """The stack's state and logs, for a failed run (before it is torn down)."""
    compose = [*compose_command(), "-p", PROJECT, "--project-directory", str(ROOT),
               "-f", str(ROOT / "docker-compose.yml"), "-f", str(OVERRIDE)]
    for cmd in (["ps"], ["logs", "--tail", "40"]):
        out = run([*compose, *cmd], check=False, quiet=True, timeout=120)
        print(out.stdout[-8000:], out.stderr[-2000:], flush=True)


def verdict(r: dict) -> dict[str, bool]:
    req = r.get("requests", {})
    prom = r.get("prometheus", {})
    return {
        "image built": "build_s" in r,
        "every service healthy, depends_on honoured": "depends_on" in r,
        "every request answered": bool(req) and req["ok"] == req["sent"],
        "second session turn served from resident KV, tokens in Redis":
            bool(req) and req["session"]["second_turn_served"],
        "the OpenAI API answers through the gateway (401 without a key)":
            r.get("gateway", {}).get("status") == 200 and r["gateway"].get("without_key") == 401,
        "every Prometheus target up": bool(prom.get("all_up")),
        "down -v leaves nothing": bool(r.get("down_clean")),
        "CUDA Dockerfile parses up to its base image":
            "cuda" in r and r["cuda"]["parsed"] is not False,
        "CUDA image builds on stand-in bases, kernels inside":
            "cuda_standin" in r and r["cuda_standin"]["built"] is not False,
    }


def write_docs(r: dict) -> None:
    DOCS.mkdir(parents=True, exist_ok=True)
    (DOCS / "compose.json").write_text(json.dumps(r, indent=1) + "\n")
    req, prom, s = r["requests"], r["prometheus"], r["requests"]["session"]
    bases = "\n".join(f"| `{name}` | {how} |" for name, how in r["bases"].items())
    targets = "; ".join(f"`{job}`: {', '.join(lines)}" for job, lines in prom["jobs"].items())
    build = (f"{r['build_cached_steps']} steps from the layer cache" if r["build_cached_steps"]
             else "from scratch")
    built_bases = [n for n, how in r["bases"].items() if how == "stand-in"]
    bases_line = (f"| base images: stand-ins built ({', '.join(built_bases)}) | {r['bases_s']} s |\n"
                  if built_bases else "")
    services = ", ".join(f"{n} x{r['workers']}" if n == "worker" and r["workers"] > 1 else n
                         for n in r["services"])
    cuda = r["cuda_standin"]
    cuda_line = (f"| CUDA image on stand-in bases (kernels compiled for sm_90a) | {cuda['build_s']} s |\n"
                 if cuda.get("built") else "")
    text = f"""# `docker compose up`, built and run

`make compose-test` (`.venv/bin/python benchmarks/compose_test.py`, see
docs/operations.md, "Testing the stack"): builds turbomq:cpu, starts the compose stack
with {r['workers']} CPU workers (`--scale worker={r['workers']}`), sends requests through
the published ports with `turbomq.clients` over CurveZMQ, checks Prometheus, then
`docker compose down -v`. On {r['machine']} (shared: load average {r['load_before_build']}
when the build started), Docker engine {r['engine']}, docker-compose {r['compose']}.

| figure | value |
| --- | --- |
{bases_line}| image build, `compose build` of turbomq:cpu ({build}) | {r['build_s']} s ({r['image_mb']} MiB) |
| `up -d` to every service healthy ({services}) | {r['healthy_s']} s |
| requests answered (`health` on both brokers; generations over both, one streamed; a two-turn session) | {req['ok']} of {req['sent']} |
| session turn 2: prompt tokens, of them from resident KV; token IDs in Redis | {s['second']['prompt_tokens']}, {s['second']['cached_tokens']}; {s['redis_tokens']} |
| clients without an allowed key (plain; a key on no allow-list) answered | none ({', '.join(req['refused'])}: no answer) |
| gateway: `POST /v1/chat/completions` with the generated API key; without a key | {r['gateway']['status']} ({r['gateway']['completion_tokens']} tokens, {r['gateway']['finish_reason']}); {r['gateway']['without_key']} |
| Prometheus targets up | {prom['up']} of {prom['targets']} |
| alert rules loaded; brokers' completed requests scraped | {prom['alert_rules']}; {prom['broker_completed_requests']} |
{cuda_line}
Targets: {targets}.

Start order (each dependent started after its `depends_on` condition held, from the
containers' health logs):

{chr(10).join('- ' + line for line in r['depends_on'])}

Base images (a stand-in is built from Debian bookworm packages where no registry
answers: docker/standins/):

| image | how |
| --- | --- |
{bases}

CUDA image (`docker/Dockerfile.cuda`): {r['cuda']['result']}. {cuda['result'][0].upper() + cuda['result'][1:]}.

Checks: {'; '.join(f"{k}: {'yes' if v else 'NO'}" for k, v in r['checks'].items())}.
"""
    (DOCS / "compose.md").write_text(text)
    log(f"wrote {DOCS / 'compose.md'}")


if __name__ == "__main__":
    sys.exit(main())
