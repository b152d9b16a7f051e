"""Architecture rules that must hold everywhere (docs/architecture.md, DESIGN.md, STYLE.md).

The import graph is read from the source (every `import` statement, at module level, inside
functions and under `if TYPE_CHECKING:` alike) and checked against the table of rooms below: each
room lists the rooms it may import. A new edge outside the table, or any cycle between modules,
fails here with the offending modules named.
"""

from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
PACKAGES = ("protos", "kernels", "scheduler_svc", "executor_svc", "clients")

# room -> the rooms its modules may import (a room is a module-name prefix; the longest prefix that
# names a module decides its room). Imports inside one room are always allowed.
ALLOWED: dict[str, set[str]] = {
    "protos": set(),
    "kernels": set(),
    "scheduler_svc": set(),
    "executor_svc": set(),
    # the scheduler's rooms, bottom up: the executor contract, a request's sequences, KV policies,
    # scheduling, the asyncio engine, the two processes' gRPC edges, the simulator
    "scheduler_svc.wire": {"protos"},
    "scheduler_svc.request": {"scheduler_svc.wire"},
    "scheduler_svc.kv": {"scheduler_svc.wire", "scheduler_svc.request"},
    "scheduler_svc.sched": {"scheduler_svc.wire", "scheduler_svc.request", "scheduler_svc.kv"},
    "scheduler_svc.engine": {"scheduler_svc.wire", "scheduler_svc.request", "scheduler_svc.sched"},
    "scheduler_svc.engine.executor_client": {"protos", "scheduler_svc.wire", "scheduler_svc.engine.api"},
    "scheduler_svc.server": {
        "protos",
        "scheduler_svc.wire",
        "scheduler_svc.request",
        "scheduler_svc.sched",
        "scheduler_svc.engine",
    },
    # (its token lane makes text with the engine's own detokenizer: one implementation of it)
    "scheduler_svc.frontend": {"protos", "scheduler_svc.wire", "scheduler_svc.engine.detokenizer"},
    "scheduler_svc.sim": {
        "scheduler_svc.wire",
        "scheduler_svc.request",
        "scheduler_svc.kv",
        "scheduler_svc.sched",
    },
    # the executor's rooms, bottom up; of the scheduler it sees the wire contract only
    "executor_svc.layers": {"kernels", "executor_svc.models.config"},
    "executor_svc.models": {"kernels", "executor_svc.layers"},
    "executor_svc.runner": {"kernels", "executor_svc.layers", "executor_svc.models", "scheduler_svc.wire"},
    "executor_svc.worker": {
        "executor_svc.runner", "executor_svc.models", "executor_svc.layers", "scheduler_svc.wire"
    },
    "executor_svc.server": {
        "protos",
        "executor_svc.worker",
        "executor_svc.runner",
        "executor_svc.models",
        "scheduler_svc.wire",
    },
    # the client library: grpc and the generated stubs only
    "clients": {"protos"},
    # the command line and the benchmarks start and drive whole stacks in-process
    "clients.cli": {"protos", "clients", "scheduler_svc", "executor_svc", "kernels"},
    "clients.bench": {"protos", "clients", "scheduler_svc", "executor_svc", "kernels"},
}

# Modules that may import grpc / protobuf: the gRPC edges. Domain code never sees a `*_pb2`.
GRPC_EDGES = (
    "protos",
    "scheduler_svc.wire.convert",
    "scheduler_svc.wire.grpc_serving",
    "scheduler_svc.wire.request_decoding",
    "scheduler_svc.engine.executor_client",
    "scheduler_svc.server",
    "scheduler_svc.frontend",
    "executor_svc.server",
    "clients",
)
FORBIDDEN_IN_SCHEDULER = {"torch", "triton", "numpy", "transformers", "executor_svc", "kernels"}


def module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def read_imports(packages: Iterable[str] = PACKAGES) -> dict[str, set[str]]:
    """module -> every module name it imports (project modules resolved to the deepest one named)."""
    paths = [p for pkg in packages for p in (ROOT / pkg).rglob("*.py") if "_pb2" not in p.name]
    modules = {module_name(p) for p in paths}
    graph: dict[str, set[str]] = {}
    for path in paths:
        name = module_name(path)
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                target = _resolve(name, path.name == "__init__.py", node)
                imported.add(target)
                imported.update(f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules)
        graph[name] = {m for m in imported if m and m != name}
    return graph


def room_of(module: str) -> str | None:
    best = None
    for room in ALLOWED:
        if (module == room or module.startswith(room + ".")) and (best is None or len(room) > len(best)):
            best = room
    return best


def _within(module: str, rooms: Iterable[str]) -> bool:
    return any(module == r or module.startswith(r + ".") for r in rooms)


def layering_violations(graph: Mapping[str, set[str]]) -> list[str]:
    found = []
    for module, imported in sorted(graph.items()):
        room = room_of(module)
        assert room is not None, f"{module} belongs to no room of the table: add it"
        for target in sorted(imported):
            if target.split(".")[0] not in PACKAGES or room_of(target) == room:
                continue
            if not _within(target, ALLOWED[room]):
                found.append(f"{module} -> {target}")
    return found


def find_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in graph:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(cycles)


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return read_imports()


def test_every_import_follows_the_table_of_rooms(graph):
    assert layering_violations(graph) == []


def test_the_import_graph_has_no_cycle(graph):
    assert find_cycles(graph) == []


def test_the_checks_catch_a_violation_and_a_cycle():
    bad = {
        "executor_svc.worker.worker": {"scheduler_svc.sched.scheduler"},  # executor beyond the wire
        "clients.client": {"scheduler_svc.engine.engine"},  # the library beyond grpc / protos
        "scheduler_svc.kv.block_manager": {"scheduler_svc.sched.scheduler"},  # upward
        "scheduler_svc.sched.scheduler": {"scheduler_svc.kv.block_manager"},
    }
    assert layering_violations(bad) == [
        "clients.client -> scheduler_svc.engine.engine",
        "executor_svc.worker.worker -> scheduler_svc.sched.scheduler",
        "scheduler_svc.kv.block_manager -> scheduler_svc.sched.scheduler",
    ]
    assert find_cycles(bad) == [["scheduler_svc.kv.block_manager", "scheduler_svc.sched.scheduler"]]


def test_scheduler_svc_source_imports_no_torch_or_triton(graph):
    offenders = {
        module: sorted({m.split(".")[0] for m in imported} & FORBIDDEN_IN_SCHEDULER)
        for module, imported in graph.items()
        if module.startswith("scheduler_svc") and {m.split(".")[0] for m in imported} & FORBIDDEN_IN_SCHEDULER
    }
    assert offenders == {}


def test_importing_every_scheduler_module_loads_no_torch(graph):
    modules = sorted(m for m in graph if m.startswith("scheduler_svc.") and not m.endswith("__main__"))
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton'))\n"
        "assert not bad, bad\n"
        "print(len(bad))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "0"


def test_the_launcher_and_the_client_library_load_no_torch():
    """`pagedserve serve` builds the executors' flags from their configs without importing torch
    (a second of start-up), and the client library never needs it."""
    code = (
        "import sys\n"
        "import clients, clients.cli.serve, clients.cli.generate\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'triton')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_domain_code_never_imports_generated_protobuf(graph):
    offenders = sorted(
        module
        for module, imported in graph.items()
        if not _within(module, GRPC_EDGES)
        and any(m.split(".")[0] in ("protos", "grpc", "google") for m in imported)
    )
    assert offenders == []


def test_transformers_does_not_take_our_kernels_package_for_the_pypi_one():
    code = (
        "from transformers.utils.import_utils import is_kernels_available\n"
        "print(is_kernels_available())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "False"


def test_ruff_finds_nothing():
    ruff = shutil.which("ruff") or str(pathlib.Path(sys.executable).with_name("ruff"))
    if not pathlib.Path(ruff).exists():
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    out = subprocess.run([ruff, "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
