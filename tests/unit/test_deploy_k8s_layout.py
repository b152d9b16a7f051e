"""What the rendered overlays run and how the pieces agree: a tensor-parallel group is one executor
pod with N GPUs (the LeaderWorkerSet overlay: one set over several pods), the scheduler is given
the group's N ranks, the probes and grace periods cover the servers' own timeouts, every pod has a
disruption budget, Prometheus finds every /metrics port, the NetworkPolicy opens only what is used,
and the executor credential comes read-only from a Secret. The servers' configs are parsed with the
servers' own flag parsers."""

from __future__ import annotations

import argparse
import json
import pathlib

import pytest

from tests.helpers import kustomize
from tests.helpers.kustomize import K8S, OVERLAYS, config_files, container, expanded_args, find, one

pytest.importorskip("yaml")

DIRECTORIES = {"base": K8S / "base", **{name: K8S / "overlays" / name for name in OVERLAYS}}
SINGLE_POD_GROUPS = ("base", "example", "api-frontend", "copy-b")
TOKEN_DIR = "/var/run/pagedserve/executor-token"


def render(name: str) -> list[dict]:
    return kustomize.render(DIRECTORIES[name])


def _with_configs(args: list[str], docs: list[dict], tmp_path: pathlib.Path) -> list[str]:
    """`args` with /etc/pagedserve/X.json pointing at a copy of the rendered ConfigMap's file."""
    out = []
    for arg in args:
        if arg.startswith("/etc/pagedserve/"):
            name = arg.rsplit("/", 1)[1]
            (tmp_path / name).write_text(config_files(docs)[name])
            arg = str(tmp_path / name)
        out.append(arg)
    return out


def scheduler_options(docs: list[dict], tmp_path: pathlib.Path):
    from scheduler_svc.server.main import ServeOptions, build_parser
    from scheduler_svc.wire.options import from_args, parse_args_with_config

    c = container(one(docs, "Deployment")["spec"]["template"], "scheduler")
    argv = _with_configs(expanded_args(c), docs, tmp_path)
    return from_args(ServeOptions, parse_args_with_config(build_parser(), argv))


def executor_options(template: dict, docs: list[dict], tmp_path: pathlib.Path):
    from executor_svc.server.main import ExecutorOptions, add_arguments
    from scheduler_svc.wire.options import from_args, parse_args_with_config

    c = container(template, "executor")
    assert c["command"] == ["python", "-m", "executor_svc.server.group"]  # one process per GPU
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    argv = _with_configs(expanded_args(c), docs, tmp_path)
    return argv, from_args(ExecutorOptions, parse_args_with_config(parser, argv))


def _gpus(c: dict) -> int:
    limits, requests = c["resources"]["limits"], c["resources"]["requests"]
    assert limits["nvidia.com/gpu"] == requests["nvidia.com/gpu"]
    return int(limits["nvidia.com/gpu"])


def _ports(c: dict) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in c["ports"]}


def _budget_s(probe: dict) -> int:
    period, failures = probe.get("periodSeconds", 10), probe.get("failureThreshold", 3)
    return period * failures + probe.get("initialDelaySeconds", 0)


@pytest.mark.parametrize("name", SINGLE_POD_GROUPS)
def test_a_tensor_parallel_group_is_one_executor_pod_whose_ranks_the_scheduler_is_given(name, tmp_path):
    from executor_svc.server.group import rank_processes

    docs = render(name)
    statefulset = one(docs, "StatefulSet")
    assert statefulset["spec"]["replicas"] == 1  # one group pod, never two at once
    template = statefulset["spec"]["template"]
    argv, executor = executor_options(template, docs, tmp_path)
    size = executor.world_size
    assert size == _gpus(container(template, "executor")) == (2 if name in ("example", "copy-b") else 1)
    ports = _ports(container(template, "executor"))
    assert ports == {**{f"grpc-r{r}": executor.port + r for r in range(size)},
                     **{f"metrics-r{r}": executor.metrics_port + r for r in range(size)}}
    service = one(docs, "Service", statefulset["spec"]["serviceName"])
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == ports
    scheduler = scheduler_options(docs, tmp_path)
    host = service["metadata"]["name"]
    assert list(scheduler.executors) == [f"{host}:{executor.port + r}" for r in range(size)]
    # the group starts exactly these ranks in the pod, meeting on loopback
    ranks = rank_processes(argv, executor, environ={})
    assert [r.rank for r in ranks] == list(range(size))
    assert [r.env["LOCAL_RANK"] for r in ranks] == [str(r) for r in range(size)]


def test_the_multi_node_overlay_is_one_leaderworkerset_group(tmp_path):
    from executor_svc.server.group import rank_processes

    docs = render("multi-node")
    assert not find(docs, "StatefulSet") and not find(docs, "Service", "pagedserve-executor")
    lws = one(docs, "LeaderWorkerSet")
    assert lws["apiVersion"] == "leaderworkerset.x-k8s.io/v1" and lws["spec"]["replicas"] == 1
    group = lws["spec"]["leaderWorkerTemplate"]
    assert group["restartPolicy"] == "RecreateGroupOnPodRestart"  # a set is restarted whole
    assert "leaderTemplate" not in group  # the leader is a worker like the others (worker index 0)
    template = group["workerTemplate"]
    c = container(template, "executor")
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert not {"LWS_LEADER_ADDRESS", "LWS_GROUP_SIZE", "LWS_WORKER_INDEX"} & set(env)  # injected by LWS
    assert int(env["MASTER_PORT"]) == _ports(c)["dist"]
    argv, executor = executor_options(template, docs, tmp_path)
    pods, gpus = group["size"], _gpus(c)
    assert executor.world_size == pods * gpus == 8
    name = lws["metadata"]["name"]
    # every pod of the group: its ranks, GPUs and the leader's rendezvous, from LWS's environment
    seen = []
    for index in range(pods):
        lws_env = {"LWS_GROUP_SIZE": str(pods), "LWS_WORKER_INDEX": str(index),
                   "LWS_LEADER_ADDRESS": f"{name}-0.{name}.llm", "MASTER_PORT": env["MASTER_PORT"]}
        ranks = rank_processes(argv, executor, environ=lws_env)
        assert [r.env["LOCAL_RANK"] for r in ranks] == [str(g) for g in range(gpus)]
        assert all(f"{name}-0.{name}.llm:{env['MASTER_PORT']}" in r.argv for r in ranks)
        seen += [r.rank for r in ranks]
    assert seen == list(range(executor.world_size))
    scheduler = scheduler_options(docs, tmp_path)
    hosts = [f"{name}-0.{name}"] + [f"{name}-0-{w}.{name}" for w in range(1, pods)]  # LWS's pod names
    assert list(scheduler.executors) == [f"{h}:{executor.port + g}" for h in hosts for g in range(gpus)]
    ports = _ports(c)
    metrics = one(docs, "Service", "pagedserve-executor-metrics")
    assert {p["name"] for p in metrics["spec"]["ports"]} == {f"metrics-r{g}" for g in range(gpus)}
    assert all(ports[f"grpc-r{g}"] == executor.port + g for g in range(gpus))


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_executor_pods_ask_for_gpu_nodes(name):
    docs = render(name)
    executors = [(o, t) for o, t in kustomize.pod_templates(docs)
                 if t["metadata"]["labels"]["app.kubernetes.io/name"] == "pagedserve-executor"]
    assert executors
    for owner, template in executors:
        spec = template["spec"]
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, owner
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
        assert _gpus(container(template, "executor")) >= 1
        assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in spec["volumes"])  # /dev/shm


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_probe_and_grace_budgets_cover_the_servers_own_timeouts(name, tmp_path):
    from executor_svc.server.group import STOP_TIMEOUT_S

    docs = render(name)
    scheduler = scheduler_options(docs, tmp_path)
    pod = one(docs, "Deployment")["spec"]["template"]
    c = container(pod, "scheduler")
    # The scheduler answers its probes only once every rank answered (up to connect_timeout_s).
    assert _budget_s(c["startupProbe"]) >= scheduler.connect_timeout_s + 60
    assert c["startupProbe"]["grpc"]["port"] == c["readinessProbe"]["grpc"]["port"] == scheduler.port
    for _, template in kustomize.pod_templates(docs):
        if template is pod:
            continue
        executor = container(template, "executor")
        # the scheduler waits for the ranks at least as long as Kubernetes lets them start
        assert _budget_s(executor["startupProbe"]) <= scheduler.connect_timeout_s
        assert template["spec"]["terminationGracePeriodSeconds"] > STOP_TIMEOUT_S
    pre_stop = max(x["lifecycle"]["preStop"]["sleep"]["seconds"] for x in pod["spec"]["containers"])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= scheduler.drain_grace_period_s + pre_stop + 10
    if name == "api-frontend":
        from scheduler_svc.frontend.main import parse_args as parse_frontend_args

        frontend_c = container(pod, "frontend")
        frontend = parse_frontend_args(_with_configs(expanded_args(frontend_c), docs, tmp_path))
        assert frontend.engine == f"127.0.0.1:{scheduler.port}"
        assert frontend.connect_timeout_s >= _budget_s(c["startupProbe"])  # waits out the scheduler's start
        assert _budget_s(frontend_c["startupProbe"]) >= frontend.connect_timeout_s + 30
        assert frontend.drain_grace_period_s == scheduler.drain_grace_period_s
        service = one(docs, "Service", "pagedserve")
        grpc = next(p for p in service["spec"]["ports"] if p["name"] == "grpc")
        assert _ports(frontend_c).get(grpc["targetPort"]) == frontend.port
        ports = [p["containerPort"] for x in pod["spec"]["containers"] for p in x["ports"]]
        assert len(ports) == len(set(ports))


def _matches(selector: dict, labels: dict) -> bool:
    expressions = selector.get("matchExpressions", [])
    assert all(e["operator"] == "In" for e in expressions)
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        labels.get(e["key"]) in e["values"] for e in expressions)


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_every_pod_has_a_disruption_budget(name):
    docs = render(name)
    budgets = find(docs, "PodDisruptionBudget")
    for owner, template in kustomize.pod_templates(docs):
        covering = [b for b in budgets if _matches(b["spec"]["selector"], template["metadata"]["labels"])]
        assert len(covering) == 1, owner
        assert covering[0]["spec"]["maxUnavailable"] == 0
        assert covering[0]["spec"]["unhealthyPodEvictionPolicy"] == "AlwaysAllow"


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_the_servicemonitor_is_selected_by_kube_prometheus_stack_and_scrapes_every_metrics_port(name):
    docs = render(name)
    monitor = one(docs, "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    selector = monitor["spec"]["selector"]
    selected = [s for s in find(docs, "Service") if _matches(selector, s["metadata"]["labels"])]
    metrics_ports = {p["name"] for s in selected for p in s["spec"]["ports"]
                     if p["name"].startswith("metrics")}
    scraped = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert metrics_ports == scraped
    container_metrics = {p["name"] for _, t in kustomize.pod_templates(docs) for c in t["spec"]["containers"]
                         for p in c.get("ports", []) if p["name"].startswith("metrics")}
    assert container_metrics == scraped  # every rank's and the scheduler's /metrics


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_the_network_policy_opens_only_what_is_used(name):
    docs = render(name)
    instance = one(docs, "Deployment")["metadata"]["labels"]["app.kubernetes.io/instance"]
    policies = {p["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"]: p
                for p in find(docs, "NetworkPolicy")}
    executor_rules = policies["pagedserve-executor"]["spec"]["ingress"]
    assert all(rule.get("from") for rule in executor_rules)  # never open to everyone
    by_peer = {}
    for rule in executor_rules:
        peer = rule["from"][0]
        by_peer[peer["podSelector"]["matchLabels"]["app.kubernetes.io/name"]] = (peer, rule["ports"])
    assert set(by_peer) == {"pagedserve-scheduler", "pagedserve-executor", "prometheus"}
    for peer in ("pagedserve-scheduler", "pagedserve-executor"):  # this copy's pods only
        assert by_peer[peer][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"] == instance
        assert "namespaceSelector" not in by_peer[peer][0]
    # the group's pods: every TCP port (rendezvous and NCCL's ephemeral ports), and nothing but TCP
    assert by_peer["pagedserve-executor"][1] == [{"protocol": "TCP"}]

    def covered(rules: list[dict], port: int) -> bool:
        return any(r["port"] <= port <= r.get("endPort", r["port"]) for r in rules)

    for _, template in kustomize.pod_templates(docs):
        if template["metadata"]["labels"]["app.kubernetes.io/name"] != "pagedserve-executor":
            continue
        for port_name, port in _ports(container(template, "executor")).items():
            if port_name.startswith("grpc"):
                assert covered(by_peer["pagedserve-scheduler"][1], port)
                assert not covered(by_peer["prometheus"][1], port)
            if port_name.startswith("metrics"):
                assert covered(by_peer["prometheus"][1], port)
                assert not covered(by_peer["pagedserve-scheduler"][1], port)
    scheduler_rules = policies["pagedserve-scheduler"]["spec"]["ingress"]
    open_rules = [r for r in scheduler_rules if not r.get("from")]
    assert [p["port"] for r in open_rules for p in r["ports"]] == [50051]  # the public API only


@pytest.mark.parametrize("name", list(DIRECTORIES))
def test_the_executor_credential_is_mounted_read_only_from_a_secret(name, tmp_path):
    docs = render(name)
    scheduler = scheduler_options(docs, tmp_path)
    assert scheduler.executor_token_file == f"{TOKEN_DIR}/token"
    secrets = set()
    for owner, template in kustomize.pod_templates(docs):
        volumes = {v["name"]: v for v in template["spec"]["volumes"]}
        for c in template["spec"]["containers"]:
            mounts = [m for m in c.get("volumeMounts", []) if m["mountPath"] == TOKEN_DIR]
            if c["name"] == "frontend":
                assert not mounts  # the front-end never talks to the executors
                continue
            assert len(mounts) == 1 and mounts[0]["readOnly"] is True, (owner, c["name"])
            volume = volumes[mounts[0]["name"]]
            assert set(volume) == {"name", "secret"} and volume["secret"]["defaultMode"] == 0o440
            secrets.add(volume["secret"]["secretName"])
            if c["name"] == "executor":
                _, executor = executor_options(template, docs, tmp_path)
                assert executor.executor_token_file == f"{TOKEN_DIR}/token"
    assert len(secrets) == 1  # the scheduler and the executors share one credential
    generated = find(docs, "Secret")
    if name == "base":  # production: the operator creates the Secret (deploy/README.md)
        assert not generated and secrets == {"pagedserve-executor-token"}
    else:  # the example overlays generate one from a file, named by its content's hash
        assert [s["metadata"]["name"] for s in generated] == list(secrets)
        assert set(generated[0]["data"]) == {"token"}


def test_every_engine_config_parses_with_the_servers_flags(tmp_path):
    for name in DIRECTORIES:
        data = config_files(render(name))
        for key, text in data.items():
            assert isinstance(json.loads(text), dict), (name, key)
        assert set(data) == ({"scheduler.json", "executor.json", "frontend.json"} if name == "api-frontend"
                             else {"scheduler.json", "executor.json"})


def test_executors_profile_for_the_steps_their_scheduler_sends():
    """The executor sizes its KV cache after profiling the largest step (max_num_batched_tokens
    tokens, max_num_seqs sampled rows): its limits must be the scheduler's, or a big step runs out of
    GPU memory."""
    for name in DIRECTORIES:
        data = config_files(render(name))
        scheduler, executor = json.loads(data["scheduler.json"]), json.loads(data["executor.json"])
        for key in ("max_num_seqs", "max_num_batched_tokens"):
            assert executor.get(key) == scheduler.get(key), (name, key)
