"""`pagedserve bench paper`: the paper's Fig. 12 comparison through the real services.

    pagedserve bench paper --model llama2-13b --workload sharegpt --kv-cache-gib 12 \\
        --max-model-len 2048 --rates 0.5,1,1.5,2 --policies paged,reserve-oracle,reserve-pow2,reserve-max \\
        --requests 200 --max-duration-s 60 --out paper.json --plot paper.png

For each KV policy (a fresh server, `--kv-policy`) it runs the `bench serve` rate sweep
(clients/bench/serving.py sweep_rates: Poisson arrivals, the same requests per rate for every policy) and
reports per rate the normalized latency (paper §6.1: mean over requests of end-to-end latency /
output length). A policy's sustainable rate is the highest rate whose normalized latency is at most
--latency-factor (1.5) x its normalized latency at the lowest rate; the result gives paged's
sustainable rate over reserve-oracle's and reserve-max's. --kv-cache-gib caps the KV cache at that
many GiB of the model shape's bf16 K/V (the paper's 12 GiB setting on an A100-40GB for OPT-13B);
--stop-factor skips a policy's higher rates once its latency is far past the knee. --kv-cache-dtypes
auto,fp8 runs every policy once per KV cache dtype, each on a fresh server with the blocks
--kv-cache-gib holds in that dtype (twice as many in fp8), labelled "paged" and "paged fp8", and gives
the fp8 cache's rates over the model dtype's ("paged fp8/paged"): the FP8 cache's experiment as one
command, so that both sides run on one machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from clients.bench.serving import report, servers, sweep_rates, warm_up
from executor_svc.worker.config import KV_CACHE_DTYPE_NAMES
from scheduler_svc.sched.kv_policies import PAGED, POLICIES
from scheduler_svc.sim.models import ModelSpec

GIB = 1 << 30
RATIO_BASELINES = ("reserve-oracle", "reserve-max")


def add_paper_arguments(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--policies", default=",".join(POLICIES), help="KV policies to compare, in order")
    sub.add_argument("--kv-cache-gib", type=float, default=None, help="cap the KV cache (sets the blocks)")
    sub.add_argument(
        "--latency-factor",
        type=float,
        default=1.5,
        help="sustainable: normalized latency <= this x lowest rate's",
    )
    sub.add_argument(
        "--kv-cache-dtypes",
        default=None,
        help="KV cache dtypes to compare, in order, e.g. auto,fp8: every policy once per dtype, each on a "
             "fresh server (default: --kv-cache-dtype alone)",
    )
    sub.add_argument(
        "--stop-factor",
        type=float,
        default=4.0,
        help="skip a policy's higher rates past this x its first rate's",
    )


def parse_policies(text: str) -> list[str]:
    policies = [p for p in text.split(",") if p]
    unknown = [p for p in policies if p not in POLICIES]
    if unknown or not policies:
        raise ValueError(f"--policies: choose from {', '.join(POLICIES)}, got {text!r}")
    return policies


def parse_kv_cache_dtypes(text: str | None, default: str) -> list[str]:
    """--kv-cache-dtypes: distinct names of KV_CACHE_DTYPE_NAMES, comma-separated (None: [default])."""
    if text is None:
        return [default]
    dtypes = [d.strip() for d in text.split(",") if d.strip()]
    if not dtypes or any(d not in KV_CACHE_DTYPE_NAMES for d in dtypes) or len(set(dtypes)) != len(dtypes):
        raise ValueError(
            f"--kv-cache-dtypes: distinct dtypes from {', '.join(KV_CACHE_DTYPE_NAMES)}, comma-separated, "
            f"got {text!r}"
        )
    return dtypes


def run_label(policy: str, kv_cache_dtype: str, several_dtypes: bool) -> str:
    """A sweep's name in the results: the policy, with its cache dtype when --kv-cache-dtypes names
    several and it is not the model's own ("paged fp8")."""
    return f"{policy} {kv_cache_dtype}" if several_dtypes and kv_cache_dtype != "auto" else policy


def kv_cache_blocks(
    spec: ModelSpec, kv_cache_gib: float, block_size: int, kv_cache_dtype: str = "auto"
) -> int:
    """The blocks --kv-cache-gib holds: of the model's 2-byte dtype, or of 1-byte e4m3 with
    --kv-cache-dtype fp8 (twice as many: the paper's experiment at the same memory)."""
    num_blocks = spec.num_gpu_blocks(kv_cache_gib * GIB, block_size, 1 if kv_cache_dtype == "fp8" else 2)
    if num_blocks < 1:
        raise ValueError(f"--kv-cache-gib {kv_cache_gib} holds no block of this model")
    return num_blocks


def sustainable_rate(runs: list[dict], latency_factor: float) -> float | None:
    """The highest rate whose normalized latency is <= latency_factor x the lowest rate's."""
    done = [r for r in runs if not r["num_failed"]]
    if not done:
        return None
    base = min(done, key=lambda r: r["rate_per_s"])["normalized_latency_s_per_token"]
    ok = [r["rate_per_s"] for r in done if r["normalized_latency_s_per_token"] <= latency_factor * base]
    return max(ok)


def crossing_rate(runs: list[dict], latency_factor: float) -> float | None:
    """The rate at which normalized latency reaches latency_factor x the lowest rate's, linearly
    interpolated between the last swept rate below that and the first above it (a finer reading of
    a coarse sweep than `sustainable_rate`); None when no swept rate reaches it."""
    done = sorted((r for r in runs if not r["num_failed"]), key=lambda r: r["rate_per_s"])
    if not done:
        return None
    limit = latency_factor * done[0]["normalized_latency_s_per_token"]
    for below, above in zip(done, done[1:], strict=False):
        lo, hi = below["normalized_latency_s_per_token"], above["normalized_latency_s_per_token"]
        if hi > limit:
            fraction = (limit - lo) / (hi - lo)
            return round(below["rate_per_s"] + fraction * (above["rate_per_s"] - below["rate_per_s"]), 2)
    return None


def compare(
    by_policy: dict[str, list[dict]], latency_factor: float, pairs: tuple[tuple[str, str], ...] = ()
) -> dict:
    """Normalized latency per rate and policy, each policy's sustainable rate (the highest swept rate
    within latency_factor) and interpolated crossing rate, and paged's ratios over the baselines;
    pairs: more (label, base label) ratios, e.g. ("paged fp8", "paged")."""
    summary: dict = {
        "normalized_latency_s_per_token": {},
        "sustainable_rate_per_s": {},
        "crossing_rate_per_s": {},
        "ratios": {},
        "crossing_ratios": {},
    }
    for policy, runs in by_policy.items():
        summary["normalized_latency_s_per_token"][policy] = {
            f"{r['rate_per_s']:g}": r["normalized_latency_s_per_token"] for r in runs
        }
        summary["sustainable_rate_per_s"][policy] = sustainable_rate(runs, latency_factor)
        summary["crossing_rate_per_s"][policy] = crossing_rate(runs, latency_factor)
    rates, crossings = summary["sustainable_rate_per_s"], summary["crossing_rate_per_s"]
    for label, base in (*((PAGED, baseline) for baseline in RATIO_BASELINES), *pairs):
        if rates.get(label) and rates.get(base):
            summary["ratios"][f"{label}/{base}"] = round(rates[label] / rates[base], 3)
        if crossings.get(label) and crossings.get(base):  # both crossed inside the sweep
            summary["crossing_ratios"][f"{label}/{base}"] = round(crossings[label] / crossings[base], 3)
    return summary


def format_paper_table(result: dict) -> str:
    latency = result["normalized_latency_s_per_token"]
    policies = list(latency)
    rates = sorted({float(k) for runs in latency.values() for k in runs})
    blocks = result.get("num_gpu_blocks_by_kv_cache_dtype") or {}
    kv_blocks = (", ".join(f"{n} ({d})" for d, n in blocks.items()) if len(blocks) > 1
                 else f"{result['num_gpu_blocks']}")
    lines = [
        f"pagedserve bench paper: {result['model']}, {result['workload']}, "
        f"{kv_blocks} KV blocks, n {result['n']}, beam width {result['beam_width']}",
        "normalized latency (s/token) per rate:",
        f"{'rate/s':>8} " + " ".join(f"{p:>15}" for p in policies),
    ]
    for rate in rates:
        cells = [latency[p].get(f"{rate:g}") for p in policies]
        lines.append(f"{rate:>8g} " + " ".join(f"{'-' if c is None else f'{c:.4f}':>15}" for c in cells))
    sustained = ", ".join(f"{p} {r}" for p, r in result["sustainable_rate_per_s"].items())
    lines.append(f"highest rate with latency <= {result['latency_factor']}x the lowest rate's: {sustained}")
    for name, ratio in result["ratios"].items():
        lines.append(f"rate ratio {name}: {ratio}x")
    crossings = result.get("crossing_rate_per_s", {})
    crossing = ", ".join(f"{p} {'beyond the sweep' if r is None else r}" for p, r in crossings.items())
    if crossing:
        lines.append(f"rate where latency reaches {result['latency_factor']}x (interpolated): {crossing}")
    for name, ratio in result.get("crossing_ratios", {}).items():
        lines.append(f"interpolated rate ratio {name}: {ratio}x")
    return "\n".join(lines)


def plot_paper(latency: dict[str, dict[str, float]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("bench paper: matplotlib is not installed; no plot", file=sys.stderr)
        return
    fig, axes = plt.subplots(figsize=(5, 4))
    for policy, by_rate in latency.items():
        axes.plot([float(k) for k in by_rate], list(by_rate.values()), "o-", label=policy)
    axes.set_xlabel("request rate (req/s)")
    axes.set_ylabel("normalized latency (s/token)")
    axes.set_yscale("log")  # a policy past its knee is 10-100x the others
    axes.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def run_paper(args: argparse.Namespace, model: str, spec: ModelSpec, result: dict) -> int:

    try:
        policies = parse_policies(args.policies)
        dtypes = parse_kv_cache_dtypes(args.kv_cache_dtypes, getattr(args, "kv_cache_dtype", "auto"))
        blocks = {
            d: args.num_gpu_blocks if args.kv_cache_gib is None
            else kv_cache_blocks(spec, args.kv_cache_gib, args.block_size, d)
            for d in dtypes
        }
    except ValueError as err:
        print(f"pagedserve bench: {err}", file=sys.stderr)
        return 2
    several = len(dtypes) > 1
    result.update(
        kv_policy=None,
        policies=policies,
        kv_cache_gib=args.kv_cache_gib,
        kv_cache_dtypes=dtypes,
        num_gpu_blocks=blocks[dtypes[0]],
        num_gpu_blocks_by_kv_cache_dtype=blocks,
        latency_factor=args.latency_factor,
        runs=[],
    )
    by_policy: dict[str, list[dict]] = {}
    pairs = tuple(
        (run_label(p, d, several), run_label(p, dtypes[0], several)) for d in dtypes[1:] for p in policies
    )
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in dtypes:
            for policy in policies:
                label = run_label(policy, dtype, several)
                print(f"bench paper: {label} ...", file=sys.stderr, flush=True)
                policy_args = argparse.Namespace(**{
                    **vars(args), "kv_policy": policy, "kv_cache_dtype": dtype,
                    "num_gpu_blocks": blocks[dtype],
                })
                trace_path = args.trace or os.path.join(tmp, f"{label.replace(' ', '-')}.trace")
                with servers(policy_args, model, trace_path) as target:
                    warm_up(policy_args, target, spec.vocab_size)
                    runs = sweep_rates(policy_args, target, spec.vocab_size, trace_path, args.stop_factor)
                by_policy[label] = runs
                result["runs"] += [{"policy": policy, "kv_cache_dtype": dtype, **r} for r in runs]
    result.update(compare(by_policy, args.latency_factor, pairs))
    if args.plot:
        plot_paper(result["normalized_latency_s_per_token"], args.plot)
    return report(args, result, format_paper_table(result))
