"""The Kubernetes manifests validate against the Kubernetes schemas, and the dashboard only queries
metrics the scheduler exports."""

import json
import pathlib
import re

import pytest

yaml = pytest.importorskip("yaml")
kubernetes_validate = pytest.importorskip("kubernetes_validate")

from scheduler_svc.engine.metrics import PREFIX, SchedulerMetrics, exported_metric_names  # noqa: E402

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"
K8S_VERSION = "1.33"  # preStop `sleep` needs >= 1.30; native gRPC probes >= 1.24


def _documents(path: pathlib.Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def _kustomization_resources(directory: pathlib.Path) -> list[pathlib.Path]:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    files = []
    for entry in kustomization.get("resources", []):
        target = (directory / entry).resolve()
        files += _kustomization_resources(target) if target.is_dir() else [target]
    return files


def test_every_base_resource_validates_against_kubernetes_schemas():
    files = _kustomization_resources(DEPLOY / "k8s" / "base")
    assert {f.name for f in files} == {p.name for p in (DEPLOY / "k8s" / "base").glob("*.yaml")} - {
        "kustomization.yaml"
    }
    kinds = []
    for path in files:
        for doc in _documents(path):
            kinds.append(doc["kind"])
            if doc["apiVersion"].startswith("monitoring.coreos.com/"):
                # A CRD (prometheus-operator): no upstream schema; check the fields it needs.
                assert doc["spec"]["endpoints"] and doc["spec"]["selector"]
                continue
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert sorted(kinds) == sorted(
        ["ConfigMap", "Deployment", "Service", "StatefulSet", "Service", "NetworkPolicy", "ServiceMonitor"]
    )


def test_overlay_patches_name_base_resources_and_validate():
    overlay = DEPLOY / "k8s" / "overlays" / "example"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    base_names = {
        (d["kind"], d["metadata"]["name"])
        for p in _kustomization_resources(overlay)
        for d in _documents(p)
    }
    for patch in kustomization["patches"]:
        for doc in _documents(overlay / patch["path"]):
            assert (doc["kind"], doc["metadata"]["name"]) in base_names
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    for replica in kustomization["replicas"]:
        assert ("StatefulSet", replica["name"]) in base_names


def test_engine_config_is_json_and_tensor_parallel_size_matches_executor_replicas():
    for directory, replicas in ((DEPLOY / "k8s" / "base", 1), (DEPLOY / "k8s" / "overlays" / "example", 2)):
        config_file = "configmap.yaml" if directory.name == "base" else "engine-config.yaml"
        data = _documents(directory / config_file)[0]["data"]
        scheduler, executor = json.loads(data["scheduler.json"]), json.loads(data["executor.json"])
        assert executor["tensor_parallel_size"] == replicas
        assert len(scheduler["executors"]) == replicas


def test_engine_config_keys_are_the_servers_flags(tmp_path):
    """Both JSON files of the base and the overlay parse with the real servers' `--config`."""
    import argparse

    from executor_svc.server.main import add_arguments
    from scheduler_svc.server.main import parse_args as parse_scheduler_args
    from scheduler_svc.wire.options import parse_args_with_config

    for config_file in (DEPLOY / "k8s" / "base" / "configmap.yaml",
                        DEPLOY / "k8s" / "overlays" / "example" / "engine-config.yaml"):
        data = _documents(config_file)[0]["data"]
        (tmp_path / "scheduler.json").write_text(data["scheduler.json"])
        (tmp_path / "executor.json").write_text(data["executor.json"])
        scheduler = json.loads(data["scheduler.json"])
        opts = parse_scheduler_args(["--config", str(tmp_path / "scheduler.json")])
        assert opts.executors == tuple(scheduler["executors"]) and opts.host == "0.0.0.0"
        assert opts.drain_grace_period_s == scheduler["drain_grace_period_s"]
        assert opts.metrics_port == 9400 and opts.enable_prefix_caching
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        args = parse_args_with_config(parser, ["--config", str(tmp_path / "executor.json")])
        executor = json.loads(data["executor.json"])
        assert args.world_size == executor["tensor_parallel_size"] and args.host == "0.0.0.0"
        assert (args.port, args.metrics_port, args.rank) == (50061, 9401, None)  # rank: from the pod name


def test_dashboard_queries_only_metrics_the_scheduler_and_executors_export():
    from executor_svc.server.metrics import PREFIX as EXECUTOR_PREFIX
    from executor_svc.server.metrics import exported_metric_names as executor_metric_names

    dashboard = json.loads((DEPLOY / "grafana" / "pagedserve-dashboard.json").read_text())
    exported = exported_metric_names() | executor_metric_names()
    # The names the real registry renders must be the ones exported_metric_names() promises.
    metrics = SchedulerMetrics()
    metrics.inc("preemptions", mode="swap")
    metrics.inc("requests_finished", reason="length")
    rendered = {
        line.split("{")[0].split(" ")[0]
        for line in metrics.render().decode().splitlines()
        if line and not line.startswith("#")
    }
    assert {n for n in rendered if not n.endswith("_created")} <= exported
    queried = set()
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len(panels) >= 12
    for panel in panels:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            name_pattern = r"\b(?:" + re.escape(PREFIX) + r"|process_)[a-zA-Z0-9_:]+"
            names = set(re.findall(name_pattern, target["expr"]))
            assert names, (panel["title"], target["expr"])
            assert names <= exported, (panel["title"], names - exported)
            queried |= names
    for must in ("gpu_blocks_used", "gpu_blocks_cached_free", "cpu_swap_blocks_used", "kv_usage_ratio",
                 "blocks_saved_by_sharing", "prefix_cache_hits_tokens_total", "preemptions_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
                 "cow_copies_total", "swapped_in_blocks_total", "swapped_out_blocks_total",
                 "step_kv_usage_ratio_bucket", "request_queue_time_seconds_bucket",
                 "requests_rejected_total"):
        assert PREFIX + must in queried
    for must in ("step_time_seconds_bucket", "gpu_memory_allocated_bytes", "gpu_memory_reserved_bytes",
                 "kv_cache_bytes"):
        assert EXECUTOR_PREFIX + must in queried


def _apply_json6902(doc: dict, ops: list[dict]) -> None:
    """The `replace` and `add` operations kustomize applies (enough for our patches)."""
    for op in ops:
        *parents, last = op["path"].strip("/").split("/")
        node = doc
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        if op["op"] == "add" and isinstance(node, list):
            node.append(op["value"]) if last == "-" else node.insert(int(last), op["value"])
        elif op["op"] in ("add", "replace"):
            assert op["op"] == "add" or (int(last) < len(node) if isinstance(node, list) else last in node)
            node[int(last) if isinstance(node, list) else last] = op["value"]
        else:
            raise AssertionError(f"unsupported patch op {op['op']}")


def test_api_frontend_overlay_validates_and_wires_the_frontend_to_the_scheduler(tmp_path):
    import copy

    from scheduler_svc.frontend.main import parse_args as parse_frontend_args
    from scheduler_svc.server.main import parse_args as parse_scheduler_args

    overlay = DEPLOY / "k8s" / "overlays" / "api-frontend"
    kustomization = yaml.safe_load((overlay / "kustomization.yaml").read_text())
    docs = {(d["kind"], d["metadata"]["name"]): copy.deepcopy(d)
            for p in _kustomization_resources(overlay) for d in _documents(p)}
    for patch in kustomization["patches"]:
        if "target" in patch:
            target = docs[(patch["target"]["kind"], patch["target"]["name"])]
            _apply_json6902(target, yaml.safe_load((overlay / patch["path"]).read_text()))
        else:
            for doc in _documents(overlay / patch["path"]):
                docs[(doc["kind"], doc["metadata"]["name"])]["data"].update(doc["data"])
    deployment = docs[("Deployment", "pagedserve-scheduler")]
    config = docs[("ConfigMap", "pagedserve-engine")]
    for doc in (deployment, config):
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)

    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    assert set(containers) == {"scheduler", "frontend"}
    ports = [p["containerPort"] for c in containers.values() for p in c["ports"]]
    assert len(ports) == len(set(ports))  # no port served twice in the pod
    service = docs[("Service", "pagedserve")]
    grpc_target = next(p["targetPort"] for p in service["spec"]["ports"] if p["name"] == "grpc")
    assert grpc_target in {p["name"] for p in containers["frontend"]["ports"]}  # clients reach the front-end

    (tmp_path / "scheduler.json").write_text(config["data"]["scheduler.json"])
    (tmp_path / "frontend.json").write_text(config["data"]["frontend.json"])
    scheduler = parse_scheduler_args(["--config", str(tmp_path / "scheduler.json")])
    frontend = parse_frontend_args(["--config", str(tmp_path / "frontend.json")])
    assert frontend.engine == f"127.0.0.1:{scheduler.port}" and frontend.port == 50051
    assert containers["scheduler"]["readinessProbe"]["grpc"]["port"] == scheduler.port
    assert containers["frontend"]["readinessProbe"]["grpc"]["port"] == frontend.port
    assert frontend.drain_grace_period_s == scheduler.drain_grace_period_s
