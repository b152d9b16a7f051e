"""kernels.sass: the engine's decode launch compiled for sm_90 on a machine without a GPU.

Run as a subprocess without TRITON_INTERPRET (other test modules set it, and a module imported under it
has no kernel to compile). What is asserted is what round 32 changed: the one-warp decode tile's K/V
loop issues fewer instructions with 32-bit offsets than with 64-bit ones, with its 64 HMMA and no spill.
"""

import os
import re
import subprocess
import sys

import pytest
import triton

from kernels import sass

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.skipif(
    not all(os.path.exists(os.path.join(sass.NVIDIA_BIN, t)) for t in ("ptxas", "nvdisasm", "cuobjdump")),
    reason=f"triton {triton.__version__} ships no ptxas / nvdisasm / cuobjdump here",
)


def sass_cli(*args: str, **env_vars: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"} | env_vars
    return subprocess.run([sys.executable, "-m", "kernels.sass", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def run_sass(*args: str, **env_vars: str) -> str:
    done = sass_cli(*args, **env_vars)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def parse(out: str):
    regs, stack = map(int, re.search(r"(\d+) registers, (\d+) bytes of stack", out).groups())
    loops = [(int(n), int(h)) for n, h in re.findall(r"loop of (\d+) instructions \((\d+) HMMA\)", out)]
    return regs, stack, [n for n, hmma in loops if hmma == 64]


def test_decode_tile_loop_is_shorter_with_32_bit_offsets():
    new = run_sass("--seqs", "33", "--context", "600")
    old = run_sass("--seqs", "33", "--context", "600", PAGEDSERVE_KV_ADDRESSING="64")
    assert "OFFSET32 False" in old and "BULK_TAIL False" in old
    assert "tile (BLOCK_N 32, 1 warps, 6 stages)" in new
    assert "OFFSET32 True" in new and "BULK_TAIL True" in new
    regs, stack, (bulk, tail) = parse(new)
    _, _, (old_bulk, old_tail) = parse(old)
    assert stack == 0 and regs <= 255
    assert bulk < 0.85 * old_bulk, (bulk, old_bulk)  # 400 against 532 with Triton 3.6
    assert tail < 0.7 * old_tail, (tail, old_tail)  # the last tile through _attend_bulk: 515 against 869


def test_a_cache_past_int32_keeps_64_bit_offsets():
    out = run_sass("--seqs", "8", "--context", "64", "--cache-blocks", str(2**17))
    assert "OFFSET32 False" in out


def test_bad_override_is_refused():
    done = sass_cli("--set", "NOT_A_FLAG=1")
    assert done.returncode != 0 and "NOT_A_FLAG" in done.stderr
    done = sass_cli("--set", "OFFSET32")
    assert done.returncode != 0 and "NAME=VALUE" in done.stderr


def test_loops_of_reads_labels_and_back_branches():
    listing = "\n".join([
        "        /*0000*/                   IMAD R1, R2, R3, RZ ;",
        ".L_x_0:",
        "        /*0010*/                   HMMA.16816.F32.BF16 R4, R8, R12, R4 ;",
        "        /*0020*/               @P0 IADD3 R1, R1, 0x1, RZ ;",
        "        /*0030*/               @!P1 BRA `(.L_x_0) ;",
        "        /*0040*/                   BRA `(.L_x_1) ;",
        ".L_x_1:",
        "        /*0050*/                   EXIT ;",
    ])
    (loop,) = sass.loops_of(listing)
    assert loop.instructions == 3 and loop.opcodes == {"HMMA": 1, "IADD3": 1, "BRA": 1}


def test_a_split_launch_is_recorded_without_its_reduce():
    """A decode launch that splits its contexts is followed by the split reduce: not run, not recorded."""
    out = run_sass("--seqs", "4", "--context", "4000")
    assert "SPLIT True" in out and "tile (BLOCK_N 64, 4 warps, 3 stages)" in out
