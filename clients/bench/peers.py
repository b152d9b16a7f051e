"""`pagedserve bench --compare`: the Hugging Face peers on the same GPU, model and requests as
ours, and the offline ideal time (clients/bench/report.py ideal_time) against the measured wall time."""

from __future__ import annotations

import sys

from clients.bench.report import StepCost, ideal_time, time_breakdown
from scheduler_svc.sim.models import ModelSpec

PEERS = ("hf-static", "hf-cb")


def run_peers(args, model: str, requests, ours_by_size: dict[int, dict]) -> list[dict]:
    import torch

    from clients.bench.hf_peers import load_peer_model, run_continuous, run_static

    device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    peer_model = load_peer_model(model, dtype, device, dummy=args.load_format == "dummy")
    results = []
    for peer in [p for p in args.compare.split(",") if p]:
        size = peer_size(args, peer, len(requests))
        subset = requests[:size]
        prompts, max_tokens = [list(r.prompt_token_ids) for r in subset], [r.max_tokens for r in subset]
        print(f"bench: running {peer} on the first {size} requests ...", file=sys.stderr, flush=True)
        if peer == "hf-static":
            result = run_static(peer_model, prompts, max_tokens, args.static_batch)
        else:
            result = run_continuous(peer_model, prompts, max_tokens, None if device == "cuda" else 256)
        ours = ours_by_size[size]["output_tok_s"]
        ours_all = ours_by_size[len(requests)]["output_tok_s"]
        results.append(
            {
                **result.as_dict(),
                "ours_output_tok_s": ours,
                "ratio": round(ours / result.output_tok_s, 2),
                # the peer's rate on its subset against ours on every request (a static batch's
                # throughput does not depend on how many batches follow it; ours grows with the load)
                "ours_all_output_tok_s": ours_all,
                "ratio_ours_all": round(ours_all / result.output_tok_s, 2),
            }
        )
    return results


def peer_size(args, peer: str, num_requests: int) -> int:
    if peer not in PEERS:
        raise SystemExit(f"pagedserve bench: unknown peer {peer!r}; choose from {PEERS}")
    size = args.static_requests if peer == "hf-static" else args.cb_requests
    return min(size or num_requests, num_requests)


def add_ideal(
    spec: ModelSpec,
    requests_by_size: dict[int, list],
    runs: dict[int, dict],
    tensor_parallel_size: int = 1,
    max_num_batched_tokens: int | None = None,
    steps_by_size: dict[int, list] | None = None,
) -> dict | None:
    """Measures this machine's rates and puts each run's ideal time and measured / ideal in it, and
    where its steps are given (the executor's trace), its `time_breakdown`; returns
    the rates (None, with the reason printed, when the machine has fewer GPUs than the ranks). Runs
    after our servers stopped: at TP > 1 the all-reduce takes the GPUs the ranks held."""
    import torch

    from clients.bench.device_rates import measure_all_reduce_rates, measure_device_rates

    t = tensor_parallel_size
    if torch.cuda.device_count() < t:
        print(f"bench: no ideal time: tensor-parallel size {t} needs {t} GPUs to measure its all-reduce, "
              f"this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return None
    all_reduce = measure_all_reduce_rates(t) if t > 1 else None
    rates = measure_device_rates()
    for size, summary in runs.items():
        reqs = requests_by_size[size]
        ideal = ideal_time(spec, [r.prompt_len for r in reqs], [r.max_tokens for r in reqs], rates,
                           t, all_reduce, max_num_batched_tokens)
        ideal["measured_over_ideal"] = round(ideal["total_s"] / summary["wall_s"], 3)
        summary["ideal"] = ideal
        breakdown = time_breakdown((steps_by_size or {}).get(size, []), StepCost(spec, rates, t, all_reduce))
        if breakdown:
            # the workload's ideal over the sum of the ideals of the steps the scheduler ran
            breakdown["schedule_efficiency"] = round(ideal["total_s"] / breakdown["ideal_s"], 3)
            summary["time_breakdown"] = breakdown
    measured = {
        "device": rates.device,
        "copy_tb_s": round(rates.copy_bytes_per_s / 1e12, 3),
        "matmul_tflop_s": round(rates.matmul_flops_per_s / 1e12, 1),
    }
    if all_reduce is not None:
        measured |= {
            "tensor_parallel_size": t,
            "all_reduce_latency_us": round(all_reduce.latency_s * 1e6, 1),
            "all_reduce_bus_gb_s": round(all_reduce.bus_bytes_per_s / 1e9, 1),
        }
    return measured
