"""The `pagedserve` command.

Each subcommand lives in the module that implements it and exposes `add_arguments(parser)` and
`run(args) -> int`; this file only dispatches, importing the module of the chosen subcommand alone
(so `pagedserve simulate` never imports torch).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import sys

# name -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "simulate": ("scheduler_svc.sim.simulator", "replay a workload through the real scheduler (no GPU)"),
    "serve": ("clients.cli.serve", "start the executor(s) and the scheduler; serve the Generation API"),
    "generate": ("clients.cli.generate", "send one request to a server and stream its output"),
    "loadgen": (
        "clients.bench.loadgen",
        "sustained concurrent load that checks every result and leaked blocks",
    ),
    "make-tiny-model": (
        "clients.cli.make_tiny_model",
        "write a tiny random-weight model folder (tests, demos)",
    ),
    "bench": ("clients.bench.run", "throughput / latency benchmark through the gRPC services (and HF peers)"),
}


def version() -> str:
    try:
        return importlib.metadata.version("pagedserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    parser.add_argument("--version", action="version", version=f"pagedserve {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (_, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    if argv and argv[0] == "--version":
        parser.parse_args(argv[:1])  # prints the version and exits
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in SUBCOMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            parser.print_usage(sys.stderr)
            print(f"pagedserve: unknown command {argv[0]!r}", file=sys.stderr)
            return 2
        parser.print_help()
        return 0
    name = argv[0]
    module = importlib.import_module(SUBCOMMANDS[name][0])
    sub = argparse.ArgumentParser(prog=f"pagedserve {name}", description=SUBCOMMANDS[name][1],
                                  formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    module.add_arguments(sub)
    args = sub.parse_args(argv[1:])
    try:
        return int(module.run(args) or 0)
    except KeyboardInterrupt:  # Ctrl-C: a line, not a traceback
        print(f"\npagedserve {name}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
