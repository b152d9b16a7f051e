"""The load generator (`python -m clients.bench.loadgen`) against a real stack on loopback: 32 concurrent
clients in a closed loop over a small KV cache (so requests are preempted and recomputed), with
some requests cancelled midway; no request may be lost, fail or differ from its reference, and no
KV block may leak. Figures are printed, not asserted. PAGEDSERVE_LOADGEN_DURATION_S runs it longer."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers.stack import Stack

DURATION_S = float(os.environ.get("PAGEDSERVE_LOADGEN_DURATION_S", "8"))


def test_loadgen_32_clients_lose_and_corrupt_nothing(tiny_llama_dir):
    with Stack(tiny_llama_dir, num_gpu_blocks=48, num_cpu_blocks=0) as stack:
        out = subprocess.run(
            [sys.executable, "-m", "clients.bench.loadgen", "--server", stack.target, "--clients", "32",
             "--duration-s", str(DURATION_S), "--max-tokens", "24", "--json"],
            capture_output=True, text=True, timeout=DURATION_S + 120,
        )
        assert out.stdout, out.stderr
        report = json.loads(out.stdout)
        ms = {k: report[k] * 1000 for k in ("latency_p50_s", "latency_p99_s")}
        print(f"\nloadgen figures ({DURATION_S:g} s): {report['requests_per_s']:.1f} requests/s, "
              f"{report['output_tokens_per_s']:.0f} tokens/s, latency p50 {ms['latency_p50_s']:.0f} ms, "
              f"p99 {ms['latency_p99_s']:.0f} ms, {report['num_completed']} completed, "
              f"{report['num_cancelled']} cancelled")
        assert report["errors"] == [] and report["num_errors"] == 0
        assert report["num_mismatches"] == 0 and report["num_bad_counts"] == 0
        assert report["leaked_blocks"] == 0
        assert report["num_completed"] >= 32 and report["num_cancelled"] > 0
        assert report["ok"] and out.returncode == 0
        assert stack.engine.scheduler.num_preemptions > 0  # the small cache made it preempt
        stack.check_integrity()
