"""The Kubernetes overlays as `kubectl kustomize` renders them: valid against the Kubernetes schema,
every image fully qualified and overridable, every pod under the restricted Pod Security Standard,
and a second copy (nameSuffix) independent of the first."""

from __future__ import annotations

import copy
import re

import pytest

from tests.helpers.kustomize import K8S, OVERLAYS, container, expanded_args, find, one, pod_templates, render
from tests.helpers.kustomize import render_overlay_of as render_on

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

K8S_VERSION = "1.33"  # preStop `sleep` needs >= 1.30; native gRPC probes >= 1.24
DIRECTORIES = {"base": K8S / "base", **{name: K8S / "overlays" / name for name in OVERLAYS}}
CRDS = {"monitoring.coreos.com/v1": "ServiceMonitor", "leaderworkerset.x-k8s.io/v1": "LeaderWorkerSet"}
# registry host (a dot or a port, or localhost) / path : tag, or @sha256:digest
QUALIFIED_IMAGE = re.compile(
    r"^(?:[a-z0-9-]+(?:\.[a-z0-9-]+)+|localhost|[a-z0-9-]+:\d+)(?::\d+)?/[a-z0-9._/-]+"
    r"(?::[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}|@sha256:[0-9a-f]{64})$"
)
RESTRICTED_VOLUME_TYPES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
                           "persistentVolumeClaim", "projected", "secret"}
CACHE_ENV = ("HOME", "XDG_CACHE_HOME", "HF_HOME")  # and on executors the kernel caches
EXECUTOR_CACHE_ENV = ("TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_every_overlay_renders_and_validates_against_the_kubernetes_schema(name):
    docs = render(DIRECTORIES[name])
    kinds = sorted(d["kind"] for d in docs)
    for doc in docs:
        if doc["apiVersion"] in CRDS:  # no upstream schema: their structure is checked below
            assert doc["kind"] == CRDS[doc["apiVersion"]]
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for owner, template in pod_templates(docs):  # a CRD's pod templates validate as PodTemplates
        if owner.startswith("LeaderWorkerSet"):
            pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"},
                            "template": template}
            kubernetes_validate.validate(pod_template, K8S_VERSION, strict=True)
    for kind in ("ConfigMap", "Service", "NetworkPolicy", "PodDisruptionBudget", "ServiceMonitor"):
        assert kind in kinds, (name, kind)
    print(f"{name}: {len(docs)} resources valid ({', '.join(kinds)})")


def _images(docs: list[dict]) -> dict[str, str]:
    return {f"{owner} {c['name']}": c["image"] for owner, t in pod_templates(docs)
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])}


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_every_container_image_is_fully_qualified(name):
    images = _images(render(DIRECTORIES[name]))
    assert images
    for where, image in images.items():
        assert QUALIFIED_IMAGE.match(image), f"{name}: {where} has the unqualified image {image!r}"


def test_image_check_catches_unqualified_images():
    for bad in ("pagedserve-scheduler", "pagedserve/scheduler:1", "ghcr.io/pagedserve/scheduler",
                "ghcr.io/pagedserve/scheduler:latest@sha256:abc"):
        assert not QUALIFIED_IMAGE.match(bad), bad
    for good in ("ghcr.io/pagedserve/scheduler:0.1.0", "localhost:5000/x:1", "registry.example.com/a/b:c",
                 "ghcr.io/x@sha256:" + "0" * 64):
        assert QUALIFIED_IMAGE.match(good), good


def test_images_are_set_once_in_the_base_and_an_overlay_overrides_them(tmp_path):
    base = _images(render(DIRECTORIES["base"]))
    assert set(base.values()) == {"ghcr.io/pagedserve/scheduler:0.1.0", "ghcr.io/pagedserve/executor:0.1.0"}
    example = _images(render(DIRECTORIES["example"]))
    assert set(example.values()) == {"registry.example.com/pagedserve/scheduler:0.1.0",
                                     "registry.example.com/pagedserve/executor:0.1.0"}
    # the front-end container runs the scheduler's image, and follows an override of it
    frontend = _images(render(DIRECTORIES["api-frontend"]))
    assert set(frontend.values()) == set(base.values())
    digest = "sha256:" + "1" * 64
    override = ("images:\n- {name: ghcr.io/pagedserve/scheduler, newName: my.registry/s, newTag: '2'}\n"
                f"- {{name: ghcr.io/pagedserve/executor, newName: my.registry/e, digest: {digest}}}\n")
    overridden = _images(render_on(tmp_path / "fe", DIRECTORIES["api-frontend"], override))
    assert sorted(overridden.values()) == [f"my.registry/e@{digest}", "my.registry/s:2", "my.registry/s:2"]
    multi_node = _images(render_on(tmp_path / "mn", DIRECTORIES["multi-node"], override))
    assert any(k.startswith("LeaderWorkerSet") for k in multi_node)
    assert set(multi_node.values()) == {f"my.registry/e@{digest}", "my.registry/s:2"}


def restricted_violations(template: dict) -> list[str]:
    """What of the restricted Pod Security Standard (and no service-account token) a pod misses."""
    spec = template["spec"]
    pod_sc = spec.get("securityContext", {})
    problems = []
    if spec.get("automountServiceAccountToken") is not False:
        problems.append("automountServiceAccountToken is not false")
    for host in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(host):
            problems.append(host)
    for volume in spec.get("volumes", []):
        kinds = set(volume) - {"name"}
        if not kinds <= RESTRICTED_VOLUME_TYPES:
            problems.append(f"volume {volume['name']} of type {kinds - RESTRICTED_VOLUME_TYPES}")
    if pod_sc.get("runAsUser") == 0:
        problems.append("pod runAsUser 0")
    for c in spec["containers"] + spec.get("initContainers", []):
        sc = c.get("securityContext", {})
        name = c["name"]
        if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is not True:
            problems.append(f"{name}: runAsNonRoot")
        if not sc.get("runAsUser", pod_sc.get("runAsUser")):
            problems.append(f"{name}: runAsUser (non-zero) missing")
        seccomp = sc.get("seccompProfile", pod_sc.get("seccompProfile", {}))
        if seccomp.get("type") not in ("RuntimeDefault", "Localhost"):
            problems.append(f"{name}: seccompProfile RuntimeDefault")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: readOnlyRootFilesystem is not true")
        capabilities = sc.get("capabilities", {})
        if "ALL" not in capabilities.get("drop", []):
            problems.append(f"{name}: capabilities do not drop ALL")
        if set(capabilities.get("add", [])) - {"NET_BIND_SERVICE"}:
            problems.append(f"{name}: capabilities added")
        if any("hostPort" in p for p in c.get("ports", [])):
            problems.append(f"{name}: hostPort")
        problems += _unwritable_paths(c, spec)
    return problems


def _unwritable_paths(c: dict, spec: dict) -> list[str]:
    """With a read-only root, /tmp and every cache directory must lie on a writable emptyDir."""
    empty_dirs = {v["name"] for v in spec.get("volumes", []) if "emptyDir" in v}
    writable = [m["mountPath"] for m in c.get("volumeMounts", [])
                if m["name"] in empty_dirs and not m.get("readOnly")]
    env = {e["name"]: e.get("value", "") for e in c.get("env", [])}
    wanted = {"/tmp": "/tmp", **{name: env.get(name, "") for name in CACHE_ENV}}
    if c["name"] == "executor":
        wanted |= {name: env.get(name, "") for name in EXECUTOR_CACHE_ENV}
    return [f"{c['name']}: {what} ({path or 'unset'}) is not on a writable emptyDir"
            for what, path in wanted.items()
            if not any(path == w or path.startswith(w.rstrip("/") + "/") for w in writable)]


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_every_pod_meets_the_restricted_pod_security_standard(name):
    templates = list(pod_templates(render(DIRECTORIES[name])))
    assert len(templates) >= 2
    for owner, template in templates:
        assert restricted_violations(template) == [], f"{name}: {owner}"


def test_restricted_check_catches_each_missing_field():
    _, template = next(pod_templates(render(DIRECTORIES["example"])))
    assert restricted_violations(template) == []
    mutations = {
        "automountServiceAccountToken": lambda s, c: s.pop("automountServiceAccountToken"),
        "runAsNonRoot": lambda s, c: s["securityContext"].pop("runAsNonRoot"),
        "runAsUser": lambda s, c: s["securityContext"].pop("runAsUser"),
        "seccompProfile": lambda s, c: s["securityContext"].pop("seccompProfile"),
        "allowPrivilegeEscalation": lambda s, c: c["securityContext"].pop("allowPrivilegeEscalation"),
        "readOnlyRootFilesystem": lambda s, c: c["securityContext"].pop("readOnlyRootFilesystem"),
        "capabilities": lambda s, c: c["securityContext"]["capabilities"].update(drop=[]),
        "/tmp": lambda s, c: c.update(
            volumeMounts=[m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]),
        "HOME": lambda s, c: c.update(env=[e for e in c["env"] if e["name"] != "HOME"]),
        "hostPath": lambda s, c: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    }
    for what, mutate in mutations.items():
        broken = copy.deepcopy(template)
        mutate(broken["spec"], broken["spec"]["containers"][0])
        assert any(what in p for p in restricted_violations(broken)), what


def _selectors(doc: dict) -> list[dict]:
    """Every label selector of a resource (matchLabels form)."""
    spec = doc.get("spec", {})
    if doc["kind"] == "Service":
        return [spec["selector"]] if "selector" in spec else []
    if doc["kind"] in ("Deployment", "StatefulSet", "PodDisruptionBudget", "ServiceMonitor"):
        return [spec["selector"]["matchLabels"]]
    if doc["kind"] == "NetworkPolicy":
        peers = [p["podSelector"]["matchLabels"] for rule in spec.get("ingress", [])
                 for p in rule.get("from", []) if "podSelector" in p and "namespaceSelector" not in p]
        return [spec["podSelector"]["matchLabels"], *peers]
    return []


INSTANCE = "app.kubernetes.io/instance"


def test_a_second_copy_with_a_name_suffix_is_independent_of_the_first():
    first, second = render(DIRECTORIES["example"]), render(DIRECTORIES["copy-b"])
    names_a = {(d["kind"], d["metadata"]["name"]) for d in first}
    names_b = {(d["kind"], d["metadata"]["name"]) for d in second}
    assert len(names_b) == len(second) and not names_a & names_b  # nothing collides in the namespace
    for docs, instance in ((first, "pagedserve"), (second, "pagedserve-b")):
        assert one(docs, "Service", instance)  # the public Service names the copy
        for doc in docs:
            assert doc["metadata"]["labels"][INSTANCE] == instance, doc["metadata"]["name"]
            for selector in _selectors(doc):
                assert selector.get(INSTANCE) == instance, (doc["kind"], doc["metadata"]["name"], selector)
        for owner, template in pod_templates(docs):
            assert template["metadata"]["labels"][INSTANCE] == instance, owner
        _assert_refers_only_to_its_own_resources(docs)


def _assert_refers_only_to_its_own_resources(docs: list[dict]) -> None:
    names = {(d["kind"], d["metadata"]["name"]) for d in docs}
    for owner, template in pod_templates(docs):
        for volume in template["spec"].get("volumes", []):
            if "configMap" in volume:
                assert ("ConfigMap", volume["configMap"]["name"]) in names, owner
            if "secret" in volume and any(k == "Secret" for k, _ in names):
                assert ("Secret", volume["secret"]["secretName"]) in names, owner
    statefulsets = find(docs, "StatefulSet")
    for statefulset in statefulsets:
        assert ("Service", statefulset["spec"]["serviceName"]) in names
    scheduler = container(one(docs, "Deployment")["spec"]["template"], "scheduler")
    executors = expanded_args(scheduler)[expanded_args(scheduler).index("--executors") + 1]
    executor_service = next(e["value"] for e in scheduler["env"] if e["name"] == "EXECUTOR_SERVICE")
    assert ("Service", executor_service) in names or ("LeaderWorkerSet", executor_service) in names
    assert all(t.split(":")[0].endswith(executor_service) for t in executors.split(","))


@pytest.mark.parametrize("overlay", ["base", "api-frontend", "multi-node"])
def test_any_overlay_can_be_copied_with_a_name_suffix(tmp_path, overlay):
    docs = render_on(tmp_path, DIRECTORIES[overlay], "nameSuffix: -c\n")
    assert all(d["metadata"]["name"].endswith("-c") or "-c-" in d["metadata"]["name"] for d in docs)
    for doc in docs:
        for selector in _selectors(doc):
            assert selector.get(INSTANCE) == "pagedserve-c", (doc["kind"], doc["metadata"]["name"])
    for owner, template in pod_templates(docs):
        assert template["metadata"]["labels"][INSTANCE] == "pagedserve-c", owner
    _assert_refers_only_to_its_own_resources(docs)
    scheduler = container(one(docs, "Deployment")["spec"]["template"], "scheduler")
    assert all("pagedserve-executor-c" in t for t in
               expanded_args(scheduler)[expanded_args(scheduler).index("--executors") + 1].split(","))


def test_the_readme_walkthrough_renders_what_it_applies():
    """Every `kubectl kustomize` / `kubectl apply -k` of deploy/README.md names a folder that renders,
    and every overlay folder is in the README and in this suite."""
    readme = (K8S.parent / "README.md").read_text()
    applied = set(re.findall(r"kubectl (?:kustomize|apply -k) (deploy/k8s/\S+)", readme))
    assert {f"deploy/k8s/overlays/{name}" for name in ("example", "copy-b", "multi-node")} <= applied
    for path in applied:
        assert render(K8S.parents[1] / path), path
    folders = {p.name for p in (K8S / "overlays").iterdir() if (p / "kustomization.yaml").exists()}
    assert folders == set(OVERLAYS)
    assert all(f"`k8s/overlays/{name}`" in readme for name in folders)
