"""The Grafana dashboard only queries metrics the scheduler and the executors export. (The Kubernetes
manifests: tests/unit/test_deploy_k8s.py and test_deploy_k8s_layout.py, on `kubectl kustomize`'s
rendering.)"""

import json
import pathlib
import re

from scheduler_svc.engine.metrics import PREFIX, SchedulerMetrics, exported_metric_names

DEPLOY = pathlib.Path(__file__).resolve().parents[2] / "deploy"


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
