"""Paired A/B runs of a benchmark command that prints JSON lines, each variant in its own processes:

    python -m clients.bench.ab --variant all:PAGEDSERVE_PDL_OFF= --variant rule: --rounds 3 \
        --key batch --value graph_forward_gpu_ms -- python -m clients.bench.step --batch 16,48 --context 800

Why: a decode step's graph time moves by 3-5 % from one process to the next with the same code
(docs/benchmarks.md round 18: two processes launching the same kernels differed by that much), so a
lever worth 1-3 % shows only in several rounds of both variants. Each round runs every variant once,
in the given order, then in reverse in the next round (A B, B A, A B, ...), so neither always runs
first on a warmer or cooler machine. A variant is `NAME:ENV=VALUE,ENV=VALUE` (`NAME:` changes no
variable; `ENV=` sets an empty value); its processes get the current environment with those set.

The command prints JSON lines (`clients.bench.step`) or one JSON document; `--rows runs` takes the rows
from the document's `runs` list, as `bench throughput --json` prints them, so a paired offline run is

    python -m clients.bench.ab --variant a: --variant b:ENV=1 --rounds 2 --rows runs --key label \
        --value output_tok_s -- python -m clients.cli bench throughput --model llama3-8b ... --json

Per key (a row's `--key` field, e.g. the batch size) it prints each variant's median of `--value`
over the rounds, and for every variant after the first the ratio of medians to the first's and the
range of the per-round ratios (a ratio range that straddles 1.0 says the difference is within the
processes' spread). `--out` also writes it all as JSON. A command that fails ends the run with its
exit status and its standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Variant:
    name: str
    env: dict[str, str]


def parse_variant(text: str) -> Variant:
    """`NAME:ENV=VALUE,ENV=VALUE` (ValueError naming what is wrong)."""
    name, sep, rest = text.partition(":")
    if not sep or not name.strip():
        raise ValueError(f"variant {text!r}: expected NAME:ENV=VALUE,... (NAME: for none)")
    env = {}
    for item in filter(None, (part.strip() for part in rest.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"variant {text!r}: {item!r} is not ENV=VALUE")
        env[key.strip()] = value
    return Variant(name.strip(), env)


def run_rounds(
    command: list[str], variants: list[Variant], rounds: int, key: str, value: str,
    rows_field: str | None = None,
) -> dict[str, list[dict]]:
    """{variant: [{key: value} for each round]}, each run a process of its own."""
    results: dict[str, list[dict]] = {v.name: [] for v in variants}
    for r in range(rounds):
        for variant in variants if r % 2 == 0 else list(reversed(variants)):
            proc = run_forwarding_sigterm(command, {**os.environ, **variant.env})
            if proc.returncode != 0:
                tail = proc.stderr[-2000:]
                raise RuntimeError(f"{variant.name}, round {r + 1}: exit {proc.returncode}: {tail}")
            rows = values_by_key(proc.stdout, key, value, rows_field)
            if not rows:
                where = f"no JSON row with {key!r} and {value!r}"
                if rows_field:
                    where += f" in {rows_field!r}"
                raise RuntimeError(f"{variant.name}, round {r + 1}: {where}")
            results[variant.name].append(rows)
    return results


def run_forwarding_sigterm(command: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    """The command's run (output captured). A SIGTERM to this process (`timeout`, a job runner) is
    passed to the command, which stops what it started (a bench stops its servers), and once it has
    exited this process exits too (SystemExit 143): killed at once, it would leave the command
    running, holding the GPU."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    terminated = []

    def forward(signum, frame):
        terminated.append(signum)
        proc.send_signal(signal.SIGTERM)

    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, forward) if main else None
    try:
        out, err = proc.communicate()
    finally:
        if main:
            signal.signal(signal.SIGTERM, previous)
    if terminated:
        raise SystemExit(128 + signal.SIGTERM)
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _field(row: dict, path: str):
    """row's value at a dotted path ("ideal.measured_over_ideal"), or None."""
    for part in path.split("."):
        if not isinstance(row, dict) or part not in row:
            return None
        row = row[part]
    return row


def values_by_key(stdout: str, key: str, value: str, rows_field: str | None = None) -> dict[str, float]:
    """{row[key]: row[value]} from a command's output: JSON documents among other text, each opening
    on a line of its own, one a line (`clients.bench.step`) or one over many (`bench throughput --json`
    after its servers' log lines, its rows in the list at `rows_field`: "runs"); a line that opens
    something that does not parse is skipped. `value` may be a dotted path."""
    decoder, docs, pos = json.JSONDecoder(), [], 0
    while pos < len(stdout):  # each line that opens a JSON value: decode it, however many lines it spans
        end = stdout.find("\n", pos)
        end = len(stdout) if end < 0 else end
        start = pos + len(stdout[pos:end]) - len(stdout[pos:end].lstrip())
        if stdout.startswith(("{", "["), start):
            try:
                doc, after = decoder.raw_decode(stdout, start)
            except ValueError:
                pass
            else:
                docs.append(doc)
                end = max(end, after)
        pos = end + 1
    rows = []
    for doc in docs:
        if rows_field is not None:
            doc = _field(doc, rows_field) if isinstance(doc, dict) else None
        rows.extend(doc if isinstance(doc, list) else [doc])
    out = {}
    for row in rows:
        k, v = _field(row, key), _field(row, value)
        if k is not None and isinstance(v, (int, float)) and not isinstance(v, bool):
            out[str(k)] = float(v)
    return out


def summarize(results: dict[str, list[dict]]) -> list[dict]:
    """Per key: each variant's median, and against the first variant the ratio of medians and the
    lowest and highest per-round ratio."""
    names = list(results)
    base = names[0]
    keys = [k for k in results[base][0] if all(k in rows for v in names for rows in results[v])]
    table = []
    for k in keys:
        row: dict = {"key": k}
        for name in names:
            row[name] = statistics.median(rows[k] for rows in results[name])
        for name in names[1:]:
            per_round = [b[k] / a[k] for a, b in zip(results[base], results[name], strict=True)]
            row[f"{name}/{base}"] = row[name] / row[base]
            row[f"{name}/{base} range"] = (min(per_round), max(per_round))
        table.append(row)
    return table


def format_summary(table: list[dict], names: list[str], value: str) -> str:
    lines = [f"median {value} over the rounds; ratio to {names[0]} (per-round range)"]
    for row in table:
        parts = [f"{row['key']:>8}"] + [f"{name} {row[name]:.4g}" for name in names]
        for name in names[1:]:
            low, high = row[f"{name}/{names[0]} range"]
            parts.append(f"{name}/{names[0]} {row[f'{name}/{names[0]}']:.3f} ({low:.3f}-{high:.3f})")
        lines.append("  ".join(parts))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        print("clients.bench.ab: give the command after --", file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(prog="python -m clients.bench.ab", description=__doc__.split("\n")[0])
    parser.add_argument("--variant", action="append", required=True, help="NAME:ENV=VALUE,... (two or more)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--key", default="batch", help="the JSON field that names a row")
    parser.add_argument("--value", default="graph_forward_gpu_ms",
                        help="the JSON field compared (a dotted path: ideal.measured_over_ideal)")
    parser.add_argument("--rows", default=None,
                        help="rows: the list at this field of one JSON document (bench's --json: runs)")
    parser.add_argument("--out", default=None, help="also write the rounds and the summary here (JSON)")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    try:
        variants = [parse_variant(v) for v in args.variant]
    except ValueError as err:
        parser.error(str(err))
    if len(variants) < 2 or len({v.name for v in variants}) != len(variants):
        parser.error("give two or more --variant, each with its own name")
    if args.rounds < 1 or not command:
        parser.error("--rounds must be >= 1 and a command must follow --")
    try:
        results = run_rounds(command, variants, args.rounds, args.key, args.value, args.rows)
    except RuntimeError as err:
        print(f"clients.bench.ab: {err}", file=sys.stderr)
        return 1
    table = summarize(results)
    names = [v.name for v in variants]
    print(format_summary(table, names, args.value))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"variants": {v.name: v.env for v in variants}, "command": command,
                       "rounds": results, "summary": table}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
