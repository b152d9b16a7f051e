"""The Kubernetes manifests as `kubectl kustomize` renders them (the deploy tests read only rendered
output: what `kubectl apply -k` would send), and what the tests look up in them."""

from __future__ import annotations

import functools
import os
import pathlib
import re
import shutil
import subprocess
from collections.abc import Iterator

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
OVERLAYS = ("example", "api-frontend", "copy-b", "multi-node")
POD_OWNERS = ("Deployment", "StatefulSet")  # kinds whose spec.template is a pod template
_ENV_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def kubectl() -> str:
    """kubectl's path; skips the test, saying why, where it is not installed."""
    path = shutil.which("kubectl")
    if path is None:
        pytest.skip("kubectl not found: the deploy tests render the overlays with `kubectl kustomize`")
    return path


@functools.cache
def _render(directory: str) -> tuple[dict, ...]:
    import yaml

    done = subprocess.run([kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory} failed:\n{done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def render(directory: pathlib.Path | str) -> list[dict]:
    """The documents of `kubectl kustomize DIRECTORY` (fresh copies: tests may change them)."""
    import copy

    return copy.deepcopy(list(_render(str(directory))))


def render_overlay_of(tmp_path: pathlib.Path, base: pathlib.Path, kustomization: str) -> list[dict]:
    """Renders a kustomization written in `tmp_path` on top of `base` (given as `resources:`; kustomize
    takes relative paths only)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    relative = os.path.relpath(base, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(f"resources: [{relative}]\n{kustomization}")
    return render(tmp_path)


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} {name or ''} in the render"
    return found[0]


def pod_templates(docs: list[dict]) -> Iterator[tuple[str, dict]]:
    """(owner description, pod template) for every workload, the LeaderWorkerSet's templates included."""
    for doc in docs:
        name = f"{doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in POD_OWNERS:
            yield name, doc["spec"]["template"]
        elif doc["kind"] == "LeaderWorkerSet":
            templates = doc["spec"]["leaderWorkerTemplate"]
            yield f"{name} workerTemplate", templates["workerTemplate"]
            if "leaderTemplate" in templates:
                yield f"{name} leaderTemplate", templates["leaderTemplate"]


def container(template: dict, name: str) -> dict:
    return next(c for c in template["spec"]["containers"] if c["name"] == name)


def expanded_args(c: dict) -> list[str]:
    """The container's args with $(VAR) replaced by its env values, as the kubelet does."""
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    return [_ENV_REF.sub(lambda m: env.get(m.group(1), m.group(0)), arg) for arg in c.get("args", [])]


def config_files(docs: list[dict]) -> dict[str, str]:
    """The engine ConfigMap's files (scheduler.json, executor.json, frontend.json)."""
    maps = [d for d in find(docs, "ConfigMap") if d["metadata"]["name"].startswith("pagedserve-engine")]
    assert len(maps) == 1
    return maps[0]["data"]
