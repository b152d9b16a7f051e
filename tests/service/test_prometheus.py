"""The Grafana dashboard fills on a real Prometheus: `pagedserve serve` (scheduler and executor
/metrics) under a small load (shared prefixes, n=4, beam-4, swap preemptions, one refused request),
scraped every second by the `prometheus` binary (Debian's package; .ci/run installs it, else this
test skips and says why); then every panel query of deploy/grafana/pagedserve-dashboard.json, with
its template variables substituted, must return finite values through Prometheus's HTTP API, and
every template variable must list values. `promtool check metrics` must find nothing on either
endpoint's output."""

from __future__ import annotations

import json
import math
import pathlib
import re
import shutil
import subprocess
import threading
import time
import urllib.parse
import urllib.request

import grpc
import pytest

from clients.cli.serve import free_port
from clients.client import Client
from tests.helpers.processes import serve
from tests.helpers.wait import wait_until

DASHBOARD = pathlib.Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "pagedserve-dashboard.json"
JOBS = {"pagedserve-scheduler": "scheduler", "pagedserve-executor": "executor"}
RATE_INTERVAL = "1m"  # covers the whole load, scraped every second


def _get(url: str, timeout_s: float = 10.0) -> bytes:
    with urllib.request.urlopen(url, timeout=timeout_s) as reply:
        return reply.read()


def _api(prom: str, path: str, **params: str) -> list:
    body = json.loads(_get(f"{prom}/api/v1/{path}?{urllib.parse.urlencode(params)}"))
    assert body["status"] == "success", body
    data = body["data"]
    return data["result"] if isinstance(data, dict) else data


def _substitute(expr: str, model_name: str) -> str:
    """What Grafana sends with every variable at its default (All: the variable's allValue `.+`),
    the model variable set to the served model, $__rate_interval a minute."""
    return (expr.replace("$__rate_interval", RATE_INTERVAL).replace('"$job"', '".+"')
            .replace('"$instance"', '".+"').replace("$model_name", re.escape(model_name)))


def _load(target: str) -> None:
    """Plain requests sharing a prefix, parallel sampling, beam search, and enough concurrent
    sequences for a 24-block cache to swap; then one request the server refuses."""
    shared = [(7 * i) % 500 + 3 for i in range(40)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            with Client(target) as client:
                if i % 4 == 0:
                    client.generate([9, 8, 7, i], n=4, max_tokens=24, seed=i, ignore_eos=True)
                elif i % 4 == 1:
                    client.generate([4, 5, 6, i], beam_width=4, max_tokens=12, ignore_eos=True)
                else:
                    client.generate([*shared, i], max_tokens=48, seed=i, ignore_eos=True)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    with Client(target) as client, pytest.raises(grpc.RpcError) as refused:
        client.generate([1, 2, 3], max_tokens=10**9)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _promtool_check(metrics_url: str) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        print("promtool not installed: `promtool check metrics` skipped")
        return
    text = _get(metrics_url)
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, timeout=30)
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (metrics_url, out)


def test_every_dashboard_panel_query_returns_data_on_a_real_prometheus(tiny_llama_dir, tmp_path):
    prometheus = shutil.which("prometheus")
    if prometheus is None:
        pytest.skip("the `prometheus` binary is not installed (Debian: apt-get install prometheus; .ci/run "
                    "installs it when it runs as root): the dashboard was not checked on a real Prometheus")
    model_name = pathlib.Path(tiny_llama_dir).name
    metrics_port, executor_metrics_port, prom_port = free_port(), free_port(), free_port()
    ports = {"pagedserve-scheduler": metrics_port, "pagedserve-executor": executor_metrics_port}
    scrape_configs = "".join(
        f"  - job_name: {job}\n    static_configs:\n      - targets: ['127.0.0.1:{port}']\n"
        for job, port in ports.items())
    config = tmp_path / "prometheus.yml"
    config.write_text("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                      f"scrape_configs:\n{scrape_configs}")
    proc, public = serve(
        ["--model", str(tiny_llama_dir), "--device", "cpu", "--num-gpu-blocks", "24",
         "--num-cpu-blocks", "32", "--preemption", "swap", "--metrics-port", str(metrics_port),
         "--executor-metrics-port", str(executor_metrics_port)], tmp_path / "serve.log",
        {"PAGEDSERVE_EXECUTOR_TOKEN": "prometheus-test-token"})
    prom_log = (tmp_path / "prometheus.log").open("w")
    prom_proc = subprocess.Popen(
        [prometheus, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
         f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=prom_log, stderr=subprocess.STDOUT)
    prom = f"http://127.0.0.1:{prom_port}"
    try:
        def targets_up() -> bool:
            try:
                up = _api(prom, "query", query="up")
            except OSError:
                return False
            seen = sorted((s["metric"]["job"], s["value"][1]) for s in up)
            return seen == [(job, "1") for job in sorted(ports)]

        wait_until(targets_up, 30, 0.25, "Prometheus to scrape both /metrics")
        _load(public)
        with Client(public) as client:
            stats = client.stats()
        assert stats.num_preemptions > 0 and stats.num_swapped_out_blocks > 0, stats

        def scraped_all() -> bool:  # Prometheus has a scrape taken after the refused request, the last one
            got = _api(prom, "query", query='pagedserve_requests_rejected_total{code="INVALID_ARGUMENT"}')
            return bool(got) and float(got[0]["value"][1]) == 1

        wait_until(scraped_all, 15, 0.25, "Prometheus to scrape the end of the load")
        for port in ports.values():
            _promtool_check(f"http://127.0.0.1:{port}/metrics")

        dashboard = json.loads(DASHBOARD.read_text())
        for variable in dashboard["templating"]["list"]:
            if variable["type"] != "query":
                continue
            selector, label = re.fullmatch(r"label_values\((.*), (\w+)\)", variable["query"]).groups()
            values = _api(prom, f"label/{label}/values", **{"match[]": _substitute(selector, model_name)})
            assert values, (variable["name"], variable["query"])
        panels = [p for p in dashboard["panels"] if p["type"] != "row"]

        def empty_queries() -> list:
            empty = []
            for panel in panels:
                for target in panel["targets"]:
                    result = _api(prom, "query", query=_substitute(target["expr"], model_name))
                    values = [float(s["value"][1]) for s in result]
                    if not values or not all(math.isfinite(v) for v in values):
                        empty.append((panel["title"], target["expr"], values))
            return empty

        # The executor is scraped on its own schedule: on a busy CI machine its scrapes during the load
        # may time out, and a rate needs two of its samples around the load in the window. Give it a
        # few more scrapes before calling a panel empty (CI once saw the executor step-time quantile NaN).
        deadline = time.monotonic() + 15
        while (empty := empty_queries()) and time.monotonic() < deadline:
            time.sleep(1)
        print(f"panels with data: {len(panels) - len({title for title, *_ in empty})} / {len(panels)} "
              f"({sum(len(p['targets']) for p in panels)} queries)")
        assert not empty, empty
    finally:
        prom_proc.terminate()
        try:
            prom_proc.wait(10)
        except subprocess.TimeoutExpired:
            prom_proc.kill()
            prom_proc.wait(10)
        prom_log.close()
        proc.stop(timeout_s=30)
