"""Figures of `pagedserve bench`: latency/throughput summary of a load run, GPU idle time between
steps from the executor's step trace, and the ideal time of an offline workload.

Definitions (docs/benchmarks.md, "Serving throughput"):
- throughput: output tokens / wall time from the first request sent to the last token received;
- TTFT: first token - arrival; TPOT: (last token - first token) / (output tokens - 1) per request;
  ITL: gaps between consecutive token messages of a request; p50 / p99 over requests (TTFT, TPOT) or
  over all gaps (ITL);
- normalized latency (paper §6.1): mean over requests of end-to-end latency / output length (with
  n parallel samples, a request's output tokens / n; with beam search, the best beam's length);
- sharing saving (paper §6.3): mean over the server's stats samples taken while KV blocks are in use
  of blocks_saved_by_sharing / (used blocks + blocks_saved_by_sharing);
- GPU idle: from the trace, the time from the end of one step's GPU work (the executor synchronized)
  to the launch of the next step's forward pass, summed, over the span of the steps;
- time breakdown (offline, on a GPU): each traced step's GPU time against its own ideal (`StepCost`)
  and its serial bound (`StepCost.serial_s`: projections and attention each at their own bound, one
  after the other), by kind of step, and the schedule's efficiency against the workload's ideal
  (`time_breakdown`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from clients.bench.load import LoadRun, RequestRecord
from scheduler_svc.sim.models import BYTES_PER_PARAM, ModelSpec


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def _ms(value: float) -> float:
    return round(value * 1e3, 3) if not math.isnan(value) else value


def summarize(run: LoadRun) -> dict:
    done = [r for r in run.records if r.error is None]
    wall_s = max(run.end_s - run.start_s, 1e-9)
    output_tokens = sum(r.num_output_tokens for r in run.records)
    prompt_tokens = sum(r.prompt_len for r in done)
    ttft = [r.token_times_s[0] - r.arrival_s for r in done if r.token_times_s]
    tpot = [(r.token_times_s[-1] - r.token_times_s[0]) / (r.output_len - 1) for r in done if r.output_len > 1]
    itl = []
    for r in done:
        times = sorted(set(r.token_times_s))
        itl.extend(b - a for a, b in zip(times, times[1:], strict=False))
    normalized = [(r.end_s - r.arrival_s) / r.output_len for r in done if r.num_output_tokens]
    during = [s for s in run.stats[1:-1] if run.start_s <= s.time_s <= run.end_s] or run.stats[-1:]
    kv_used = [1.0 - s.num_free_gpu_blocks / run.num_gpu_blocks for s in during]
    used_and_saved = [
        (run.num_gpu_blocks - s.num_free_gpu_blocks, s.num_shared_block_refs)
        for s in during
        if s.num_free_gpu_blocks < run.num_gpu_blocks
    ]
    saving = [saved / (used + saved) for used, saved in used_and_saved]
    return {
        "num_requests": len(run.records),
        "num_failed": len(run.records) - len(done),
        "errors": sorted({r.error for r in run.records if r.error})[:3],
        "output_tokens": output_tokens,
        "expected_output_tokens": sum(r.expected_output_tokens for r in run.records),
        "prompt_tokens": prompt_tokens,
        "wall_s": round(wall_s, 4),
        "request_per_s": round(len(done) / wall_s, 3),
        "output_tok_s": round(output_tokens / wall_s, 2),
        "total_tok_s": round((output_tokens + prompt_tokens) / wall_s, 2),
        "ttft_ms": {"p50": _ms(percentile(ttft, 50)), "p99": _ms(percentile(ttft, 99))},
        "tpot_ms": {"p50": _ms(percentile(tpot, 50)), "p99": _ms(percentile(tpot, 99))},
        "itl_ms": {"p50": _ms(percentile(itl, 50)), "p99": _ms(percentile(itl, 99))},
        "normalized_latency_s_per_token": round(sum(normalized) / max(1, len(normalized)), 5),
        "avg_running_seqs": round(sum(s.num_running_seqs for s in during) / max(1, len(during)), 2),
        "num_gpu_blocks": run.num_gpu_blocks,  # the server's KV cache (twice as many with an FP8 cache)
        "kv_usage": {
            "mean": round(sum(kv_used) / max(1, len(kv_used)), 4),
            "max": round(max(kv_used, default=0), 4),
        },
        "sharing_saving": {
            "mean": round(sum(saving) / max(1, len(saving)), 4),
            "max": round(max(saving, default=0), 4),
        },
        "preemptions": run.stats[-1].num_preemptions - run.stats[0].num_preemptions,
        "steps": run.stats[-1].num_steps - run.stats[0].num_steps,
        **server_side(done),
    }


def server_side(done: list[RequestRecord]) -> dict:
    """What the server's RequestMetrics (gRPC streams) say of the finished requests: its queue time
    and time to first token (from each request's arrival at the scheduler); the lag, the client's
    time to first token less the server's (the request on its way in, and its first token on its way
    out: load generator, front-end, network), and where the API server measured its own time to
    first token, that lag in two: `client_api_lag_ms` (the client's TTFT less the API server's: the
    load generator, the network, the API server's accept and its sending) and `api_engine_lag_ms`
    (the API server's less the scheduler's: an API front-end's link both ways); and the slowest first
    token taken apart. Empty when no record has them (the HTTP API)."""
    timed = [r for r in done if r.server is not None and r.token_times_s]
    if not timed:
        return {}
    queue = [r.server[0] for r in timed]
    server_ttft = [r.server[1] for r in timed]
    lag = [r.token_times_s[0] - r.arrival_s - r.server[1] for r in timed]
    slowest = max(timed, key=lambda r: r.token_times_s[0] - r.arrival_s)
    client_ttft = slowest.token_times_s[0] - slowest.arrival_s
    split = {}
    api_timed = [r for r in timed if len(r.server) > 5 and r.server[5] > 0]
    if api_timed:
        client_api = [r.token_times_s[0] - r.arrival_s - r.server[5] for r in api_timed]
        api_engine = [r.server[5] - r.server[1] for r in api_timed]
        split = {name: {"p50": _ms(percentile(v, 50)), "p99": _ms(percentile(v, 99)), "max": _ms(max(v))}
                 for name, v in (("client_api_lag_ms", client_api), ("api_engine_lag_ms", api_engine))}
    slow_api = slowest.server[5] if len(slowest.server) > 5 and slowest.server[5] > 0 else None
    return {"server": {
        "queue_time_ms": {"p50": _ms(percentile(queue, 50)), "p99": _ms(percentile(queue, 99)),
                          "max": _ms(max(queue))},
        "ttft_ms": {"p50": _ms(percentile(server_ttft, 50)), "p99": _ms(percentile(server_ttft, 99))},
        "ttft_lag_ms": {"p50": _ms(percentile(lag, 50)), "p99": _ms(percentile(lag, 99)),
                        "max": _ms(max(lag))},
        **split,
        "preempted_requests": sum(1 for r in timed if r.server[3]),
        "cached_prompt_tokens": sum(r.server[4] for r in timed),
        "slowest_first_token": {"client_ttft_ms": _ms(client_ttft), "server_queue_ms": _ms(slowest.server[0]),
                                "server_ttft_ms": _ms(slowest.server[1]),
                                "lag_ms": _ms(client_ttft - slowest.server[1]),
                                "send_delay_ms": _ms(slowest.sent_s - slowest.arrival_s),
                                "preemptions": slowest.server[3],
                                **({"api_ttft_ms": _ms(slow_api)} if slow_api is not None else {})},
    }}


@dataclass(frozen=True, slots=True)
class StepTrace:
    step_id: int
    start_s: float
    launch_s: float
    end_s: float
    num_seqs: int
    num_tokens: int
    # From CUDA events (-1 when the trace has none): GPU time from the previous step's end to this
    # step's forward pass, and of this step's forward pass + sampling.
    gpu_gap_s: float = -1.0
    gpu_busy_s: float = -1.0
    context_tokens: int = -1  # positions the step's sequences attend to (-1: an older trace)
    prepare_cpu_s: float = -1.0  # the launching thread's CPU time from start_s to launch_s (-1: older)
    longest_context: int = -1  # the most positions one of the step's sequences attends to (-1: older)

    @property
    def is_decode(self) -> bool:
        return self.num_seqs > 0 and self.num_tokens == self.num_seqs


def read_step_trace(path: str, start_s: float, end_s: float) -> list[StepTrace]:
    """The steps the executor ran between start_s and end_s (inclusive of a step that straddles)."""
    steps = []
    with open(path) as trace:
        for line in trace:
            fields = line.split()
            if len(fields) not in (6, 8, 9, 10, 11):
                continue  # a line being written
            events = [float(f) / 1e3 if float(f) >= 0 else -1.0 for f in fields[6:8]]
            times = map(float, fields[1:4])
            context = [int(f) for f in fields[8:9]]
            prepare = [float(f) / 1e3 for f in fields[9:10]]
            longest = [int(f) for f in fields[10:11]]
            step = StepTrace(int(fields[0]), *times, int(fields[4]), int(fields[5]), *events, *context,
                             *prepare, *longest)
            if step.end_s >= start_s and step.start_s <= end_s:
                steps.append(step)
    return steps


def gpu_idle(
    steps: list[StepTrace], full_batch: int, run_start_s: float | None = None, run_end_s: float | None = None
) -> dict:
    """Idle gaps between consecutive steps: overall, and over pure-decode steps of >= full_batch
    sequences (each gap is charged to the step that follows it). With the run's start and end (the
    load generator's clock, the same monotonic clock as the trace's): the wall time before the first
    step and after the last one, which no gap counts (requests still being sent; the last tokens on
    their way to the clients)."""
    gaps = [
        (b.gpu_gap_s if b.gpu_gap_s >= 0 else max(0.0, b.launch_s - a.end_s), b)
        for a, b in zip(steps, steps[1:], strict=False)
        if b.step_id == a.step_id + 1
    ]
    if not gaps:
        return {"num_steps": len(steps)}
    idle = sum(g for g, _ in gaps)
    busy = sum(_busy(s) for _, s in gaps)
    full = [(g, s) for g, s in gaps if s.is_decode and s.num_seqs >= full_batch]
    out = {
        "num_steps": len(steps),
        "gap_source": "cuda events" if steps[-1].gpu_gap_s >= 0 else "host clock",
        "idle_fraction": round(idle / (idle + busy), 4) if idle + busy > 0 else math.nan,
        "mean_gap_ms": _ms(idle / len(gaps)),
        "mean_gpu_step_ms": _ms(sum(_busy(s) for s in steps) / len(steps)),
        "mean_executor_prep_ms": _ms(sum(s.launch_s - s.start_s for s in steps) / len(steps)),
        "mean_seqs_per_step": round(sum(s.num_seqs for s in steps) / len(steps), 2),
        "full_decode_batch": full_batch,
        "num_full_decode_steps": len(full),
    }
    if run_start_s is not None and run_end_s is not None:
        out["wall_before_first_step_ms"] = _ms(max(0.0, steps[0].start_s - run_start_s))
        out["wall_after_last_step_ms"] = _ms(max(0.0, run_end_s - steps[-1].end_s))
    if full:
        full_idle = sum(g for g, _ in full)
        full_busy = sum(_busy(s) for _, s in full)
        full_prep = sum(s.launch_s - s.start_s for _, s in full)
        out |= {
            "full_decode_idle_fraction": round(full_idle / (full_idle + full_busy), 4),
            "full_decode_gap_ms": _ms(full_idle / len(full)),
            "full_decode_gpu_step_ms": _ms(full_busy / len(full)),
            "full_decode_executor_prep_ms": _ms(full_prep / len(full)),
        }
    return out


def _busy(step: StepTrace) -> float:
    """The step's GPU time: from its events, else from the host clock (launch to seen done)."""
    return step.gpu_busy_s if step.gpu_busy_s >= 0 else step.end_s - step.launch_s


@dataclass(frozen=True, slots=True)
class DeviceRates:
    device: str
    copy_bytes_per_s: float  # device-to-device copy, bytes read + written
    matmul_flops_per_s: float  # bf16 GEMM


@dataclass(frozen=True, slots=True)
class AllReduceRates:
    """A ring all-reduce over `world_size` GPUs, fitted to two measured sizes
    (clients/bench/device_rates.py): time(bytes) = latency_s + 2 (t - 1) / t x bytes / bus_bytes_per_s,
    the bus bandwidth as nccl-tests defines it (each rank sends and receives 2 (t - 1) / t x bytes)."""

    latency_s: float
    bus_bytes_per_s: float
    world_size: int

    def __post_init__(self) -> None:
        if self.world_size < 2 or self.latency_s < 0 or self.bus_bytes_per_s <= 0:
            raise ValueError(f"bad all-reduce rates {self}")

    def time_s(self, num_bytes: float) -> float:
        t = self.world_size
        return self.latency_s + 2 * (t - 1) / t * num_bytes / self.bus_bytes_per_s


class StepCost:
    """One step's time at the machine's rates (one rank's share at tensor-parallel size t; see
    `ideal_time`): max(bytes / copy rate, FLOPs / matmul rate) for `num_tokens` tokens whose sequences
    attend to `context` positions, bytes = the weights the tokens read + the context's K/V, FLOPs =
    2 x matmul params per token + 4 x hidden x layers per context position; and the step's
    all-reduces, apart. The attention FLOPs of a prompt chunk (each of its tokens attends to the
    positions before it) are counted once per position, which undercounts them: small beside the
    matmuls at prompts of a few thousand tokens."""

    def __init__(self, spec: ModelSpec, rates: DeviceRates, tensor_parallel_size: int = 1,
                 all_reduce: AllReduceRates | None = None):
        t = tensor_parallel_size
        if (all_reduce.world_size if all_reduce else 1) != t:
            raise ValueError(f"tensor-parallel size {t} needs all-reduce rates measured over {t} GPUs")
        if t < 1 or spec.num_heads % t or (spec.num_kv_heads % t and spec.num_kv_heads > t):
            raise ValueError(
                f"{spec.num_heads} heads / {spec.num_kv_heads} KV heads do not split over {t} ranks"
            )
        self.spec, self.rates, self.all_reduce, self.t = spec, rates, all_reduce, t
        self.kv_heads_per_rank = max(1, spec.num_kv_heads // t)
        self.embedding = spec.vocab_size * spec.hidden_size  # a lookup, no matmul
        self.matmul_params = self.per_rank(spec.num_active_params - self.embedding)
        self.attn_flops_per_pos = 4 * spec.hidden_size * spec.num_layers // t  # QK^T and PV, 2 FLOPs a MAC
        self.kv_bytes_per_token = spec.kv_bytes_per_token * self.kv_heads_per_rank // spec.num_kv_heads

    def per_rank(self, params: float) -> float:
        """A rank's share of `params` matmul parameters (K/V projections replicated past kv_heads ranks)."""
        if self.t == 1:
            return params
        kv_proj = self.spec.num_layers * 2 * self.spec.hidden_size * self.spec.head_dim  # per KV head
        return (params - kv_proj * self.spec.num_kv_heads) / self.t + kv_proj * self.kv_heads_per_rank

    def all_reduces_s(self, num_tokens: int) -> float:
        if self.all_reduce is None:
            return 0.0
        one = self.all_reduce.time_s(num_tokens * self.spec.hidden_size * BYTES_PER_PARAM)
        return (2 * self.spec.num_layers + 1) * one

    def _parts(self, num_tokens: int, context: int) -> tuple[float, float, float, float]:
        """(weight bytes, K/V bytes, matmul FLOPs, attention FLOPs) of one step."""
        weight_bytes = self.per_rank(self.spec.params_read(num_tokens) - self.embedding) * BYTES_PER_PARAM
        return (weight_bytes, context * self.kv_bytes_per_token, 2 * self.matmul_params * num_tokens,
                self.attn_flops_per_pos * context)

    def compute_s(self, num_tokens: int, context: int) -> float:
        weight_bytes, kv_bytes, matmul_flops, attn_flops = self._parts(num_tokens, context)
        copy, matmul = self.rates.copy_bytes_per_s, self.rates.matmul_flops_per_s
        return max((weight_bytes + kv_bytes) / copy, (matmul_flops + attn_flops) / matmul)

    def serial_s(self, num_tokens: int, context: int) -> float:
        """The step's time if its weight products and its attention each run at their own bound, one
        after the other, as a layer's kernels do: max(weight bytes / copy rate, matmul FLOPs / matmul
        rate) + max(K/V bytes / copy rate, attention FLOPs / matmul rate) (all-reduces apart).
        compute_s overlaps the two, which no engine running one kernel at a time can: where the
        projections are bound by FLOPs (large decode batches, prompts) and attention by bytes, the
        ideal counts only the larger of the two."""
        weight_bytes, kv_bytes, matmul_flops, attn_flops = self._parts(num_tokens, context)
        copy, matmul = self.rates.copy_bytes_per_s, self.rates.matmul_flops_per_s
        return max(weight_bytes / copy, matmul_flops / matmul) + max(kv_bytes / copy, attn_flops / matmul)

    def step_s(self, num_tokens: int, context: int) -> float:
        return self.compute_s(num_tokens, context) + self.all_reduces_s(num_tokens)

    def serial_step_s(self, num_tokens: int, context: int) -> float:
        return self.serial_s(num_tokens, context) + self.all_reduces_s(num_tokens)


# The step kinds of `time_breakdown`: steps with prompt tokens, then decode steps by batch size.
BREAKDOWN_DECODE_BATCHES = (1, 16, 64, 128, 256)


def time_breakdown(steps: list[StepTrace], cost: StepCost) -> dict:
    """Where a run's GPU time goes against each step's own ideal (`StepCost` of its tokens and
    context): per kind of step (with prompt tokens; decode steps of 1-15, 16-63, 64-127, 128-255 and
    >= 256 sequences) the steps, their GPU time (forward + sampling, CUDA events), the sum of their
    ideal times, their serial bound (`StepCost.serial_s`: projections and attention each at their own
    bound, one after the other) and the idle gaps before them (as `gpu_idle` charges them). The sum
    of the steps' ideals, set against the workload's `ideal_time`, shows what the schedule itself
    costs; GPU time against the serial bound, what the kernels lose against their own bounds; the
    ideal against the serial bound, what running one kernel at a time costs by itself. Where the
    trace has each step's longest context, a decode kind also has `longest_over_mean`: its steps'
    longest context over their mean one, averaged (how uneven the lengths an unsplit decode attention
    launch pays for are). Needs a trace with CUDA events and context tokens ({} else)."""
    if not steps or any(s.gpu_busy_s < 0 or s.context_tokens < 0 for s in steps):
        return {}
    kinds: dict[str, dict] = {}
    previous_id = None
    for step in steps:
        if step.num_tokens > step.num_seqs:
            kind, order = "prompt", -1
        else:
            order = max(b for b in BREAKDOWN_DECODE_BATCHES if b <= max(1, step.num_seqs))
            higher = [b for b in BREAKDOWN_DECODE_BATCHES if b > order]
            kind = f"decode {order}-{higher[0] - 1}" if higher else f"decode >= {order}"
        row = kinds.setdefault(kind, {"order": order, "steps": 0, "gpu_s": 0.0, "ideal_s": 0.0,
                                      "serial_s": 0.0, "gap_s": 0.0, "uneven": []})
        if kind != "prompt" and step.longest_context >= 0 and step.context_tokens > 0:
            row["uneven"].append(step.longest_context * step.num_seqs / step.context_tokens)
        row["steps"] += 1
        row["gpu_s"] += step.gpu_busy_s
        row["ideal_s"] += cost.step_s(step.num_tokens, step.context_tokens)
        row["serial_s"] += cost.serial_step_s(step.num_tokens, step.context_tokens)
        if previous_id is not None and step.step_id == previous_id + 1 and step.gpu_gap_s >= 0:
            row["gap_s"] += step.gpu_gap_s
        previous_id = step.step_id
    rows = [
        {
            "kind": kind, "steps": row["steps"], "gpu_s": round(row["gpu_s"], 4),
            "ideal_s": round(row["ideal_s"], 4), "serial_s": round(row["serial_s"], 4),
            "gap_s": round(row["gap_s"], 4),
            "ideal_over_gpu": round(row["ideal_s"] / row["gpu_s"], 3) if row["gpu_s"] > 0 else math.nan,
            "serial_over_gpu": round(row["serial_s"] / row["gpu_s"], 3) if row["gpu_s"] > 0 else math.nan,
        } | ({"longest_over_mean": round(sum(row["uneven"]) / len(row["uneven"]), 2)}
             if row["uneven"] and len(row["uneven"]) == row["steps"] else {})
        for kind, row in sorted(kinds.items(), key=lambda item: item[1]["order"])
    ]
    total = {key: round(sum(r[key] for r in rows), 4) for key in ("gpu_s", "ideal_s", "serial_s", "gap_s")}
    return {"kinds": rows, **total}


def ideal_time(
    spec: ModelSpec,
    prompt_lens: list[int],
    output_lens: list[int],
    rates: DeviceRates,
    tensor_parallel_size: int = 1,
    all_reduce: AllReduceRates | None = None,
    max_num_batched_tokens: int | None = None,
) -> dict:
    """Every request runs from the start: prefill (all prompts, FLOPs / matmul rate) produces each
    first token; decode step k (k = 1 .. max output - 1) runs the requests with more than k output
    tokens and takes max(bytes / copy rate, FLOPs / matmul rate), bytes = the weights once + the K/V
    of every active context, FLOPs = 2 x matmul params per token + attention (4 x hidden x layers
    per context position). For a mixture of experts, the weights a decode step reads are the dense
    ones and the experts its tokens touch (`ModelSpec.params_read`: E (1 - (1 - k/E)^tokens) per
    layer), and a token's FLOPs count its k experts only (`num_active_params`).

    At tensor-parallel size t > 1 (docs/tensor_parallel.md) the rates are one GPU's and every figure
    is one rank's: 1/t of the matmul weights, except the K/V projections of a model with fewer KV
    heads than ranks, which are replicated (a rank holds max(1, kv_heads / t) heads, so its K/V cache
    per token is kv_bytes_per_token x that / kv_heads); 1/t of the attention FLOPs (query heads
    split). Each step then also pays, not overlapped with compute, 2 x layers + 1 all-reduces of
    [step tokens, hidden] bf16 (after o_proj and down_proj of every layer, and after the
    vocabulary-parallel embedding), each `all_reduce.time_s(bytes)`. The prefill is cut into steps
    of `max_num_batched_tokens` prompt tokens (one step when None) for the all-reduces; its compute
    stays FLOPs / matmul rate. Left out: the logits all-gather (step rows x vocab x 2 bytes, once a
    step), replicated norms and routers, and decode tokens riding in prefill steps. "all_reduce_s"
    is the part of total_s spent in all-reduces."""
    cost = StepCost(spec, rates, tensor_parallel_size, all_reduce)
    t = tensor_parallel_size
    prefill_flops = sum(
        2 * cost.matmul_params * p + cost.attn_flops_per_pos * p * (p + 1) / 2 for p in prompt_lens
    )
    prefill_s = prefill_flops / rates.matmul_flops_per_s
    num_prompt_tokens = sum(prompt_lens)
    step_tokens = max_num_batched_tokens or max(1, num_prompt_tokens)
    prefill_steps = [step_tokens] * (num_prompt_tokens // step_tokens) + [num_prompt_tokens % step_tokens]
    all_reduce_s = sum(cost.all_reduces_s(n) for n in prefill_steps if n)
    prefill_s += all_reduce_s
    decode_s = 0.0
    pairs = sorted(zip(output_lens, prompt_lens, strict=True), reverse=True)
    for k in range(1, max(output_lens, default=1)):
        active = [p for out, p in pairs if out > k]  # sorted by output length: a prefix
        if not active:
            break
        context = sum(active) + k * len(active)
        step_all_reduce_s = cost.all_reduces_s(len(active))
        all_reduce_s += step_all_reduce_s
        decode_s += cost.compute_s(len(active), context) + step_all_reduce_s
    out = {
        "prefill_s": round(prefill_s, 4),
        "decode_s": round(decode_s, 4),
        "total_s": round(prefill_s + decode_s, 4),
    }
    if t > 1:
        out["all_reduce_s"] = round(all_reduce_s, 4)
    return out
