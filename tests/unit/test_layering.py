"""Architecture rules that must hold everywhere (DESIGN.md, STYLE.md)."""

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _imported_modules(package: str) -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        tree = ast.parse(path.read_text(), filename=str(path))
        names: set[str] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module.split(".")[0])
        found[str(path.relative_to(ROOT))] = names
    return found


def test_scheduler_svc_source_imports_no_torch_or_triton():
    offenders = {
        path: sorted(names & {"torch", "triton", "executor_svc", "kernels", "numpy"})
        for path, names in _imported_modules("scheduler_svc").items()
        if names & {"torch", "triton", "executor_svc", "kernels", "numpy"}
    }
    assert offenders == {}


def test_importing_every_scheduler_module_loads_no_torch():
    modules = sorted(
        "scheduler_svc." + ".".join(p.relative_to(ROOT / "scheduler_svc").with_suffix("").parts)
        for p in (ROOT / "scheduler_svc").rglob("*.py")
        if p.name != "__init__.py"
    )
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


def test_domain_code_never_imports_generated_protobuf():
    allowed_edges = {"servicer", "server", "frontend", "convert", "client", "grpc_"}
    offenders = []
    for package in ("scheduler_svc", "executor_svc", "kernels"):
        for path, names in _imported_modules(package).items():
            stem = path
            if any(edge in stem for edge in allowed_edges):
                continue
            if "protos" in names or "grpc" in names or "google" in names:
                offenders.append(path)
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
