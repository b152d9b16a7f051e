"""The machine code of a paged-attention launch, compiled for a GPU this machine does not have.

`python -m kernels.sass --seqs 33 --context 600` takes the launch that kernels.triton_attention makes for
that decode step (its tile, its flags, its specialization: the host code runs on meta tensors and the
kernel call is recorded, not run), compiles it for sm_90 with the Triton and ptxas of this environment,
and prints the kernel's registers, spill stack and shared memory, and for every loop of its SASS the
instruction count and the opcodes. The K/V loop's instructions are what a one-warp decode program
issues for each tile it reads (docs/benchmarks.md rounds 31 and 32: 532 a 32-position tile with 64-bit
offsets, 392 with 32-bit ones). The launch follows the environment as the engine's does
(`PAGEDSERVE_KV_ADDRESSING=64 python -m kernels.sass` gives the form before round 32), and `--set
NAME=VALUE` overrides any constexpr of the recorded launch, so two forms compare on one machine without a
GPU. Counts are static: a loop's body once, whatever the branches inside it take.
"""

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import subprocess
import sys
import tempfile
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import create_function_from_signature

from kernels import triton_attention

NVIDIA_BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*(.*?)\s*;")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_TARGET = re.compile(r"\(\s*(\.L_x_\d+)\s*\)")


@dataclasses.dataclass(frozen=True)
class Launch:
    grid: tuple
    args: tuple
    kwargs: dict


@dataclasses.dataclass(frozen=True)
class Loop:
    instructions: int
    opcodes: collections.Counter  # by opcode without modifiers: HMMA, IMAD, LDGSTS, ...


@dataclasses.dataclass(frozen=True)
class Report:
    registers: int
    stack: int  # bytes a thread of spilled registers (and other local memory)
    shared: int  # dynamic shared memory bytes a program
    loops: list[Loop]


def decode_launch(seqs: int, context: int, *, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                  block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                  cache_dtype: torch.dtype | None = None, cache_blocks: int | None = None,
                  sms: int = 132, **options) -> Launch:
    """The _paged_attention_kernel launch paged_attention makes for a decode step of `seqs` sequences of
    `context` positions on a GPU of `sms` SMs, recorded from its host code on meta tensors. cache_blocks:
    the layer cache's blocks (its size decides OFFSET32; default: just the step's). options go to
    paged_attention (num_splits, tile, ...)."""
    meta = dict(device="meta")
    blocks_per_seq = -(-context // block_size)
    cache_blocks = cache_blocks or seqs * blocks_per_seq
    cache_shape = (cache_blocks, block_size, kv_heads, head_dim)
    cache_dtype = cache_dtype or dtype
    query = torch.empty(seqs, heads, head_dim, dtype=dtype, **meta)
    key_cache = torch.empty(cache_shape, dtype=cache_dtype, **meta)
    value_cache = torch.empty(cache_shape, dtype=cache_dtype, **meta)
    block_tables = torch.empty(seqs, blocks_per_seq, dtype=torch.int32, **meta)
    seq_lens = torch.empty(seqs, dtype=torch.int32, **meta)
    query_start_loc = torch.empty(seqs + 1, dtype=torch.int32, **meta)
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: seen.append(Launch(grid, args, kwargs))

    class Skip:  # the split reduce after a split launch: not recorded, not run
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(triton_attention, "_paged_attention_kernel", Recorder()))
        stack.enter_context(mock.patch.object(triton_attention, "_reduce_splits_kernel", Skip()))
        stack.enter_context(mock.patch.object(triton_attention, "split_slots", lambda device: 2 * sms))
        triton_attention.paged_attention(query, key_cache, value_cache, block_tables, seq_lens,
                                         query_start_loc, 1, context, head_dim ** -0.5, **options)
    if len(seen) != 1:
        raise RuntimeError(f"expected one attention launch, recorded {len(seen)}")
    launch = seen[0]
    # on a GPU the launch rounds the rotary products as CUDA does (RN = query.is_cuda)
    return dataclasses.replace(launch, kwargs={**launch.kwargs, "RN": True})


def compile_launch(launch: Launch, overrides: dict | None = None, arch: int = 90):
    """triton.compile of the launch's kernel for sm_{arch}, specialized as the JIT would for those
    arguments (divisibility by 16, ints equal to 1); overrides replace constexpr keyword arguments."""
    fn = triton_attention._paged_attention_kernel
    if not isinstance(fn, triton.runtime.JITFunction):
        raise RuntimeError("kernels.triton_attention was imported under TRITON_INTERPRET=1: no kernel to "
                           "compile")
    kwargs = {**launch.kwargs, **(overrides or {})}
    unknown = set(overrides or {}) - {p.name for p in fn.params if p.is_constexpr}
    if unknown:
        raise ValueError(f"not constexpr parameters of {fn.__name__}: {sorted(unknown)}")
    kwargs.setdefault("debug", False)
    kwargs.setdefault("instrumentation_mode", "")
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    source = ASTSource(fn, signature, constexprs, attrs)
    return triton.compile(source, target=target, options=options.__dict__)


def _tool(name: str, *args: str) -> str:
    return subprocess.run([os.path.join(NVIDIA_BIN, name), *args], capture_output=True, text=True,
                          check=True).stdout


def loops_of(sass: str) -> list[Loop]:
    """Each loop of nvdisasm's listing: from a label to a branch back to it, in program order."""
    program = []  # (label, opcode)
    for line in sass.splitlines():
        if m := _LABEL.match(line):
            program.append((m.group(1), None))
        elif m := _INSTRUCTION.match(line):
            program.append((None, (m.group(1), m.group(2))))
    where = {label: i for i, (label, _) in enumerate(program) if label}
    loops = []
    for i, (_, ins) in enumerate(program):
        m = _TARGET.search(ins[1]) if ins and ins[0].startswith("BRA") else None
        if m and where.get(m.group(1), i) < i:  # a branch back
            body = [ins[0].split(".")[0] for _, ins in program[where[m.group(1)]:i + 1] if ins]
            loops.append(Loop(len(body), collections.Counter(body)))
    return loops


def report(kernel) -> Report:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(kernel.asm["cubin"])
        usage = _tool("cuobjdump", "-res-usage", path)
        sass = _tool("nvdisasm", "-c", path)
    m = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    return Report(int(m.group(1)), int(m.group(2)), kernel.metadata.shared, loops_of(sass))


def _value(text: str):
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return {"True": True, "False": False}.get(text, text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.sass", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seqs", type=int, default=33)
    ap.add_argument("--context", type=int, default=600)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--cache", choices=["auto", "fp8"], default="auto", help="fp8: an e4m3 cache")
    ap.add_argument("--cache-blocks", type=int, help="the layer cache's blocks (decides OFFSET32)")
    ap.add_argument("--sms", type=int, default=132, help="the GPU's SMs (the split and balance rules)")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                    help="override a constexpr of the recorded launch (0/1 for flags)")
    args = ap.parse_args(argv)
    overrides = {}
    for item in args.set:
        name, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set takes NAME=VALUE, got {item!r}")
        overrides[name] = _value(value)
    launch = decode_launch(args.seqs, args.context, heads=args.heads, kv_heads=args.kv_heads,
                           head_dim=args.head_dim, block_size=args.block_size, sms=args.sms,
                           cache_dtype=torch.float8_e4m3fn if args.cache == "fp8" else None,
                           cache_blocks=args.cache_blocks)
    kw = {**launch.kwargs, **overrides}
    print(f"grid {launch.grid}; tile (BLOCK_N {kw['BLOCK_N']}, {kw['num_warps']} warps, {kw['num_stages']} "
          f"stages); " + ", ".join(f"{k} {kw[k]}" for k in ("BALANCED", "SPLIT", "BULK_N", "BLOCK_ADDR",
                                                            "EVEN_D", "OFFSET32", "BULK_TAIL")))
    try:
        kernel = compile_launch(launch, overrides, args.arch)
    except ValueError as e:  # an override that names no constexpr
        ap.error(str(e))
    rep = report(kernel)
    print(f"sm_{args.arch}: {rep.registers} registers, {rep.stack} bytes of stack, {rep.shared} bytes of "
          "shared memory a program")
    for loop in rep.loops:
        top = ", ".join(f"{op} {n}" for op, n in loop.opcodes.most_common(10))
        print(f"  loop of {loop.instructions} instructions ({loop.opcodes['HMMA']} HMMA): {top}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
