"""`pagedserve bench repeat` (issue 18): are a server's tokens reproducible, across runs, across
batch compositions, and across an executor SIGKILL?

    pagedserve bench repeat --model llama3-8b [--deterministic] --requests 32 --max-tokens 400

The executor(s) and the scheduler run under `pagedserve serve`'s own supervisor (launcher.supervise,
in a thread of this process: the executors are this process's children), then:

    A       --requests greedy requests (random token-id prompts of 16..400 tokens, ignore_eos), all at once
    B       the same set again on the same server                  B vs A: run to run
    C       the same set again; --kill-after-s into it rank 0's    C vs A: across a recompute (the
            executor gets SIGKILL, the supervisor restarts the     prompt and the tokens so far as one
            set, the scheduler recomputes what was in flight       prefill, where A decoded them)
    seeded  one sampled request (temperature 0.8, top_p 0.95,      its tokens vs the first batch
            seed 1234) alone and among 6, 63, 255 other sampled    size's: batch invariance
            requests (--batch-sizes 1,7,64,256), sent after them

--kill-after-s defaults to half of B's wall time (B's, not A's: A may carry a fresh server's first-use
costs, such as kernel compiles, that C does not). Restarts are counted as the rank-0 executor pids
seen. A request's agreement is its common prefix with A's tokens over the longer length. The kill is sent
only while requests are in flight; one whose time comes after run C ended is not sent, and the
report says so. Prefix caching is off, as in every bench mode, so B and C compute their prompts
afresh. The servers' own output shares this process's stdout and stderr; --out holds the JSON alone.

Across servers: `--save-tokens FILE` keeps run A's tokens and the seeded target's per batch size
(clients/bench/repeat_tokens.py), and `--compare-tokens FILE` on another server (the same request
set) compares its own with them, e.g. a server whose small KV cache forces preemption and whose small
steps chunk the prompts against one with room for everything:

    pagedserve bench repeat --deterministic --save-tokens big.json
    pagedserve bench repeat --deterministic --num-gpu-blocks 64 --preemption swap \\
        --max-num-batched-tokens 256 --compare-tokens big.json

The report lists the KV cache and step options and each run's preemptions and swapped-out blocks;
differences from the file are results, not failures (the exit status counts lost requests only).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from clients.bench.load import Progress
from clients.bench.repeat_tokens import (
    Generation,
    RequestSet,
    TokensFileError,
    agreement,
    common_prefix,
    compare_with_saved,
    describe_seeded_vs_reference,
    load_tokens,
    same_tokens,
    save_tokens,
)
from clients.bench.serving import sigterm_raises
from clients.cli import serve as launcher
from clients.cli.supervise import executor_credential, pids_of
from clients.client import AsyncClient
from scheduler_svc.wire.grpc_serving import health_status

EXECUTOR = "executor_svc.server.main"
MIN_PROMPT_LEN, MAX_PROMPT_LEN = 16, 400
MIN_TOKEN_ID = 10  # random prompts keep clear of the low (special) token ids
GREEDY = {"temperature": 0.0}
SAMPLED = {"temperature": 0.8, "top_p": 0.95}
TARGET_SEED = 1234  # the seeded check's target request (its prompt is drawn from this seed too)
TARGET_PROMPT_LEN = 64
WATCH_PERIOD_S = 0.1


def add_repeat_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of repeat beyond the serve flags and bench's --requests, --seed, --json, --out and
    --no-progress."""
    parser.add_argument("--max-tokens", type=int, default=400, help="output tokens of every request")
    parser.add_argument("--kill-after-s", type=float, default=None,
                        help="run C: seconds until rank 0's executor gets SIGKILL (default: half of run B's "
                             "wall time)")
    parser.add_argument("--batch-sizes", default="1,7,64,256",
                        help="the seeded check: the target request among this many requests in all; each "
                             "size's target tokens are compared with the first size's")
    parser.add_argument("--save-tokens", default=None, metavar="FILE",
                        help="write the request set, run A's tokens and the seeded target's tokens per "
                             "batch size to this JSON file (for --compare-tokens on another server)")
    parser.add_argument("--compare-tokens", default=None, metavar="FILE",
                        help="compare run A and the seeded target with a --save-tokens file of the same "
                             "request set (e.g. one made without preemption or chunking)")


# ---- the servers: `pagedserve serve`'s supervisor in a thread ---------------------------------------


@dataclass(slots=True)
class Supervision:
    """The launched servers: the public target, and every rank-0 executor seen (in order: a new pid
    is a restart of the set)."""

    target: str
    thread: threading.Thread
    rank0_pids: list[int] = field(default_factory=list)

    @property
    def num_restarts(self) -> int:
        return max(0, len(self.rank0_pids) - 1)


def rank0_executor() -> int | None:
    """The pid of this process's rank-0 executor child, or None (none, or between a kill and the
    restart)."""
    pids = pids_of(EXECUTOR, "--rank 0 ", parent=os.getpid())
    return pids[0] if len(pids) == 1 else None


@contextlib.contextmanager
def supervised(args: argparse.Namespace, model: str) -> Iterator[Supervision]:
    """Runs launcher.supervise (it sets no signal handlers: `serve`'s run does) in a thread on a free
    port until the public target is SERVING; at exit sets its stop event and joins it (the ordered
    stop of every process)."""
    serve_args = argparse.Namespace(**vars(args))
    serve_args.port = launcher.free_port()
    stop = threading.Event()
    thread = threading.Thread(target=launcher.supervise, args=(serve_args, model, stop, sys.__stderr__),
                              name="pagedserve-supervise")

    def stop_servers() -> None:  # on SIGTERM, before the run in progress unwinds
        stop.set()
        if thread.ident is not None:
            thread.join()

    with executor_credential(serve_args), sigterm_raises(stop_servers):
        servers = Supervision(f"127.0.0.1:{serve_args.port}", thread)
        watcher = threading.Thread(target=_watch_rank0, args=(servers, stop), name="rank0-watch", daemon=True)
        thread.start()
        watcher.start()
        try:
            _wait_serving(servers, args.startup_timeout)
            yield servers
        finally:
            stop_servers()
            watcher.join()


def _watch_rank0(servers: Supervision, stop: threading.Event) -> None:
    while not stop.wait(WATCH_PERIOD_S):
        pid = rank0_executor()
        if pid is not None and (not servers.rank0_pids or servers.rank0_pids[-1] != pid):
            servers.rank0_pids.append(pid)


def _wait_serving(servers: Supervision, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not servers.thread.is_alive():
            raise RuntimeError("the servers did not start (see their output above)")
        if health_status(servers.target, timeout_s=1.0) == "SERVING":
            return
        time.sleep(0.2)
    raise TimeoutError(f"{servers.target} did not become SERVING within {timeout_s:.0f} s")


# ---- one set of requests, all sent at once -----------------------------------------------------------


@dataclass(slots=True)
class SetRun:
    label: str
    generations: list[Generation]
    wall_s: float
    preemptions: int | None  # during the run, from the server's stats (None: not read)
    swapped_out_blocks: int | None
    kill: dict | None = None

    def summary(self) -> dict:
        failed = [g for g in self.generations if not g.finished]
        return {
            "label": self.label, "num_requests": len(self.generations), "wall_s": round(self.wall_s, 3),
            "num_failed": len(failed), "output_tokens": sum(len(g.tokens) for g in self.generations),
            "preemptions": self.preemptions, "swapped_out_blocks": self.swapped_out_blocks,
            "errors": sorted({g.error or "timed out" for g in failed})[:5],
        }


async def _generate(client: AsyncClient, prompt: list[int], sampling: dict, max_tokens: int,
                    generation: Generation, progress: Progress) -> None:
    try:
        async for delta in client.stream(prompt, max_tokens=max_tokens, ignore_eos=True, **sampling):
            for out in delta.outputs:  # n = 1: one output
                generation.tokens.extend(out.token_ids)
                progress.update(tokens=len(out.token_ids))
        generation.finished = True
    except Exception as err:  # noqa: BLE001 - reported per request, the run goes on
        generation.error = f"{type(err).__name__}: {err}"
    progress.update(done=1)


async def _kill_rank0(after_s: float, progress: Progress, start: float) -> dict:
    """SIGKILL to rank 0's executor `after_s` into a run (this task is cancelled if the run ends
    first), with what was in flight at that moment."""
    await asyncio.sleep(after_s)
    pid = rank0_executor()
    in_flight = progress.num_requests - progress.done
    kill = {"planned_after_s": round(after_s, 3), "at_s": round(time.perf_counter() - start, 3), "pid": pid,
            "requests_in_flight": in_flight,
            "tokens_received": progress.tokens, "tokens_expected": progress.total_tokens}
    if pid is None:
        return kill | {"sent": False, "landed_mid_run": False, "why": "no rank-0 executor was found"}
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return kill | {"sent": False, "landed_mid_run": False,
                       "why": f"rank 0's executor (pid {pid}) had exited"}
    return kill | {"sent": True, "landed_mid_run": in_flight > 0}


async def _kv_counters(client: AsyncClient) -> tuple[int, int] | None:
    """The server's preemptions and swapped-out blocks so far, or None."""
    try:
        stats = await client.stats()
    except grpc.RpcError:
        return None
    return stats.num_preemptions, stats.num_swapped_out_blocks


async def run_set(
    target: str, label: str, prompts: list[list[int]], samplings: list[dict], max_tokens: int,
    show_progress: bool, timeout_s: float | None = None, kill_after_s: float | None = None,
) -> SetRun:
    """Sends every request at once and waits for all (at most `timeout_s`: the unfinished ones count
    as failed); with `kill_after_s`, rank 0's executor gets SIGKILL that long into the run if it has
    not ended by then."""
    generations = [Generation() for _ in prompts]
    progress = Progress(label, len(prompts), len(prompts) * max_tokens, show_progress)
    async with AsyncClient(target) as client:
        before = await _kv_counters(client)
        start = time.perf_counter()
        killer = None
        if kill_after_s is not None:
            killer = asyncio.create_task(_kill_rank0(kill_after_s, progress, start))
        sends = [_generate(client, p, s, max_tokens, g, progress)
                 for p, s, g in zip(prompts, samplings, generations, strict=True)]
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*sends), timeout_s)
        wall_s = time.perf_counter() - start
        progress.close()
        kill = None
        if killer is not None:
            if killer.done():
                kill = killer.result()
            else:
                killer.cancel()
                kill = {"planned_after_s": round(kill_after_s or 0.0, 3), "sent": False,
                        "landed_mid_run": False, "why": f"the run ended ({wall_s:.2f} s) before its time"}
        after = await _kv_counters(client)
    if before is None or after is None:
        return SetRun(label, generations, wall_s, None, None, kill)
    return SetRun(label, generations, wall_s, after[0] - before[0], after[1] - before[1], kill)


# ---- the command -----------------------------------------------------------------------------------------


def parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        sizes = []
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-sizes: positive integers, comma-separated, got {text!r}")
    return sizes


def check_repeat_args(args: argparse.Namespace) -> str | None:
    """Why these options cannot run (before any process starts), or None."""
    try:
        parse_batch_sizes(args.batch_sizes)
    except ValueError as err:
        return str(err)
    if args.requests < 1 or args.max_tokens < 1:
        return "--requests and --max-tokens must be >= 1"
    if args.kill_after_s is not None and not args.kill_after_s >= 0:
        return "--kill-after-s must be >= 0"
    if args.tls_cert_file:
        return "bench repeat talks plaintext to the servers it launches: no --tls-cert-file"
    if args.compare_tokens and not pathlib.Path(args.compare_tokens).is_file():
        return f"--compare-tokens {args.compare_tokens}: no such file"
    return launcher.check_options(args)


def random_prompt(rng: random.Random, vocab_size: int, max_len: int,
                  min_len: int = MIN_PROMPT_LEN) -> list[int]:
    return [rng.randrange(MIN_TOKEN_ID, vocab_size) for _ in range(rng.randint(min_len, max_len))]


def run_repeat(args: argparse.Namespace) -> int:
    if (problem := check_repeat_args(args)) is not None:
        print(f"pagedserve bench: {problem}", file=sys.stderr)
        return 2
    model, spec = launcher.resolve_model(args)
    max_prompt_len = min(MAX_PROMPT_LEN, (args.max_model_len or spec.max_model_len) - args.max_tokens)
    if max_prompt_len < MIN_PROMPT_LEN:
        print(f"pagedserve bench: --max-tokens {args.max_tokens} leaves no room for a {MIN_PROMPT_LEN}-token "
              "prompt within the model's length", file=sys.stderr)
        return 2
    rng = random.Random(args.seed)
    prompts = [random_prompt(rng, spec.vocab_size, max_prompt_len) for _ in range(args.requests)]
    target = target_prompt(spec.vocab_size, max_prompt_len)
    request_set = RequestSet.of(args.seed, args.max_tokens, spec.vocab_size, prompts, target)
    saved = None
    if args.compare_tokens:
        try:
            saved = load_tokens(args.compare_tokens, request_set)
        except TokensFileError as err:
            print(f"pagedserve bench: {err}", file=sys.stderr)
            return 2
    greedy = [GREEDY] * len(prompts)
    show = not args.no_progress
    result: dict = {
        "mode": "repeat",
        "model": args.model or launcher.DEFAULT_MODEL_DIR.name,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "seed": args.seed,
        "server": server_flags(args),
    }
    with supervised(args, model) as servers:
        run_a = asyncio.run(run_set(servers.target, "A", prompts, greedy, args.max_tokens, show))
        run_b = asyncio.run(run_set(servers.target, "B", prompts, greedy, args.max_tokens, show))
        # B's time, not A's: A may include a fresh server's first-use costs (kernel compiles) C does not
        kill_after_s = run_b.wall_s / 2 if args.kill_after_s is None else args.kill_after_s
        timeout_s = args.startup_timeout + 10 * run_a.wall_s + 60  # a restart, then the whole set recomputed
        run_c = asyncio.run(run_set(servers.target, "C", prompts, greedy, args.max_tokens, show, timeout_s,
                                    kill_after_s))
        seeded, targets = seeded_check(args, servers.target, target, spec.vocab_size, max_prompt_len,
                                       timeout_s)
        result["executor_restarts"] = servers.num_restarts
        result["servers_ended_early"] = not servers.thread.is_alive()
    result["runs"] = [run.summary() for run in (run_a, run_b, run_c)]
    result["b_vs_a"] = agreement(run_a.generations, run_b.generations)
    result["c_vs_a"] = agreement(run_a.generations, run_c.generations)
    result["kill"] = run_c.kill
    result["seeded"] = seeded
    if saved is not None:
        result["vs_reference"] = compare_with_saved(args.compare_tokens, saved, run_a.generations, targets)
    if args.save_tokens:
        save_tokens(args.save_tokens, result["model"], request_set, result["server"], run_a.generations,
                    seeded["sampling"], targets)
    text = json.dumps(result, indent=2)
    if args.out:
        pathlib.Path(args.out).write_text(text + "\n")
    print(text if args.json else format_repeat(result), flush=True)
    lost = any(r["num_failed"] for r in result["runs"]) or seeded["num_failed"]
    return 1 if lost or result["servers_ended_early"] else 0


def target_prompt(vocab_size: int, max_prompt_len: int) -> list[int]:
    """The seeded check's target prompt: fixed by its seed and the length the model leaves."""
    length = min(TARGET_PROMPT_LEN, max_prompt_len)
    return random_prompt(random.Random(TARGET_SEED), vocab_size, length, min_len=length)


def seeded_check(args: argparse.Namespace, target: str, prompt: list[int], vocab_size: int,
                 max_prompt_len: int, timeout_s: float) -> tuple[dict, list[tuple[int, Generation]]]:
    """The target request (seed 1234, `prompt`) among size - 1 other sampled requests of random
    lengths and their own seeds, per batch size; its tokens against the first size's. The target is
    sent last: the youngest request, the first one a full KV cache preempts. Also returns the
    target's generation per size."""
    target_sampling = SAMPLED | {"seed": TARGET_SEED}
    sizes = parse_batch_sizes(args.batch_sizes)
    runs = []
    for size in sizes:
        rng = random.Random(args.seed + size)
        others = [random_prompt(rng, vocab_size, max_prompt_len) for _ in range(size - 1)]
        samplings = [SAMPLED | {"seed": i + 1} for i in range(size - 1)] + [target_sampling]
        batch = run_set(target, f"seeded[{size}]", [*others, prompt], samplings, args.max_tokens,
                        not args.no_progress, timeout_s)
        runs.append(asyncio.run(batch))
    reference = runs[0].generations[-1]
    batches = []
    for size, run in zip(sizes, runs, strict=True):
        tokens = run.generations[-1]
        batches.append({
            "batch_size": size, "num_tokens": len(tokens.tokens), "finished": tokens.finished,
            "equal_to_first": same_tokens(reference, tokens),
            "common_prefix": common_prefix(reference.tokens, tokens.tokens),
            "wall_s": round(run.wall_s, 3), "num_failed": run.summary()["num_failed"],
            "preemptions": run.preemptions, "swapped_out_blocks": run.swapped_out_blocks,
        })
    summary = {"sampling": target_sampling, "prompt_len": len(prompt), "batches": batches,
               "num_failed": sum(b["num_failed"] for b in batches)}
    return summary, [(size, run.generations[-1]) for size, run in zip(sizes, runs, strict=True)]


def server_flags(args: argparse.Namespace) -> dict:
    """The server options that bear on reproducibility, and the device."""
    device = args.device or "default (cuda if available)"
    return {
        "deterministic": args.deterministic, "enforce_eager": args.enforce_eager,
        "tensor_parallel_size": args.tensor_parallel_size, "dtype": args.dtype, "device": device,
        "device_name": _cpu_name() if args.device == "cpu" else _gpu_name(),
        "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
        "enable_prefix_caching": args.enable_prefix_caching,
        "num_gpu_blocks": args.num_gpu_blocks, "num_cpu_blocks": args.num_cpu_blocks,
        "block_size": args.block_size, "preemption": args.preemption, "kv_policy": args.kv_policy,
    }


def _cpu_name() -> str | None:
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return None


def _gpu_name() -> str | None:
    """GPU 0's name from nvidia-smi (this process imports no torch), or None."""
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", "0"],
                              capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip().splitlines()[0] if done.stdout.strip() else None


def format_repeat(result: dict) -> str:
    s = result["server"]
    on = {True: "on", False: "off"}
    lines = [
        f"pagedserve bench repeat: {result['model']} on {s['device']} ({s['device_name'] or 'unknown'}), "
        f"deterministic {on[s['deterministic']]}, enforce_eager {on[s['enforce_eager']]}, "
        f"TP {s['tensor_parallel_size']}, dtype {s['dtype']}; {result['requests']} greedy requests x "
        f"{result['max_tokens']} tokens",
        describe_kv(s),
        f"{'run':>4} {'wall s':>8} {'failed':>6} {'preempt':>7} {'swap-out blocks':>15}",
    ]
    for r in result["runs"]:
        errors = f"  {'; '.join(r['errors'])}" if r["errors"] else ""
        lines.append(f"{r['label']:>4} {r['wall_s']:>8.2f} {r['num_failed']:>6} {str(r['preemptions']):>7} "
                     f"{str(r['swapped_out_blocks']):>15}{errors}")
    lines.append(f"{'':>8} {'identical':>10} {'mean agreement':>15} {'first difference min/median/max':>32}")
    reference = result.get("vs_reference")
    rows = [("B vs A", result["b_vs_a"]), ("C vs A", result["c_vs_a"])]
    if reference is not None:
        rows.append(("A vs ref", reference["a_vs_reference"]))
    for name, c in rows:
        f = c["first_difference"]
        where = "-" if f is None else f"{f['min']}/{f['median']:g}/{f['max']}"
        lines.append(f"{name:>8} {c['num_identical']:>4}/{c['num_requests']:<5} {c['mean_agreement']:>15.2%} "
                     f"{where:>32}")
    lines.append(f"kill (run C): {describe_kill(result['kill'])}; "
                 f"executor restarts: {result['executor_restarts']}")
    if reference is not None:
        there = reference["server"]
        lines.append(f"ref: {reference['file']} ({reference['model']}, deterministic "
                     f"{on[there['deterministic']]}, dtype {there['dtype']}; {describe_kv(there)})")
    seeded = result["seeded"]
    sampling = ", ".join(f"{k} {v}" for k, v in seeded["sampling"].items())
    lines.append(f"seeded ({sampling}, prompt {seeded['prompt_len']} tokens):")
    first = seeded["batches"][0]["batch_size"]
    vs_reference = [None] * len(seeded["batches"]) if reference is None else reference["seeded"]
    for b, ref in zip(seeded["batches"], vs_reference, strict=True):
        verdict = ("equal" if b["equal_to_first"]
                   else f"differs from batch {first} at token {b['common_prefix']}")
        lines.append(f"  batch {b['batch_size']:>4}: {b['num_tokens']} tokens, {verdict}"
                     + ("" if b["finished"] else " (did not finish)")
                     + ("" if ref is None else f"; {describe_seeded_vs_reference(ref)}")
                     + f" ({b['preemptions']} preemptions)")
    return "\n".join(lines)


def describe_kv(server: dict) -> str:
    """The KV cache and step options that make a run preempt (swap or recompute) and chunk prompts."""
    def blocks(n: int | None) -> str:
        return "what fits" if n is None else f"{n} blocks"

    return (f"KV cache {blocks(server['num_gpu_blocks'])} ({server['block_size']} tokens a block), "
            f"swap space {blocks(server['num_cpu_blocks'])}, preemption {server['preemption']}, "
            f"max batched tokens {server['max_num_batched_tokens']}, max seqs {server['max_num_seqs']}")


def describe_kill(kill: dict | None) -> str:
    if kill is None:
        return "none"
    if not kill["sent"]:
        return f"not sent: {kill['why']} (--kill-after-s {kill['planned_after_s']})"
    landed = "while requests were in flight" if kill["landed_mid_run"] else "after every request had ended"
    return (f"SIGKILL to rank 0 (pid {kill['pid']}) at {kill['at_s']:.2f} s, {landed} "
            f"({kill['requests_in_flight']} unfinished, {kill['tokens_received']}/{kill['tokens_expected']} "
            "tokens received)")
