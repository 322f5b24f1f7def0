"""The package layout holds: imports run one way (cli -> service -> engine ->
model -> ops -> native) with no cycles, counting imports inside functions,
and the light modules stay light (docs/architecture.md)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "worker"

# Higher layers may import lower ones, never the reverse.
LAYERS = {"cli": 5, "service": 4, "engine": 3, "model": 2, "ops": 1}


def module_name(path: Path) -> str:
    parts = ["turbomq", "worker", *path.relative_to(WORKER).with_suffix("").parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def layer(module: str) -> int | None:
    parts = module.split(".")
    if parts[:2] != ["turbomq", "worker"] or len(parts) < 3:
        return None
    if parts[2] == "model" and len(parts) > 3 and parts[3] == "ops":
        return LAYERS["ops"]
    return LAYERS.get(parts[2])


def import_statements(path: Path, package: str):
    """(module, names imported from it) for every import statement in `path`,
    wherever it stands (functions, TYPE_CHECKING blocks); relative imports
    resolved against `package`. A plain `import m` gives (m, [])."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, []
        elif isinstance(node, ast.ImportFrom):
            origin = node.module or ""
            if node.level:
                base = package.split(".")
                base = base[:len(base) - node.level + 1]
                origin = ".".join(base + ([node.module] if node.module else []))
            yield origin, [alias.name for alias in node.names]


def imports(path: Path, modules: set[str]) -> set[str]:
    """Every module `path` imports, resolved to absolute names."""
    here = module_name(path)
    package = here if is_package(path) else here.rsplit(".", 1)[0]
    found: set[str] = set()
    for origin, names in import_statements(path, package):
        if not names:
            found.add(origin)
        for name in names:
            sub = f"{origin}.{name}"
            found.add(sub if sub in modules else origin)
    return found


def worker_graph() -> dict[str, set[str]]:
    paths = sorted(WORKER.rglob("*.py"))
    modules = {module_name(p) for p in paths}
    return {module_name(p): imports(p, modules) for p in paths}


def test_imports_run_one_way():
    wrong = []
    for module, targets in worker_graph().items():
        here = layer(module)
        for target in targets:
            there = layer(target)
            if here is not None and there is not None and there > here:
                wrong.append(f"{module} -> {target}")
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_lower_layers_never_touch_the_service_stack():
    banned = ("turbomq.clients", "turbomq.broker", "turbomq.monitoring", "zmq", "redis",
              "prometheus_client")
    wrong = [f"{m} -> {t}" for m, targets in worker_graph().items()
             if (layer(m) or 0) <= LAYERS["engine"]
             for t in targets if t.split(".")[0] in banned or t.startswith(banned)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles():
    graph = worker_graph()
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        path.append(m)
        for t in sorted(graph.get(m, ())):
            if t not in graph:
                continue
            if state.get(t) == 1:
                cycle = path[path.index(t):] + [t]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if t not in state:
                visit(t)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_the_graph_sees_function_level_imports():
    # the cli imports the service inside functions: the walk must find it
    assert "turbomq.worker.service.loop" in worker_graph()["turbomq.worker.cli.main"]


@pytest.mark.parametrize("module,heavy", [
    ("turbomq.worker.engine.scheduler", "torch"),
    ("turbomq.worker.engine.sampling_params", "torch"),
    ("turbomq.worker.engine.config", "torch"),
    ("turbomq.worker.cli", "torch"),
    ("turbomq.clients", "torch"),
    ("turbomq.clients", "turbomq.worker"),
    ("turbomq.broker", "torch"),
    # the HTTP stack and the benchmark's libraries come only with their extras
    ("turbomq.clients", "starlette"),
    ("turbomq.clients", "uvicorn"),
    ("turbomq.clients", "httpx"),
    ("turbomq.clients", "matplotlib"),
    ("turbomq.clients", "prometheus_client"),
    ("turbomq.clients", "turbomq.clients.gateway"),
    ("turbomq.clients", "turbomq.clients.bench"),
    ("turbomq.clients.gateway", "torch"),
    ("turbomq.clients.gateway", "turbomq.worker"),
    ("turbomq.clients.gateway", "turbomq.broker"),
    ("turbomq.clients.bench", "torch"),
    ("turbomq.clients.bench", "turbomq.worker"),
    ("turbomq.clients.bench", "matplotlib"),
    ("turbomq.worker.cli", "starlette"),
    # the `turbomq` parser takes the bench's flags from bench/cli.py: stdlib only
    ("turbomq.worker.cli.main", "httpx"),
    ("turbomq.worker.cli.main", "matplotlib"),
    ("turbomq.clients.bench.cli", "numpy"),
])
def test_light_modules_stay_light(module, heavy):
    code = (f"import sys, {module}\n"
            f"bad = [m for m in sys.modules if m == {heavy!r} or m.startswith({heavy!r} + '.')]\n"
            "assert not bad, bad\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, f"importing {module} imports {heavy}: {run.stderr[-500:]}"


CLIENTS = ROOT / "clients"
EXTRA_PACKAGES = ("gateway", "bench")  # optional extras beside the client library


def test_the_client_library_never_imports_its_extras():
    """Importing turbomq.clients never pulls in the gateway's HTTP stack or
    the benchmark, counting imports inside functions; the extras build on the
    client library, never on the worker or the broker."""
    wrong = []
    for path in sorted(CLIENTS.rglob("*.py")):
        rel = path.relative_to(CLIENTS)
        in_extra = rel.parts[0] in EXTRA_PACKAGES
        package = ".".join(["turbomq", "clients", *rel.parent.parts])
        for origin, imported in import_statements(path, package):
            names = [origin] + [f"{origin}.{n}" for n in imported]
            for name in names:
                extra = any(name == f"turbomq.clients.{e}" or name.startswith(f"turbomq.clients.{e}.")
                            for e in EXTRA_PACKAGES)
                if not in_extra and extra:
                    wrong.append(f"{rel} -> {name}")
                if in_extra and name.startswith(("turbomq.worker", "turbomq.broker", "torch")):
                    wrong.append(f"{rel} -> {name}")
    assert not wrong, "\n".join(wrong)


def test_every_package_says_what_it_owns():
    for init in sorted(WORKER.rglob("__init__.py")) + [ROOT / d / "__init__.py" for d in
                                                       ("broker", "clients", "monitoring",
                                                        "clients/gateway", "clients/bench")]:
        doc = ast.get_docstring(ast.parse(init.read_text()))
        assert doc and len(doc) > 40, f"{init.relative_to(ROOT)} has no docstring"
