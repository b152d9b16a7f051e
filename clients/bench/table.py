"""The tables and the sweep plot `pagedserve bench` prints and draws from its results."""

from __future__ import annotations

import sys


def format_table(result: dict) -> str:
    lines = [
        f"pagedserve bench {result['mode']}: {result['model']}, {result['workload']}, "
        f"kv policy {result['kv_policy']}, n {result['n']}, beam width {result['beam_width']}"
    ]
    if result["n"] > 1 or result["beam_width"] > 1:
        lines.append("(shared = mean KV blocks saved by sharing / (used + saved) while blocks are in use)")
    head = (
        f"{'run':>12} {'reqs':>5} {'out tok/s':>10} {'req/s':>7} {'TTFT p50/p99 ms':>17} "
        f"{'TPOT p50/p99 ms':>16} {'ITL p50/p99 ms':>15} {'norm lat s/tok':>14} {'avg batch':>9} "
        f"{'KV max':>6} {'shared':>6} {'preempt':>7} {'GPU idle':>8} {'ideal':>6}"
    ) + ("  SLO" if "slo" in result else "")
    lines.append(head)
    for r in result["runs"]:
        label = r["label"] if "rate_per_s" not in r else f"{r['rate_per_s']:g}/s"
        idle = r.get("gpu_idle", {}).get("idle_fraction", float("nan"))
        ideal = r.get("ideal", {}).get("measured_over_ideal", float("nan"))
        ttft, tpot, itl = r["ttft_ms"], r["tpot_ms"], r["itl_ms"]
        slo = f"  {_verdict(r['slo'])}" if "slo" in r else ""
        lines.append(
            f"{label:>12} {r['num_requests']:>5} {r['output_tok_s']:>10.1f} {r['request_per_s']:>7.2f} "
            f"{ttft['p50']:>8.1f}/{ttft['p99']:<8.1f} {tpot['p50']:>7.2f}/{tpot['p99']:<8.2f} "
            f"{itl['p50']:>6.2f}/{itl['p99']:<8.2f} {r['normalized_latency_s_per_token']:>14.4f} "
            f"{r['avg_running_seqs']:>9.1f} {r['kv_usage']['max']:>6.1%} "
            f"{r['sharing_saving']['mean']:>6.1%} {r['preemptions']:>7} "
            f"{idle:>8.1%} {ideal:>6.2f}{slo}"
        )
        server = r.get("server")
        if server:
            slow = server["slowest_first_token"]
            lines.append(
                f"{'':>12} server side: queue p50/p99/max {server['queue_time_ms']['p50']:.1f}/"
                f"{server['queue_time_ms']['p99']:.1f}/{server['queue_time_ms']['max']:.1f} ms, TTFT p99 "
                f"{server['ttft_ms']['p99']:.1f} ms, client-server TTFT lag p99/max "
                f"{server['ttft_lag_ms']['p99']:.1f}/{server['ttft_lag_ms']['max']:.1f} ms; slowest first "
                f"token {slow['client_ttft_ms']:.1f} ms = server {slow['server_ttft_ms']:.1f} (queue "
                f"{slow['server_queue_ms']:.1f}) + lag {slow['lag_ms']:.1f}"
                + (f"; load processes {r['client_processes']}" if "client_processes" in r else "")
            )
            if "client_api_lag_ms" in server:
                ca, ae = server["client_api_lag_ms"], server["api_engine_lag_ms"]
                lines.append(
                    f"{'':>12} that lag, client to API server p50/p99/max {ca['p50']:.1f}/{ca['p99']:.1f}/"
                    f"{ca['max']:.1f} ms, API server to scheduler {ae['p50']:.1f}/{ae['p99']:.1f}/"
                    f"{ae['max']:.1f} ms"
                    + (f"; slowest first token at the API server {slow['api_ttft_ms']:.1f} ms"
                       if "api_ttft_ms" in slow else "")
                )
        full = r.get("gpu_idle", {})
        if "wall_after_last_step_ms" in full:
            lines.append(
                f"{'':>12} wall outside the steps: {full['wall_before_first_step_ms'] / 1e3:.3f} s before "
                f"the first, {full['wall_after_last_step_ms'] / 1e3:.3f} s after the last"
            )
        if "full_decode_idle_fraction" in full:
            lines.append(
                f"{'':>12} decode steps of >= {full['full_decode_batch']} seqs: "
                f"{full['num_full_decode_steps']}, GPU {full['full_decode_gpu_step_ms']:.2f} ms/step, "
                f"gap {full['full_decode_gap_ms']:.2f} ms (executor prep "
                f"{full['full_decode_executor_prep_ms']:.2f} ms): "
                f"idle {full['full_decode_idle_fraction']:.1%}"
            )
        breakdown = r.get("time_breakdown")
        if breakdown:
            serial = breakdown.get("serial_s")
            lines.append(
                f"{'':>12} GPU {breakdown['gpu_s']:.2f} s + idle {breakdown['gap_s']:.2f} s; the steps' "
                f"own ideal {breakdown['ideal_s']:.2f} s (schedule efficiency "
                f"{breakdown['schedule_efficiency']:.2f})"
                + (f", one kernel at a time {serial:.2f} s" if serial is not None else "")
            )
            for k in breakdown["kinds"]:
                serial_part = (f"  serial {k['serial_s']:>7.3f} s ({k['serial_over_gpu']:.2f})"
                               if "serial_s" in k else "")
                uneven = (f"  longest context {k['longest_over_mean']:.2f}x the mean"
                          if "longest_over_mean" in k else "")
                lines.append(
                    f"{'':>14}{k['kind']:<16} {k['steps']:>5} steps  GPU {k['gpu_s']:>7.3f} s  ideal "
                    f"{k['ideal_s']:>7.3f} s ({k['ideal_over_gpu']:.2f}){serial_part}  idle before "
                    f"{k['gap_s']:.3f} s{uneven}"
                )
    if "goodput" in result:
        lines += _goodput_lines(result)
    if "device_rates" in result:
        d = result["device_rates"]
        lines.append(
            f"ideal on {d['device']}: copy {d['copy_tb_s']} TB/s, bf16 matmul {d['matmul_tflop_s']} TFLOP/s; "
            "'ideal' column = ideal time / measured time"
        )
    for p in result.get("peers", []):
        lines.append(
            f"{p['peer']} on the first {p['num_requests']} requests: {p['output_tok_s']:.1f} out tok/s; "
            f"ours on the same requests {p['ours_output_tok_s']:.1f}: ratio {p['ratio']:.2f}x"
        )
        if p["num_requests"] < result["requests"]:
            lines.append(
                f"{'':>4}ours on all {result['requests']} requests {p['ours_all_output_tok_s']:.1f} "
                f"out tok/s: {p['ratio_ours_all']:.2f}x {p['peer']}'s rate on its {p['num_requests']}"
            )
    return "\n".join(lines)


def _verdict(slo: dict) -> str:
    return "met" if slo["met"] else "missed " + ",".join(slo["missed"])


def _goodput_lines(result: dict) -> list[str]:
    """The footer: each endpoint's goodput under the SLOs, and what bounds it."""
    slo = result["slo"]
    lines = [f"goodput: the highest rate with p99 TPOT <= {slo['tpot_p99_ms']:g} ms and p99 TTFT <= "
             f"{slo['ttft_p99_ms']:g} ms and no failed request, below every rate that misses them"]
    searched = result.get("rates_from") == "search"
    for endpoint, g in result["goodput"].items():
        good, failing = g["goodput_req_s"], g["lowest_failing_req_s"]
        name = f"{endpoint}: " if len(result["goodput"]) > 1 else ""
        if good is None and failing is None:
            lines.append(f"  {name}no run")
        elif good is None:
            lines.append(f"  {name}goodput none: the lowest rate run, {failing:g}/s, missed "
                         f"{','.join(g['missed_above'])} (goodput is below it)")
        else:
            at = g["at_goodput"]
            figures = (f"p99 TTFT {at['ttft_p99_ms']:.1f} ms, TPOT {at['tpot_p99_ms']:.2f} ms, "
                       f"ITL {at['itl_p99_ms']:.2f} ms")
            if failing is None:
                lines.append(f"  {name}goodput >= {good:g} req/s ({figures}): every rate run met the SLOs, "
                             f"the {'search' if searched else 'grid'} stops there")
            else:
                lines.append(f"  {name}goodput {good:g} req/s ({figures}); {failing:g}/s missed "
                             f"{','.join(g['missed_above'])}: the true figure is in [{good:g}, {failing:g}), "
                             f"bounded by the {'bisection' if searched else 'swept grid'}")
        if g["passing_above_failure"]:
            rates = ", ".join(f"{r:g}" for r in g["passing_above_failure"])
            lines.append(f"  {name}met the SLOs above the first miss all the same (noise): {rates}/s")
    return lines


def plot_sweep(runs: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench: matplotlib is not installed; no plot", file=sys.stderr)
        return
    rates = [r["rate_per_s"] for r in runs]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.plot(rates, [r["normalized_latency_s_per_token"] for r in runs], "o-")
    left.set_xlabel("request rate (req/s)")
    left.set_ylabel("normalized latency (s/token)")
    right.plot(rates, [r["output_tok_s"] for r in runs], "o-")
    right.set_xlabel("request rate (req/s)")
    right.set_ylabel("output tokens/s")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
