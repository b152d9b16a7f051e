"""M-bucket tile configs of the batch-invariant GEMM (kernels/triton_batch_invariant.py) on one CUDA
device: `python -m tests.gpu.test_batch_invariant_gpu --configs --out PATH` (not a test).

For each llama3-8b weight shape and each M of SWEEP_MS, the candidates keep the BLOCK_M and BLOCK_K
that tile_config gives the shape today (so they cannot change the bits) and vary BLOCK_N, warps,
stages and GROUP_M. Each candidate's output must equal today's config's bitwise at that M, and its
first and last CHECK_ROWS rows must equal today's output for those rows alone (the small-batch
bucket): a candidate that differs anywhere is reported and never recommended. Times are medians of
triton's do_bench (CUDA events, L2 flushed), bf16, beside F.linear (cuBLAS) on the same x.

Per N class of TILE_TABLE the recommendation splits the swept M values into at most `max_buckets`
contiguous buckets, each with the one config that is fastest over its M values, the class's shapes
summed with their counts per forward pass (LAYERS_PER_FORWARD); it is printed as a TILE_TABLE to paste.
A bucket's max_m is the largest swept M it holds, so M between two swept values takes the next
bucket's config. The selection (`recommend`, `table_text`) is plain Python, tested on fake timings in
tests/unit/test_gemm_sweep.py.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import platform
import sys
import time

import torch

from kernels.triton_batch_invariant import TILE_TABLE, TileConfig, TileTable, check_tile_table, tile_config

DTYPE = torch.bfloat16
# (N, K) of llama3-8b, in the order they are swept: if the deadline cuts the run short, the last lose
SHAPES = {"qkv": (6144, 4096), "gate_up": (28672, 4096), "down": (4096, 14336), "o_proj": (4096, 4096),
          "lm_head": (128256, 4096)}
LAYERS_PER_FORWARD = {"qkv": 32, "gate_up": 32, "down": 32, "o_proj": 32, "lm_head": 1}
SWEEP_MS = (16, 64, 128, 192, 256, 384, 512, 1024, 4096)
BLOCK_NS = (32, 64, 128, 256)
NUM_WARPS = (4, 8)
NUM_STAGES = (3, 4, 5)
GROUP_MS = (8,)
SHARED_MEMORY_LIMIT = 220 * 1024  # bytes; the H100 allows 227 KiB per block
MAX_ACCUMULATORS_PER_THREAD = 128  # float32 registers of the accumulator tile; more spills
CHECK_ROWS = 16
MAX_BUCKETS = 4
MIN_GAIN = 0.02  # an extra bucket must save 2 % of one M's time (summed over the swept M values)


def label(config: TileConfig | dict) -> str:
    c = config if isinstance(config, dict) else dataclasses.asdict(config)
    return (f"bm{c['block_m']} bn{c['block_n']} bk{c['block_k']} g{c['group_m']} "
            f"w{c['num_warps']} s{c['num_stages']}")


def shared_memory_bytes(config: TileConfig) -> int:
    """Estimate, bf16: the ring of `stages` x and w tiles, plus the output tile the epilogue may stage."""
    ring = config.num_stages * (config.block_m * config.block_k + config.block_k * config.block_n)
    return 2 * (ring + config.block_m * config.block_n)


def candidate_configs(block_m: int, block_k: int, keep: tuple[TileConfig, ...] = ()) -> list[TileConfig]:
    """`keep` (today's configs) first, then every BLOCK_N x warps x stages x GROUP_M of this BLOCK_M and
    BLOCK_K that fits SHARED_MEMORY_LIMIT and MAX_ACCUMULATORS_PER_THREAD."""
    for config in keep:
        if (config.block_m, config.block_k) != (block_m, block_k):
            raise ValueError(f"{label(config)} is not of BLOCK_M {block_m} BLOCK_K {block_k}")
    configs = list(dict.fromkeys(keep))
    for block_n in BLOCK_NS:
        for num_warps in NUM_WARPS:
            if block_m * block_n > MAX_ACCUMULATORS_PER_THREAD * 32 * num_warps:
                continue
            for num_stages in NUM_STAGES:
                for group_m in GROUP_MS:
                    config = TileConfig(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                                        num_warps=num_warps, num_stages=num_stages)
                    if shared_memory_bytes(config) <= SHARED_MEMORY_LIMIT and config not in configs:
                        configs.append(config)
    return configs


def class_index(n: int, table: TileTable) -> int:
    """Index of the N class of `table` that holds n (as tile_config looks it up)."""
    for index, (max_n, _) in enumerate(table):
        if max_n is None or n <= max_n:
            return index
    raise ValueError(f"no N class holds n = {n}")


def class_name(max_n: int | None, table: TileTable) -> str:
    if max_n is not None:
        return f"n <= {max_n}"
    bounded = [b for b, _ in table if b is not None]
    return f"n > {max(bounded)}" if bounded else "any n"


# ---- selection: plain Python on the recorded cases ------------------------------------------------
# A case: {"shape", "n", "m", "cublas_us", "current": label, "candidates": [{"label", "config",
# "us", "equal_current", "equal_small_batch", "error"}]}, or {"shape", "n", "m", "skipped": why}.


def bits_ok(candidate: dict) -> bool:
    return candidate.get("error") is None and candidate["equal_current"] and candidate["equal_small_batch"]


def best_candidate(case: dict) -> dict | None:
    """The fastest candidate whose bits equal today's config's, None if none ran."""
    fine = [c for c in case.get("candidates", ()) if bits_ok(c)]
    return min(fine, key=lambda c: (c["us"], c["label"])) if fine else None


def bit_changes(cases: list[dict]) -> list[dict]:
    """Every (shape, M, candidate) that ran but gave other bits than today's config."""
    return [
        dict(shape=case["shape"], m=case["m"], label=c["label"], equal_current=c["equal_current"],
             equal_small_batch=c["equal_small_batch"])
        for case in cases for c in case.get("candidates", ())
        if c.get("error") is None and not (c["equal_current"] and c["equal_small_batch"])
    ]


def _segments(rel: list[dict[str, float]], labels: list[str], max_buckets: int, min_gain: float):
    """Split the M indices 0..len(rel)-1 into at most max_buckets contiguous runs, each with one label,
    minimising the summed relative time plus min_gain per extra run. Returns [(first, last, label)]."""
    count = len(rel)

    def run_cost(first: int, last: int) -> tuple[float, str]:
        return min((sum(rel[i][lab] for i in range(first, last + 1)), lab) for lab in labels)

    # best[k][j]: (cost, runs) covering indices 0..j with k + 1 runs
    best = [[None] * count for _ in range(max_buckets)]
    for j in range(count):
        cost, lab = run_cost(0, j)
        best[0][j] = (cost, [(0, j, lab)])
    for k in range(1, max_buckets):
        for j in range(k, count):
            options = []
            for split in range(k - 1, j):
                prev_cost, prev_runs = best[k - 1][split]
                cost, lab = run_cost(split + 1, j)
                options.append((prev_cost + cost, prev_runs + [(split + 1, j, lab)]))
            best[k][j] = min(options, key=lambda o: o[0])
    choices = [(best[k][count - 1][0] + min_gain * k, k) for k in range(max_buckets) if best[k][count - 1]]
    _, k = min(choices)
    runs = []
    for first, last, lab in best[k][count - 1][1]:  # merge neighbours that chose the same config
        if runs and runs[-1][2] == lab:
            runs[-1] = (runs[-1][0], last, lab)
        else:
            runs.append((first, last, lab))
    return runs


def _class_us(done: dict, shapes: list[str], weights: dict[str, float], m: int, lab: str) -> float:
    """Time of config `lab` at M over the class's shapes, each counted as often as it runs per forward."""
    return sum(weights.get(s, 1) * next(c["us"] for c in done[s, m]["candidates"] if c["label"] == lab)
               for s in shapes)


def recommend(cases: list[dict], table: TileTable = TILE_TABLE, weights: dict[str, float] | None = None,
              max_buckets: int = MAX_BUCKETS, min_gain: float = MIN_GAIN) -> list[dict]:
    """Per N class of `table` (in its order): the shapes swept in it, the M values every one of them
    has, and the recommended buckets [{"max_m", "label", "config", "ms", "ratio", "current_ratio"}]
    (ratios: the class's weighted time over cuBLAS's, per M), or buckets None when nothing usable ran.
    Only configs of the class's BLOCK_M and BLOCK_K that ran with today's bits at every swept (shape, M)
    of the class are considered."""
    weights = weights or LAYERS_PER_FORWARD
    if max_buckets < 1:
        raise ValueError(f"max_buckets must be >= 1, got {max_buckets}")
    done = {(case["shape"], case["m"]): case for case in cases if "candidates" in case}
    result = []
    for index, (max_n, buckets) in enumerate(table):
        in_class = [c for c in cases if class_index(c["n"], table) == index]
        shapes = list(dict.fromkeys(c["shape"] for c in in_class))
        entry = dict(max_n=max_n, name=class_name(max_n, table), shapes=shapes, ms=[], buckets=None)
        result.append(entry)
        ms = sorted({c["m"] for c in in_class if all((s, c["m"]) in done for s in shapes)})
        if not shapes or not ms:
            continue
        class_cases = [done[s, m] for s in shapes for m in ms]
        ran = set.intersection(*({c["label"] for c in case["candidates"] if c.get("error") is None}
                                 for case in class_cases))
        changed = {c["label"] for case in class_cases for c in case["candidates"]
                   if c.get("error") is None and not bits_ok(c)}
        configs = {c["label"]: c["config"] for case in class_cases for c in case["candidates"]}
        shape = {(config.block_m, config.block_k) for _, config in buckets}
        labels = sorted(lab for lab in ran - changed
                        if (configs[lab]["block_m"], configs[lab]["block_k"]) in shape)
        if not labels:
            continue
        times = [{lab: _class_us(done, shapes, weights, m, lab) for lab in labels} for m in ms]
        cublas = [sum(weights.get(s, 1) * done[s, m]["cublas_us"] for s in shapes) for m in ms]
        currents = [[done[s, m]["current"] for s in shapes] for m in ms]
        rel = [{lab: t[lab] / min(t.values()) for lab in labels} for t in times]
        entry["ms"] = ms
        entry["buckets"] = []
        runs = _segments(rel, labels, min(max_buckets, len(ms)), min_gain)
        for number, (first, last, lab) in enumerate(runs):
            span = range(first, last + 1)
            current_ratio = {}
            for i in span:
                if len(set(currents[i])) == 1 and currents[i][0] in ran:
                    current_ratio[ms[i]] = _class_us(done, shapes, weights, ms[i], currents[i][0]) / cublas[i]
            entry["buckets"].append(dict(
                max_m=None if number == len(runs) - 1 else ms[last], label=lab, config=configs[lab],
                ms=[ms[i] for i in span], ratio={ms[i]: times[i][lab] / cublas[i] for i in span},
                current_ratio=current_ratio,
            ))
    return result


def table_text(recommendation: list[dict], table: TileTable = TILE_TABLE) -> str:
    """TILE_TABLE as Python to paste into kernels/triton_batch_invariant.py: the recommended buckets,
    today's for a class the sweep did not cover."""
    new_table, notes = [], []
    for (max_n, buckets), entry in zip(table, recommendation, strict=True):
        if entry["buckets"]:
            buckets = tuple((b["max_m"], TileConfig(**b["config"])) for b in entry["buckets"])
        new_table.append((max_n, buckets))
        notes.append(", ".join(entry["shapes"]) if entry["buckets"] else "today's buckets")
    check_tile_table(tuple(new_table))  # what the module checks at import
    lines = ["TILE_TABLE: TileTable = ("]
    for (max_n, buckets), note in zip(new_table, notes, strict=True):
        lines.append(f"    ({max_n}, (  # {note}")
        lines += [f"        ({max_m}, {config!r})," for max_m, config in buckets]
        lines.append("    )),")
    lines.append(")")
    return "\n".join(lines)


def summary_text(recommendation: list[dict], cases: list[dict]) -> str:
    lines = ["", "Recommended M buckets per N class (time: the class's shapes weighted by layers per "
             "forward, over cuBLAS; 'now': today's config):"]
    for entry in recommendation:
        lines.append(f"  {entry['name']} ({', '.join(entry['shapes']) or 'no shape swept'}):")
        if not entry["buckets"]:
            lines.append("    nothing usable swept: keep today's buckets")
        for bucket in entry["buckets"] or ():
            bound = f"m <= {bucket['max_m']}" if bucket["max_m"] is not None else "larger m"
            per_m = "  ".join(
                f"M={m} {ratio:.2f}x" + (f" (now {bucket['current_ratio'][m]:.2f}x)"
                                          if m in bucket["current_ratio"] else "")
                for m, ratio in bucket["ratio"].items()
            )
            lines.append(f"    {bound:<12} {bucket['label']:<28} {per_m}")
    changes = bit_changes(cases)
    lines.append("")
    if changes:
        lines.append(f"CANDIDATES THAT CHANGED BITS (never recommended): {len(changes)}")
        lines += [f"  {c['shape']} M={c['m']} {c['label']}: equal to today's at M: {c['equal_current']}, "
                  f"rows equal to the small batch's: {c['equal_small_batch']}" for c in changes]
    else:
        lines.append("No candidate changed bits.")
    skipped = [f"{c['shape']} M={c['m']}" for c in cases if "skipped" in c]
    if skipped:
        lines.append(f"Skipped (deadline): {', '.join(skipped)}")
    return "\n".join(lines)


# ---- the GPU part ---------------------------------------------------------------------------------


def _case_line(case: dict) -> str:
    head = f"{case['shape']:<8} M={case['m']:>5}"
    if "skipped" in case:
        return f"{head}  skipped: {case['skipped']}"
    best = best_candidate(case)
    current = next((c for c in case["candidates"] if c["label"] == case["current"]), None)
    now = (f"now {current['us'] / case['cublas_us']:.2f}x" if current and current.get("error") is None
           else "now: did not run")
    ran = [c for c in case["candidates"] if c.get("error") is None]
    changed = [c["label"] for c in ran if not bits_ok(c)]
    bits = f"{len(ran) - len(changed)}/{len(ran)} same bits"
    if changed:
        bits += f", CHANGED: {'; '.join(changed)}"
    if not case["current_rows_equal_small_batch"]:
        bits += ", TODAY'S CONFIG GAVE OTHER BITS THAN ITS SMALL BATCH"
    if best is None:
        return f"{head}  no candidate usable | cuBLAS {case['cublas_us']:.1f} us | {now} | {bits}"
    return (f"{head}  best {best['label']:<28} {best['us']:>8.1f} us | cuBLAS {case['cublas_us']:>8.1f} us | "
            f"{best['us'] / case['cublas_us']:.2f}x, {now} ({case['current']}) | {bits}")


def _try_matmul(x, weight, config: TileConfig, failed: dict[str, str]):
    """matmul with `config`, or None with the error kept in `failed` (a config the GPU cannot run, such
    as one out of shared memory, is reported, not fatal; triton raises several kinds of errors)."""
    from kernels.triton_batch_invariant import matmul

    try:
        out = matmul(x, weight, config=config)
        if out.is_cuda:
            torch.cuda.synchronize()
        return out
    except Exception as exc:  # noqa: BLE001
        failed[label(config)] = f"{type(exc).__name__}: {str(exc)[:300]}"
        return None


def sweep_shape(name: str, n: int, k: int, ms: tuple[int, ...], timer, deadline: float,
                failed: dict[str, str], gen: torch.Generator, warm_up=None) -> list[dict]:
    """The cases of one weight shape (the selection's input), printing a line for each. timer(fn) is
    fn's time in ms; `gen`'s device is where it runs; configs in `failed` (label -> error) are not
    run again, and those that fail here are added. Every candidate is compiled first, then warm_up()
    (if given) brings the clocks back up, so no compile pause sits between timings."""
    from kernels.triton_batch_invariant import matmul

    device = gen.device
    today = tuple(dict.fromkeys(tile_config(n, m, device) for m in ms))
    configs = candidate_configs(today[0].block_m, today[0].block_k, keep=today)
    weight = (torch.randn(n, k, device=device, generator=gen) / k**0.5).to(DTYPE)  # [N, K]
    x_all = torch.randn(max(ms), k, device=device, generator=gen).to(DTYPE)  # [max M, K]; x of M: x_all[:M]
    print(f"{name} (N={n}, K={k}): BLOCK_M {today[0].block_m}, BLOCK_K {today[0].block_k}, "
          f"{len(configs)} candidates", flush=True)
    if time.monotonic() <= deadline:
        for config in configs:
            if label(config) not in failed:
                _try_matmul(x_all[: min(ms)], weight, config, failed)
        if warm_up is not None:
            warm_up()
    cases = []
    for m in ms:
        if time.monotonic() > deadline:
            cases.append(dict(shape=name, n=n, k=k, m=m, skipped="deadline"))
            print(_case_line(cases[-1]), flush=True)
            continue
        x = x_all[:m]  # [M, K]
        rows = min(CHECK_ROWS, m)
        want = matmul(x, weight)  # today's config for M
        first, last = matmul(x[:rows], weight), matmul(x[m - rows :], weight)  # the small-batch bucket
        case = dict(
            shape=name, n=n, k=k, m=m, current=label(tile_config(n, m, device)),
            current_rows_equal_small_batch=(torch.equal(want[:rows], first)
                                            and torch.equal(want[m - rows :], last)),
            cublas_us=1000 * timer(lambda x=x: torch.nn.functional.linear(x, weight)),
            candidates=[],
        )
        for config in configs:
            entry = dict(label=label(config), config=dataclasses.asdict(config), us=None,
                         equal_current=None, equal_small_batch=None, error=failed.get(label(config)))
            case["candidates"].append(entry)
            out = None if entry["error"] is not None else _try_matmul(x, weight, config, failed)
            if out is None:
                entry["error"] = failed[entry["label"]]
                continue
            entry["equal_current"] = torch.equal(out, want)
            entry["equal_small_batch"] = torch.equal(out[:rows], first) and torch.equal(out[m - rows :], last)
            del out
            entry["us"] = 1000 * timer(lambda x=x, c=config: matmul(x, weight, config=c))
        del want
        cases.append(case)
        print(_case_line(case), flush=True)
    return cases


def _write(path: str | None, results: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


def run(opts: argparse.Namespace) -> dict:
    """The sweep: a line per (shape, M) as it goes, then the summary and the table to paste."""
    if not torch.cuda.is_available():
        raise SystemExit("--configs needs a CUDA device")
    import triton

    from kernels.bench import time_ms, warm_up_gpu

    start = time.monotonic()
    deadline = start + opts.deadline_s
    shapes = {name: SHAPES[name] for name in opts.shapes}
    results = dict(
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=triton.__version__,
        python=platform.python_version(),
        settings=dict(ms=list(opts.ms), shapes=shapes, rep_ms=opts.rep_ms, deadline_s=opts.deadline_s,
                      block_ns=BLOCK_NS, num_warps=NUM_WARPS, num_stages=NUM_STAGES, group_ms=GROUP_MS,
                      shared_memory_limit=SHARED_MEMORY_LIMIT, check_rows=CHECK_ROWS,
                      layers_per_forward=LAYERS_PER_FORWARD, max_buckets=opts.max_buckets, min_gain=MIN_GAIN),
        today=table_text([dict(buckets=None, shapes=[])] * len(TILE_TABLE)),  # to compare the pasted one
        cases=[],
    )
    _write(opts.out, results)  # an unwritable --out fails now, not after the sweep
    warm_up_gpu()
    gen = torch.Generator(device="cuda").manual_seed(0)
    failed: dict[str, str] = {}
    print(f"{results['device']}, bf16, torch {torch.__version__}, triton {triton.__version__}; "
          f"M = {', '.join(map(str, opts.ms))}; deadline {opts.deadline_s:.0f} s", flush=True)
    for name, (n, k) in shapes.items():
        print(f"-- {name}, {time.monotonic() - start:.0f} s so far", flush=True)
        timer = lambda fn: time_ms(fn, rep=opts.rep_ms)
        results["cases"] += sweep_shape(name, n, k, tuple(opts.ms), timer, deadline, failed, gen,
                                        warm_up=lambda: warm_up_gpu(0.3))
        torch.cuda.empty_cache()
        _write(opts.out, results)  # partial results survive a timeout
    recommendation = recommend(results["cases"], max_buckets=opts.max_buckets)
    results.update(failed_configs=failed, bit_changes=bit_changes(results["cases"]),
                   recommendation=recommendation, table=table_text(recommendation),
                   elapsed_s=time.monotonic() - start)
    if failed:
        print("\nconfigs that did not run: " + "; ".join(f"{lab}: {err}" for lab, err in failed.items()))
    print(summary_text(recommendation, results["cases"]))
    print("\nTo paste into kernels/triton_batch_invariant.py:\n" + results["table"])
    print(f"\n{results['elapsed_s']:.0f} s")
    _write(opts.out, results)
    return results


def _positive_ints(text: str) -> tuple[int, ...]:
    problem = f"expected comma-separated positive integers, got {text!r}"
    try:
        values = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(problem) from None
    if min(values) < 1:
        raise argparse.ArgumentTypeError(problem)
    return tuple(sorted(set(values)))


def _shape_names(text: str) -> tuple[str, ...]:
    names = tuple(part.strip() for part in text.split(","))
    unknown = [name for name in names if name not in SHAPES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown shape(s) {unknown}; known: {', '.join(SHAPES)}")
    return names


def build_parser(description: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", action="store_true", help="sweep M-bucket tile configs "
                        "(tests/gpu/gemm_sweep.py) instead of the micro-benchmark")
    sweep = parser.add_argument_group("with --configs")
    sweep.add_argument("--out", help="write every timing, bit check and the recommendation as JSON here")
    sweep.add_argument("--ms", type=_positive_ints, default=SWEEP_MS,
                       help=f"the M values, comma-separated (default {','.join(map(str, SWEEP_MS))})")
    sweep.add_argument("--shapes", type=_shape_names, default=tuple(SHAPES),
                       help=f"llama3-8b weights, comma-separated, of {','.join(SHAPES)} (default all)")
    sweep.add_argument("--rep-ms", type=int, default=20, help="do_bench repetition time per timing, ms")
    sweep.add_argument("--deadline-s", type=float, default=200.0,
                       help="(shape, M) cases not started this many seconds in are skipped (default 200)")
    sweep.add_argument("--max-buckets", type=int, default=MAX_BUCKETS, help="M buckets per N class at most")
    return parser


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    parser = build_parser(description)
    argv = sys.argv[1:] if argv is None else argv
    opts = parser.parse_args(argv)
    if not opts.configs:
        given = [flag for flag in ("--out", "--ms", "--shapes", "--rep-ms", "--deadline-s", "--max-buckets")
                 if any(arg == flag or arg.startswith(flag + "=") for arg in argv)]
        if given:
            parser.error(f"{', '.join(given)}: only with --configs")
    if opts.rep_ms < 1 or opts.deadline_s <= 0 or opts.max_buckets < 1:
        parser.error("--rep-ms and --max-buckets must be >= 1 and --deadline-s > 0")
    return opts
