"""Paged attention in Triton: one kernel for decode, prefill and mixed batches, plus a split-K reduce.

Signature as in kernels/reference.py (docs/interfaces.md), with keyword-only extras for tests and
benchmarks: `num_splits` forces a split count (by default it is chosen from the grid size) and `tile`
forces the K/V tile and launch shape.

Why one kernel and not a decode/prefill family: a tile of query *rows* covers both cases. A row is
one (query token, query head of the KV head's group) pair, so a program owns BLOCK_Q consecutive
query tokens of one sequence times all G query heads that share one KV head:

    rows of a tile (G_PAD = next_pow2(G))      K/V tile, BLOCK_N context positions
    r = t * G_PAD + g  ->  token q0 + t,        gathered through the block table:
                           head kv_head*G + g   slot = block_table[n // block_size] * block_size
                                                       + n % block_size
Decode is BLOCK_Q = 1 (the G heads of one token, padded to the 16 rows tl.dot needs); prefill chunks
are BLOCK_Q = BLOCK_M // G_PAD tokens with a causal mask by position, and they read prefix blocks
already in the cache exactly like decode reads its context. K/V are loaded once per group (GQA
without repeating K/V), the softmax is online (base 2, scale folded in), and all sequences of a
varlen batch share one launch: a program finds its sequence by binary search over query_start_loc.

Split-K (flash-decoding): when the grid (tiles x KV heads) is too small to fill the GPU, axis 2
splits each context into `num_splits` partitions; every program writes its unnormalized partial
output with its running max and sum, and `_reduce_splits_kernel` combines them. Each tile splits its
own context evenly (whole K/V tiles, at least two), so the work is balanced whatever the lengths:
a CUDA graph captures the split count for the model's maximum length, and partitions of that
maximum would leave all but the first empty for the contexts a server actually sees.

FP8 KV cache (float8_e4m3fn, which holds K / k_scale and V / v_scale): K/V tiles are loaded as e4m3
and cast to the query's dtype, exactly (e4m3 values are bf16, fp16 and fp32 values), so the dots
run as for a cache of the model's dtype; a bf16 query is cast to f16 first (Q_F16), because e4m3
converts to f16 in one instruction on sm_89+ and to bf16 through f32: bf16 values within +-65504
are f16 values (f16 has more mantissa bits; the query is clamped to that range, and magnitudes
below 2^-14 lose bits as f16 subnormals, negligible in a dot product), the products and their fp32
sums are unchanged, and the softmax weights go into the PV dot as f16 instead of bf16 (more
precise); k_scale is folded into the softmax scale on the host and
the accumulator is multiplied by v_scale once, after the loop (SCALE_V, compiled only when
v_scale != 1). For a cache in the query's dtype the casts are no-ops: the same code as before.

Prefill tuning (PrefillTuning, `prefill_tuning=`): prefill and mixed launches averaging at least
PREFILL_TUNING_MIN_TOKENS_PER_SEQ query tokens a sequence run DEFAULT_PREFILL_TUNING (128-row tiles,
8 warps held to 128 registers), whose unmasked K/V tiles go through _attend_bulk: block-aligned K/V
addressing and the softmax scale inside exp2's argument. Other PrefillTuning values (tile sizes,
pipelining depth, register cap, each switch on or off) are the candidates of
`python -m kernels.bench --only prefill --sweep`. Deterministic mode, a forced `tile` or `block_m`
and launches of mostly decode rows keep the untuned path (_attend_context with BULK_N 0); so does a
split decode launch of a bf16/fp16 cache (64-position tiles, 4 warps, 3 stages). An FP8 cache's decode
launch takes _attend_bulk (32-position tiles, one warp, six stages: H100 0.60 -> 0.58 of the bf16
cache's time at 256 x 1024; without GQA 16-position tiles, split at least in two: FP8_MHA_DECODE_TILE),
and so does an unsplit decode launch of a bf16/fp16 cache
(UNSPLIT_DECODE_TILE, the same tile: 0.93-1.00 of the (64, 4, 3) tile's time from 40 to 320 sequences).

Fresh K/V (`fresh_kv=`): the step's own K/V as the QKV projection left them (strided [T, KV, D]
views, the keys rotated: rotary_and_cache(rotate_key_in_place=True)). Where fresh_kv_usable (a cache
in the query's dtype, no window or softcap, not deterministic, a power-of-two head_dim, sm_90+), a
prefill or mixed launch becomes two: the decode launch for the sequences of one query token (its
kernel skips the others) and _fresh_prefill_kernel for the rest, whose programs (BLOCK_M tokens of
one query head, or packed GQA rows; FreshTuning.paired: query tiles p and n - 1 - p of a sequence,
equal causal work a program) read the cached prefix through the block table (one masked loop;
FreshTuning.prefix_bulk: _attend_bulk's unmasked tiles, then a masked rest) and the fresh tokens as
whole [BLOCK_N, D] TMA tiles from rows q_begin + j of the views: no block-table gather for the keys
the step itself wrote, and the Hopper TMA unit moves the tiles into shared memory. Tiles that run past
a sequence's end read the next sequence's rows (or zeros past the tensor) and are masked by the
causal test. H100, graph-timed: 0.79-0.82 / 0.95-0.96 / 0.73 / 1.07 of SDPA's speed at 4 x 2048 /
1 x 8192 / 16 x 512 / 4 x 1024 after 1,024 cached, 1.13-1.30x the varlen kernel without a prefix and
0.84x with one. On sm_90 the prefill rows run the warp-specialized Gluon kernel instead
(kernels/gluon_prefill.py: 0.84-0.96x SDPA without a prefix, 1.65x with one), which the engine's
attention layer takes for every step with prompts, with the host-built work list
(prefill_tile_starts); docs/benchmarks.md "Prefill".

Decode rows of a mixed launch: a prefill or mixed launch of a model without GQA that cannot read
fresh K/V (an FP8 cache, a sliding window, a softcap, a GPU without TMA) is also two launches: the
varlen tile for the sequences of more than one query token (SKIP_DECODE: its programs of a one-token
sequence exit at once; a split launch's reduce writes every row), then the decode launch for the
others. In the varlen tile a decode row takes a whole BLOCK_Q-token tile and its 2-stage pipeline
for each KV head: an H100 mixed step of llama2-13b (40 heads, no GQA) over an FP8 cache, 52 decodes
of 400 positions beside a 40-token prompt, spent 6.5 ms in attention against 4.1 ms for the 52
decodes alone, and its CUDA graph took 18.3 ms against 16.5 with the two launches (docs/benchmarks.md
round 15). With GQA (a decode row's group shares the tile, 8 KV heads where llama2-13b has 40) one
launch is faster, the decode rows running beside the prompt's tiles instead of after them (H100, bf16,
a window: Mistral-7B's heads 48.0 / 55.6 / 74.3 / 106.3 us a layer against 57.5 / 61.3 / 86.1 /
142.0 as two launches; Gemma-2-9B's, with a softcap, 134.2 / 147.0 / 251.5 against 175.1 / 188.8 /
293.5, but 392.2 against 347.2 at 128 decodes; docs/benchmarks.md round 16), except over an FP8 cache
with many sequences, where the varlen tile's FP8 decode rows cost more than the overlap saves
(FP8_GQA_SPLIT_DECODE_MIN_PROGRAMS). Not in deterministic mode (a decode row goes through the same
tile as a prefill row) nor with a forced tile, block_m or split count (benchmark sweeps).

Rotary inside the decode launch (`rotary_cache_attention`, `rotary=` here): the decode launch takes
the QKV projection's unrotated q, k, v; each program rotates its query rows, and the program whose
partition holds a sequence's own position writes that token's rotated key and value into the cache,
then (after a block barrier) reads its context as a plain decode launch does: the bits of
rotary_and_cache then this kernel, one launch fewer a layer (kernels.fused_rotary says for which
launches: up to FUSED_ROTARY_MAX_SEQS sequences; docs/benchmarks.md rounds 24 and 25).

Balanced decode (`balance_programs=`, `balance_chunks=`; kernels.balanced_decode, the default since
round 27 for the launches that would not split, up to 2 programs a split slot, and since round 28 for
those that would split in two): an unsplit decode launch runs one program a sequence and KV head, and
its time follows the longest context, not their sum: the one-warp tile streams ~17 GB/s a program
(H200), so a sequence of 1,710 positions among 33 of 850 on average took 52 us a layer where the same
tokens at one length took 34 (docs/benchmarks.md round 26). A balanced launch's grid is (sequences, KV
heads, max chunks); a program whose own context is longer than the smallest partition reads the step's
lengths (one load beside its own, waiting on nothing) for one partition size, the larger of the
positions x KV heads shared by balance_programs programs and the longest context in balance_chunks,
whole tiles and blocks, at least _MIN_PARTITION (balanced_chunks is the same arithmetic on the host). A
sequence's chunks past its own count exit at once; a sequence of one chunk writes its rows; a chunk of a
longer one stores its partial and takes a ticket (an acquire-release atomic of its sequence and KV head,
balance_tickets), and the last of the sequence's chunks to finish combines them, in chunk order, read
from L2, and zeroes the ticket: no reduce launch (round 28). The plan is the kernel's, from seq_lens, so
a CUDA graph replays it for each step's lengths. The tickets are one buffer a device: balanced launches
on one device must not run at once on two streams. Not for an FP8 cache, a sliding window, deterministic
mode or a mixed launch's decode rows.

Longest first (`decode_order=`, kernels.decode_order; kernels.ordered_decode says which launches take
it): the GPU hands a grid's programs to its SMs roughly in program order, so in the sequences' own order
a long context that comes late starts late and ends the launch alone. With decode_order (the sequences
by descending length, sorted on the device once a forward pass) a decode launch's grid is one axis,
program (rank x num_splits + split) x KV heads + KV head, whose rank-th sequence is decode_order[rank]:
the longest contexts' programs, every KV head and chunk of them, start first, and the short ones fill
the SMs as they free up (longest processing time first). The output does not depend on the order:
each program's arithmetic is the same, and a balanced launch combines a sequence's chunks in chunk
order. By default only the launches that neither split nor run balanced take it (over a cache of the
query's dtype, no window): the H200 measurements of kernels.DECODE_ORDER_ENV.

Deterministic (batch-invariant) mode, `deterministic=True` (executor_svc/layers/determinism.py): a
row's output must not depend on the other rows of its tile or of its batch, so that a token decoded
alone, in a batch, as a row of a prefill chunk or of a recompute gets the same bits. Then:
  - one tile shape for every step: BLOCK_M = max(16, G_PAD) rows (the decode tile's height, so a
    decode step does no more tensor-core work than in the default mode: a 64-row tile did 16x the
    work of a GQA-4 decode row and cost llama3-8b 0.71x of the default's throughput on an H100),
    BLOCK_N 64, 4 warps, 3 stages (as the decode tile), with BLOCK_Q = BLOCK_M / G_PAD query
    tokens per tile for prefill and decode alike (a decode sequence is a query of length 1 in a
    BLOCK_Q tile, as in mixed batches), so each row goes through the same instructions wherever it
    sits;
  - no split-K: one program reduces a row's whole context, always in the same order;
  - the K/V loop starts at a multiple of BLOCK_N (0, or the start of the tile holding the first
    row's window start), so a row sees its context in the same K/V tiles however it was chunked;
  - every K/V tile takes the masked path. The default mode skips the mask on tiles at or before a
    query tile's first row, a bound that depends on the row's neighbours; masked and unmasked code
    may round differently (the compiler may fuse the scores' scaling into exp2's argument in one
    and not the other). Tiles that a tile's other rows add (wholly after or before what the row
    sees) leave its running max, sum and accumulator bit for bit unchanged: exp2(-inf) = 0 and
    exp2(0) = 1.
"""

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from kernels import (
    BALANCED_MAX_PROGRAMS_PER_SLOT,
    balanced_decode,
    fused_rotary,
    kv_addressing,
    ordered_decode,
    pdl,
    pdl_launch,
)
from kernels.reference import check_scales, is_fp8
from kernels.triton_cache import as_cached
from kernels.triton_layers import rotated

F16_MAX = tl.constexpr(65504.0)
_NO_PARTITION = 1 << 30
_MIN_PARTITION = 256  # context positions; smaller partitions cost more in the reduce than they win
# A balanced decode launch (balanced_chunks) by default: no share (so many programs that the partition
# is the longest context in BALANCED_MAX_CHUNKS chunks, at least _MIN_PARTITION). H200, sharegpt-400's
# decode steps of 24-64 sequences, µs a layer (docs/benchmarks.md round 26): two chunks 37.2-59.4
# against 36.3-65.2 in four, 41.9-66.6 in eight, 42.0-68.9 for a share of split_slots in four; the
# unsplit launch 51.6-62.1.
BALANCE_PROGRAMS = 1 << 30
BALANCED_MAX_CHUNKS = 2
# Each program of a balanced launch reads the step's lengths padded to a power of two, in one warp's
# registers (32 a thread at 1,024): larger launches keep the unbalanced forms.
BALANCED_MAX_SEQS = 1024
# _attend_bulk's K/V addresses as 32-bit element offsets from the cache's base (OFFSET32) where every
# element of a layer's cache is within reach: one IMAD a row for the offset and one IMAD.WIDE for each of
# K's and V's addresses, where 64-bit offsets took ~11 integer instructions a row (sign extension, a
# 64-bit product, the byte shift, a carried add). sm_90 compile of the one-warp decode tile (32, 1, 6),
# Triton 3.6: 532 -> 400 instructions a 32-position tile, the same 202 registers and 37.1 KB of shared
# memory (docs/benchmarks.md round 32). kernels.KV_ADDRESSING_ENV="64" turns it off (comparisons).
OFFSET32_MAX_ELEMENTS = 2**31 - 1


def offsets_fit_int32(cache: torch.Tensor) -> bool:
    """Whether every element offset of a [blocks, block_size, KV heads, D] cache fits in an int32."""
    return cache.numel() <= OFFSET32_MAX_ELEMENTS


def _is_pow2(n) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and n > 0 and n & (n - 1) == 0


def _check_launch(tuning, tiles, max_tile, stage_fields, flags) -> None:
    """ValueError for a tuning whose tile sizes (powers of two >= 16, <= max_tile if given), num_warps
    (1..16, a power of two), pipelining depths (1..8) or switches (bools) no launch can take."""
    kind = type(tuning).__name__
    for name in tiles:
        value = getattr(tuning, name)
        if not _is_pow2(value) or value < 16 or (max_tile is not None and value > max_tile):
            bound = ">= 16" if max_tile is None else f"in [16, {max_tile}]"
            raise ValueError(f"{kind}.{name} must be a power of two {bound}, got {value!r}")
    if not _is_pow2(tuning.num_warps) or tuning.num_warps > 16:
        raise ValueError(f"{kind}.num_warps must be 1, 2, 4, 8 or 16, got {tuning.num_warps!r}")
    for name in stage_fields:
        value = getattr(tuning, name)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 8:
            raise ValueError(f"{kind}.{name} must be 1..8, got {value!r}")
    for name in flags:
        if not isinstance(getattr(tuning, name), bool):
            raise ValueError(f"{kind}.{name} must be True or False, got {getattr(tuning, name)!r}")


@dataclass(frozen=True)
class PrefillTuning:
    """The launch of a prefill or mixed step (max_query_len > 1) through the tuned code path
    (_attend_bulk, no mask on the K/V loads when head_dim is a power of two): DEFAULT_PREFILL_TUNING
    for the default mode's launches averaging >= PREFILL_TUNING_MIN_TOKENS_PER_SEQ tokens a sequence,
    or any value given to paged_attention as `prefill_tuning` (the candidates of
    `python -m kernels.bench --only prefill --sweep`); decode launches ignore it and deterministic mode
    refuses it. PrefillTuning() is the untuned launch's tile through this path. Fields:

    block_m, num_warps, num_stages: rows of a query tile (BLOCK_Q tokens x G_PAD heads) and launch.
    block_n: K/V tile of the masked loop (causal diagonal, partial last tile); bulk_block_n: K/V tile
      of the unmasked loop before it (a larger one: fewer iterations, more registers).
    block_addressing: the unmasked loop reads whole blocks from a block-aligned start, so the in-block
      part of each K/V address is computed once, not per tile (no div/mod per position).
    fma_softmax: scores scaled inside exp2's argument (one FFMA per score instead of FMUL + FADD).
    maxnreg: register cap per thread (e.g. 128 lets two 8-warp programs share an SM; may spill).

    Lazy rescaling (FlashAttention-4's), programs in reverse tile order and a separate pipelining
    depth for the unmasked loop were measured slower on the H100 and removed (docs/benchmarks.md).

    Not offered, from compiling this kernel for sm_90 with Triton 3.6: tl.range(warp_specialize=True)
    (Hopper's pass fails on this loop with 4 warps and leaves it unchanged with 8), and TMA for K/V
    (a descriptor gather of the block table's rows needs sm_100; a tile assembled from one TMA load
    per block cannot be written in Triton). K is read [BLOCK_N, D] and fed to the dot transposed:
    that is the K-major operand wgmma takes from shared memory, so no copy.
    """

    block_m: int = 64
    block_n: int = 64
    bulk_block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    block_addressing: bool = False
    fma_softmax: bool = False
    maxnreg: int | None = None

    def __post_init__(self):
        _check_launch(self, ("block_m", "block_n", "bulk_block_n"), None, ("num_stages",),
                      ("block_addressing", "fma_softmax"))
        if self.maxnreg is not None and (not isinstance(self.maxnreg, int) or not 32 <= self.maxnreg <= 255):
            raise ValueError(f"PrefillTuning.maxnreg must be 32..255 or None, got {self.maxnreg!r}")


@dataclass(frozen=True)
class FreshTuning:
    """The fresh-K/V prefill launch (paged_attention's `fresh_kv`). packed: a program owns BLOCK_M rows
    of BLOCK_M // G query tokens x the G query heads of one KV head (GQA packing; G a power of two),
    else BLOCK_M tokens of one query head. block_n: K/V tile (fresh and prefix). paired: a program
    owns a sequence's query tiles p and n - 1 - p (equal causal work per program, half the programs)."""

    block_m: int = 64
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 3
    packed: bool = False
    paired: bool = False
    prefix_stages: int = 2
    prefix_bulk: bool = False

    def __post_init__(self):
        _check_launch(self, ("block_m", "block_n"), 256, ("num_stages", "prefix_stages"),
                      ("packed", "paired", "prefix_bulk"))


# H100 sweep (docs/benchmarks.md "Prefill", graph-timed): 64-row tiles of one head, 4 warps, 3 stages are
# the fastest at 4 x 2048 (~340 us; 128 x 128 tiles ~355) and 16 x 512 (140; 128-row tiles 170-185);
# 128 x 128 tiles with 8 warps, paired, at 1 x 8192 (1,010-1,053 us; unpaired 1,079-1,096, 64-row
# 1,147-1,248)
DEFAULT_FRESH_TUNING = FreshTuning()
LONG_FRESH_TUNING = FreshTuning(block_m=128, block_n=128, num_warps=8, paired=True)
LONG_FRESH_MIN_TOKENS_PER_SEQ = 4096


def fresh_tuning_for(num_tokens: int, num_seqs: int) -> FreshTuning:
    """The launch for a step of num_tokens over num_seqs sequences (shapes only: a CUDA graph replays
    what it captured)."""
    if num_tokens >= LONG_FRESH_MIN_TOKENS_PER_SEQ * num_seqs:
        return LONG_FRESH_TUNING
    return DEFAULT_FRESH_TUNING


def fresh_kv_usable(query, key_cache, fresh_kv, sliding_window, logit_softcap, deterministic) -> bool:
    """Whether a prefill launch can read the step's K/V from `fresh_kv` through TMA descriptors: a cache
    in the query's dtype (an FP8 cache's fresh K/V would be read unrounded), no window or softcap (not
    written in this kernel), a power-of-two head_dim, 16-byte aligned rows, and on CUDA a GPU with TMA
    (sm_90+); the Triton interpreter (CPU tests) lowers the descriptors to plain loads. fresh_kv of
    the wrong shape or dtype is a caller's error (ValueError), not a reason to fall back."""
    if fresh_kv is None:
        return False
    key, value = fresh_kv
    num_tokens, num_heads, head_dim = query.shape
    want = (num_tokens, key_cache.shape[2], head_dim)
    if tuple(key.shape) != want or tuple(value.shape) != want or {key.dtype, value.dtype} != {query.dtype}:
        raise ValueError(f"fresh_kv must be two {query.dtype} tensors of shape {want} (the step's K and V), "
                         f"got {tuple(key.shape)} {key.dtype} and {tuple(value.shape)} {value.dtype}")
    if deterministic or sliding_window > 0 or logit_softcap > 0:
        return False
    if key_cache.dtype != query.dtype or not (_is_pow2(head_dim) and 16 <= head_dim <= 256):
        return False
    if query.is_cuda and torch.cuda.get_device_capability(query.device)[0] < 9:
        return False
    size = query.element_size()
    return all(
        t.stride(2) == 1 and t.stride(1) == head_dim  # [T, heads, D] rows, D contiguous
        and (t.stride(0) * size) % 16 == 0 and t.data_ptr() % 16 == 0  # TMA: 16-byte aligned rows
        for t in (query, key, value)
    )


@triton.jit
def _find_sequence(query_start_loc_ptr, tile_id, num_seqs, num_search_steps, BLOCK_Q: tl.constexpr):
    """Largest sequence i whose first tile, query_start_loc[i] // BLOCK_Q + i, is <= tile_id."""
    lo = tile_id * 0
    hi = lo + num_seqs
    for _ in range(num_search_steps):
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        right = first_tile <= tile_id
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    return lo


@triton.jit
def _balanced_part(seq_lens_ptr, num_seqs, num_kv_heads, balance_programs, max_chunks, min_partition,
                   SEQ_PAD: tl.constexpr, GRAIN: tl.constexpr):
    """balanced_chunks' partition size, from the step's lengths: the same arithmetic in every program
    of a balanced launch and of its reduce (the load does not wait on any other)."""
    index = tl.arange(0, SEQ_PAD)
    lens = tl.load(seq_lens_ptr + index, mask=index < num_seqs, other=0)
    total = tl.sum(lens, axis=0).to(tl.int64)
    longest = tl.cdiv(tl.max(lens, axis=0), max_chunks)
    part = tl.maximum(tl.cdiv(total * num_kv_heads, balance_programs), longest)
    return tl.maximum(tl.cdiv(part, GRAIN) * GRAIN, min_partition).to(tl.int32)


@triton.jit
def _attend_tiles(
    acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, lo, hi, kv_hi,
    row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window, softcap_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, MASKED: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr,
):
    """Online-softmax update of (acc, m_i, l_i) over context positions [lo, hi), BLOCK_N at a time,
    K/V gathered through the block table. MASKED: positions >= kv_hi or after a row's own position
    (and, SLIDING, `window` or more before it) are excluded; unmasked calls must cover only positions
    every row may see."""
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        if MASKED:
            pos_valid = pos < kv_hi
            block = tl.load(block_table + pos // BLOCK_SIZE, mask=pos_valid, other=0).to(tl.int64)
            kv_mask = pos_valid[:, None] & dim_valid[None, :]
        else:
            block = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
            kv_mask = dim_valid[None, :]
        kv_offset = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot + head_offset
        # an FP8 cache's tiles in the query's dtype (exact); a no-op for a cache of that dtype
        k = tl.load(key_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        v = tl.load(value_cache_ptr + kv_offset[:, None] + dims[None, :], mask=kv_mask, other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2  # [BLOCK_M, BLOCK_N]
        if SOFTCAP:  # cap * tanh(score / cap), in the base-2 domain: tanh(x) = 1 - 2 / (e^2x + 1)
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap_log2)) + 1.0))
        if MASKED:
            allowed = pos_valid[None, :] & (pos[None, :] <= row_pos[:, None])
            if SLIDING:
                allowed = allowed & (pos[None, :] > row_pos[:, None] - window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing allowed yet
        else:
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = m_new
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _attend_context(
    acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, kv_lo, kv_hi, kv_end,
    first_row_pos, row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window, softcap_log2,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr, BULK_N: tl.constexpr, BLOCK_ADDR: tl.constexpr, EVEN_D: tl.constexpr,
    FMA_SOFTMAX: tl.constexpr, OFFSET32: tl.constexpr, BULK_TAIL: tl.constexpr,
):
    """The default mode's pass over a query tile's context [kv_lo, kv_hi): the mask only where some
    row of the tile needs it. BULK_N > 0 (a PrefillTuning): the unmasked whole tiles go through
    _attend_bulk in BULK_N tiles (up to BULK_N - 1 positions more than otherwise then take the masked
    loop); BULK_N == 0: through _attend_tiles unmasked, in BLOCK_N tiles. BULK_TAIL (a decode launch
    with BLOCK_ADDR, so no causal mask and a block-aligned kv_lo): the partial last tile through
    _attend_bulk's TAIL, not _attend_tiles (sm_90: 515 against 869 instructions for the one-warp tile)."""
    # Whole tiles at or before the tile's first query position need no mask; the rest (the causal
    # diagonal, the partial last tile) do. SLIDING: so do the positions before the last row's window
    # (the first rows see them, later rows do not), attended first with their own upper bound.
    unmasked_lo = kv_lo
    if SLIDING:
        unmasked_lo = tl.minimum(tl.maximum(kv_lo, kv_end - window), tl.maximum(kv_hi, kv_lo))
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, kv_lo, unmasked_lo,
            unmasked_lo, row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window,
            softcap_log2, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, SLIDING, SOFTCAP,
        )
    if BULK_N > 0:
        num_bulk = tl.maximum(tl.minimum(kv_hi, first_row_pos + 1) - unmasked_lo, 0) // BULK_N
        unmasked_hi = unmasked_lo + num_bulk * BULK_N
        acc, m_i, l_i = _attend_bulk(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, unmasked_lo,
            unmasked_hi, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, softcap_log2,
            BULK_N, BLOCK_SIZE, DOT_PRECISION, SOFTCAP, BLOCK_ADDR, EVEN_D, FMA_SOFTMAX, OFFSET32,
        )
    else:
        num_unmasked = tl.maximum(tl.minimum(kv_hi, first_row_pos + 1) - unmasked_lo, 0) // BLOCK_N
        unmasked_hi = unmasked_lo + num_unmasked * BLOCK_N
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, unmasked_lo,
            unmasked_hi, kv_hi, row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window,
            softcap_log2, BLOCK_N, BLOCK_SIZE, False, DOT_PRECISION, SLIDING, SOFTCAP,
        )
    if BULK_TAIL:
        acc, m_i, l_i = _attend_bulk(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, unmasked_hi,
            kv_hi, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, softcap_log2,
            BULK_N, BLOCK_SIZE, DOT_PRECISION, SOFTCAP, BLOCK_ADDR, EVEN_D, FMA_SOFTMAX, OFFSET32, True,
        )
    else:
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, unmasked_hi, kv_hi,
            kv_hi, row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window,
            softcap_log2, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, SLIDING, SOFTCAP,
        )
    return acc, m_i, l_i


@triton.jit
def _attend_bulk(
    acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, lo, hi,
    dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, softcap_log2,
    BULK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, DOT_PRECISION: tl.constexpr, SOFTCAP: tl.constexpr,
    BLOCK_ADDR: tl.constexpr, EVEN_D: tl.constexpr, FMA_SOFTMAX: tl.constexpr, OFFSET32: tl.constexpr = False,
    TAIL: tl.constexpr = False,
):
    """PrefillTuning's unmasked loop: whole BULK_N tiles of [lo, hi) that every row of the query tile
    sees, so no mask and every row's running max finite after the first tile. BLOCK_ADDR: lo is a
    multiple of BLOCK_SIZE (the host checks), so row r of every tile is slot r % BLOCK_SIZE of the
    tile's block r // BLOCK_SIZE: the in-block part of each address is computed once. OFFSET32: the
    element offsets in int32 (offsets_fit_int32). TAIL (with BLOCK_ADDR): [lo, hi) is the partial last
    tile of a context whose every position < hi each row sees (a decode launch): the positions past hi
    are masked out of the block-table load, the scores and V, in the same block-aligned addressing."""
    rows_n = tl.arange(0, BULK_N)
    if OFFSET32:
        head_offset = head_offset.to(tl.int32)
    if BLOCK_ADDR:
        tl.assume(lo % BLOCK_SIZE == 0)
        block_of_row = rows_n // BLOCK_SIZE  # [BULK_N]
        slot_offset = (rows_n % BLOCK_SIZE) * stride_c_slot + head_offset  # [BULK_N]
        inner = slot_offset[:, None] + dims[None, :]  # [BULK_N, D_PAD]
    for start in tl.range(lo, hi, BULK_N):
        if BLOCK_ADDR:
            if TAIL:
                pos_valid = start + rows_n < hi  # [BULK_N]
                block = tl.load(block_table + start // BLOCK_SIZE + block_of_row, mask=pos_valid, other=0)
            else:
                block = tl.load(block_table + start // BLOCK_SIZE + block_of_row)
            if not OFFSET32:
                block = block.to(tl.int64)
            offsets = block[:, None] * stride_c_block + inner  # [BULK_N, D_PAD]
        else:
            pos = start + rows_n
            block = tl.load(block_table + pos // BLOCK_SIZE).to(tl.int64)
            kv_offset = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot + head_offset
            offsets = kv_offset[:, None] + dims[None, :]
        if TAIL:  # K of the positions past hi unmasked (their scores are), V zeroed: 0 * NaN is NaN
            if EVEN_D:
                k = tl.load(key_cache_ptr + offsets).to(q.dtype)
                v = tl.load(value_cache_ptr + offsets, mask=pos_valid[:, None], other=0.0).to(q.dtype)
            else:
                k = tl.load(key_cache_ptr + offsets, mask=dim_valid[None, :], other=0.0).to(q.dtype)
                v = tl.load(value_cache_ptr + offsets, mask=pos_valid[:, None] & dim_valid[None, :],
                            other=0.0).to(q.dtype)
        elif EVEN_D:  # head_dim == D_PAD: no mask at all
            k = tl.load(key_cache_ptr + offsets).to(q.dtype)
            v = tl.load(value_cache_ptr + offsets).to(q.dtype)
        else:
            k = tl.load(key_cache_ptr + offsets, mask=dim_valid[None, :], other=0.0).to(q.dtype)
            v = tl.load(value_cache_ptr + offsets, mask=dim_valid[None, :], other=0.0).to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)  # [BLOCK_M, BULK_N], unscaled
        if SOFTCAP:
            s = s * scale_log2
            s = softcap_log2 * (1.0 - 2.0 / (tl.exp(2.0 * (s / softcap_log2)) + 1.0))
        elif not FMA_SOFTMAX:
            s = s * scale_log2
        if TAIL:  # after the cap, which would map -inf to -cap
            s = tl.where(pos_valid[None, :], s, float("-inf"))
        m_tile = tl.max(s, axis=1)
        if FMA_SOFTMAX and not SOFTCAP:  # max(s) * scale = max(s * scale) (scale > 0): scale in exp2
            m_tile = m_tile * scale_log2
        m_new = tl.maximum(m_i, m_tile)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
        if FMA_SOFTMAX and not SOFTCAP:
            p = tl.exp2(s * scale_log2 - m_i[:, None])
        else:
            p = tl.exp2(s - m_i[:, None])
        l_i = l_i + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, m_i, l_i


# The prefill launch of the default mode when its sequences average at least
# PREFILL_TUNING_MIN_TOKENS_PER_SEQ tokens (H100 sweep of PrefillTuning candidates, docs/benchmarks.md
# "Prefill"): 128-row tiles with 8 warps held to 128 registers (two programs an SM), block-aligned K/V
# addressing, the scale inside exp2's argument; 0.635 -> 0.713 of SDPA's speed on 4 x 2048. A launch
# with more sequences per token keeps the 64-row tile: each decode row of a mixed step has a tile of
# its own, and 128-row ones made the mixed steps of a 32 req/s sharegpt run slower (H100: TPOT p99
# 11.1 -> 12.8 ms, TTFT p99 61 -> 81 ms). The rule reads shapes only, so a CUDA graph (captured for
# a bucket's token and sequence counts) replays the launch it captured; the mixed-step graphs of the
# default limits (2,048 or 4,096 tokens, 256 or 512 sequences) keep the 64-row tile.
PREFILL_TUNING_MIN_TOKENS_PER_SEQ = 32
# The split decode launch (even splits: each context split in the kernel) compiles to ~166 registers
# for sm_90 with Triton 3.6 where the unsplit one takes 128: three programs an SM instead of the four
# choose_num_splits counts on. Held to this many (a few bytes of spill).
EVEN_SPLIT_DECODE_MAXNREG = 128
# (BLOCK_N, num_warps, num_stages) of an unsplit decode launch over a bf16/fp16 cache, through
# _attend_bulk as the FP8 cache's decode: one warp a program, six stages. H100, llama3-8b heads, 2-8
# layers' caches in one graph, time against the (64, 4, 3) _attend_tiles tile: 0.93 at 128 x 224, 0.97
# at 320 x 224, 0.96 at 40 x 768 and 64 x 544, 0.99 at 64 x 1024, 1.00 at 256 x 1024; split launches
# (fewer programs) were slower with it (1.09 at 24 x 896) and keep the default (docs/benchmarks.md,
# round 10).
UNSPLIT_DECODE_TILE = (32, 1, 6)
# ... and of one that neither splits nor runs balanced, over more than kernels.BALANCED_MAX_PROGRAMS_PER_SLOT
# and at most WIDE_DECODE_MAX_PROGRAMS_PER_SLOT programs a split slot, with GQA, without a window, over a
# 16-bit cache of heads up to 128 wide (what was measured): four warps over 128 positions, two stages
# (128 KB of shared memory, one program an SM). A long context's program streams faster, where few
# programs a slot leave the launch's end to the longest ones. H200, llama3-8b heads, attention alone at
# sharegpt-400's decode steps (longest first), µs a layer against UNSPLIT_DECODE_TILE: 80 sequences
# 54.4 / 66.5, 97 63.1 / 78.3, 113 64.4 / 76.8, 129 67.2 / 74.5 (160, past the limit, 75.4 / 77.8); at
# one length it costs 0-8 % at 72-96 sequences of 256-1,500 positions, nothing at 128
# (docs/benchmarks.md round 30).
WIDE_DECODE_TILE = (128, 4, 2)
WIDE_DECODE_MAX_PROGRAMS_PER_SLOT = 4.0
# Not taken (H200, docs/benchmarks.md round 19): 16-24 sequences x 8 KV heads (128-192 programs)
# unsplit with a (128, 4, 3) tile ran 8-12 % faster than split in two in a graph of attention calls
# alone, and no faster inside a decode step's graph (paired processes, within their spread).
# (BLOCK_N, num_warps, num_stages) of every decode launch over an FP8 (e4m3) cache, split or not, through
# _attend_bulk (block-aligned addresses, the scale in exp2). H100, 256 x 1024: 215.6 us, (32, 2, 5)
# through _attend_tiles 225.2, (16, 1, 6) 213.0 but 231 at 64 x 4096 (205.8 here); the bf16 cache 375
# (docs/benchmarks.md, FP8 KV cache)
FP8_DECODE_TILE = (32, 1, 6)
# ... and of one without GQA (a KV head per query head: one valid row of the 16 a dot needs), split at
# least FP8_MHA_MIN_SPLITS ways: llama2-13b's 40 heads on an H100, µs a layer against (32, 1, 6) unsplit,
# 34 sequences of 105-735 positions 81.9 vs 97.6, 48 of 120-840 114.0 vs 125.3, 28 of 150-1050 85.1
# vs 94.5, 64 of 160-1120 177.7 vs 183.4; unsplit 34 x 420 76.8 vs 78.7 (docs/benchmarks.md round 15)
FP8_MHA_DECODE_TILE = (16, 1, 6)
FP8_MHA_MIN_SPLITS = 2
# A mixed launch over an FP8 cache with GQA splits off its decode rows (module docstring, "Decode rows of
# a mixed launch") from this many programs of them (sequences x KV heads) on: H100, llama3-8b's heads, µs
# a layer as one launch / two: 52 decodes + a 40-token prompt (424 programs) 46.9 / 52.8, 55 + 150
# (448) 48.3 / 54.5, 90 + 100 (728) 77.3 / 71.6, 128 + 64 (1,032) 121.8 / 97.1.
FP8_GQA_SPLIT_DECODE_MIN_PROGRAMS = 576
DEFAULT_PREFILL_TUNING = PrefillTuning(
    block_m=128, num_warps=8, maxnreg=128, block_addressing=True, fma_softmax=True,
)

# Triton compiles a variant per value class of each integer argument (1, a multiple of 16, other);
# these change from step to step, and a serving process would stall on a compilation (1-2 s) each
# time a step brings a new combination. Their values never shape the code.
_PER_STEP_ARGS = ["num_seqs", "num_search_steps", "num_splits", "stride_bt_seq"]


@triton.jit(do_not_specialize=_PER_STEP_ARGS)
def _paged_attention_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    query_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, num_seqs, num_search_steps, partition_size, num_heads, num_splits, head_dim,
    stride_q_tok, stride_q_head, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq, window, softcap_log2, v_scale,
    balance_programs, min_partition, tickets_ptr, order_ptr, num_kv_heads,
    positions_ptr, slot_mapping_ptr, cos_ptr, sin_ptr, key_ptr, value_ptr, stride_cos,
    stride_k_tok, stride_k_head, stride_v_tok, stride_v_head, k_inv_scale, v_inv_scale,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D_PAD: tl.constexpr,
    IS_DECODE: tl.constexpr, SPLIT: tl.constexpr, EVEN_SPLITS: tl.constexpr, DOT_PRECISION: tl.constexpr,
    SLIDING: tl.constexpr, SOFTCAP: tl.constexpr, DETERMINISTIC: tl.constexpr, SCALE_V: tl.constexpr,
    Q_F16: tl.constexpr, SKIP_DECODE: tl.constexpr,
    BULK_N: tl.constexpr, BLOCK_ADDR: tl.constexpr, EVEN_D: tl.constexpr, FMA_SOFTMAX: tl.constexpr,
    ROTARY: tl.constexpr = False, RN: tl.constexpr = False, FP8_CACHE: tl.constexpr = False,
    PDL: tl.constexpr = False, BALANCED: tl.constexpr = False, SEQ_PAD: tl.constexpr = 1,
    GRAIN: tl.constexpr = 1, ORDERED: tl.constexpr = False, OFFSET32: tl.constexpr = False,
    BULK_TAIL: tl.constexpr = False,
):
    if PDL:  # kernels.pdl: before any load (the query, the step's tables) and every early return
        gdc_wait()
        gdc_launch_dependents()
    if ORDERED:  # a decode launch, longest first: program (rank x num_splits + split) x KV heads + KV head
        program = tl.program_id(0)
        kv_head = program % num_kv_heads
        rank = program // num_kv_heads
        split = rank % num_splits
        tile_id = tl.load(order_ptr + rank // num_splits)
    else:
        tile_id = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
    if IS_DECODE:
        seq = tile_id
        q_tile_start = tile_id * 0
    else:
        seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, num_search_steps, BLOCK_Q)
        first_tile = tl.load(query_start_loc_ptr + seq) // BLOCK_Q + seq
        q_tile_start = (tile_id - first_tile) * BLOCK_Q
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    if q_tile_start >= q_len:
        return
    if IS_DECODE and q_len > 1:  # a prefill row of a mixed step: the fresh-K/V launch's (fresh_prefill)
        return
    if SKIP_DECODE and q_len == 1:  # a decode row of a mixed step: the decode launch's
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_start = seq_len - q_len  # position of the sequence's first query token
    if BALANCED:  # chunk `split` of at most num_splits of the sequence (balanced_chunks)
        if split * min_partition >= seq_len:  # past any partition size's last chunk
            return
        part = min_partition  # a context of at most the smallest partition is one chunk whatever the plan
        if seq_len > min_partition:  # (so only the programs of longer ones read the step's lengths)
            part = _balanced_part(seq_lens_ptr, num_seqs, num_kv_heads, balance_programs, num_splits,
                                  min_partition, SEQ_PAD, GRAIN)
        num_chunks = tl.maximum(tl.cdiv(seq_len, part), 1)
        if split >= num_chunks:
            return

    rows = tl.arange(0, BLOCK_M)
    row_token = q_tile_start + rows // G_PAD  # [BLOCK_M] index among the sequence's query tokens
    row_head = kv_head * GROUP + rows % G_PAD  # [BLOCK_M]
    row_valid = (rows // G_PAD < BLOCK_Q) & (rows % G_PAD < GROUP) & (row_token < q_len)
    row_pos = context_start + row_token  # [BLOCK_M] causal limit: keys at positions <= row_pos
    row_global = (q_begin + row_token).to(tl.int64)
    dims = tl.arange(0, D_PAD)
    dim_valid = dims < head_dim
    q_mask = row_valid[:, None] & dim_valid[None, :]
    q_rows = query_ptr + row_global[:, None] * stride_q_tok + row_head[:, None] * stride_q_head
    if ROTARY:  # a decode launch from unrotated q, k, v (rotary_cache_attention): rotate the query here
        half = head_dim // 2
        first_half = dims < half
        turned = tl.where(first_half, dims + half, dims - half)  # [D_PAD] the other half's element
        pos = tl.load(positions_ptr + q_begin).to(tl.int64)
        dtype = query_ptr.dtype.element_ty
        cos = tl.load(cos_ptr + pos * stride_cos + tl.where(first_half, dims, dims - half), mask=dim_valid,
                      other=0.0).to(dtype).to(tl.float32)  # [D_PAD] cos of element d % half
        sin = tl.load(sin_ptr + pos * stride_cos + tl.where(first_half, dims, dims - half), mask=dim_valid,
                      other=0.0).to(dtype).to(tl.float32)
        x = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0).to(tl.float32)
        x_turned = tl.load(q_rows + turned[None, :], mask=q_mask, other=0.0).to(tl.float32)
        x_turned = tl.where(first_half[None, :], -x_turned, x_turned)  # [-x2, x1]
        q = rotated(x, x_turned, cos[None, :], sin[None, :], dtype, RN)  # [BLOCK_M, D_PAD]
    else:
        q = tl.load(q_rows + dims[None, :], mask=q_mask, other=0.0)  # [BLOCK_M, D_PAD]
    if Q_F16:  # bf16 query over an FP8 cache: the dots in f16 (module docstring)
        q = tl.minimum(tl.maximum(q.to(tl.float32), -F16_MAX), F16_MAX).to(tl.float16)

    kv_end = context_start + tl.minimum(q_tile_start + BLOCK_Q, q_len)
    first_row_pos = context_start + q_tile_start
    if BALANCED:  # chunks of `part` positions (the last one shorter), from balanced_chunks
        pass
    elif EVEN_SPLITS:  # the tile's context in num_splits even partitions of whole K/V tiles
        part = tl.maximum(tl.cdiv(tl.cdiv(kv_end, num_splits), BLOCK_N), 2) * BLOCK_N
    else:  # a fixed size; no split: _NO_PARTITION
        part = partition_size
    kv_lo = split * part
    kv_hi = tl.minimum(kv_lo + part, kv_end)
    if SLIDING:  # nothing before the first row's window is read; even partitions cover the rest
        ctx_lo = tl.maximum(first_row_pos - window + 1, 0)
        if EVEN_SPLITS:
            part = tl.maximum(tl.cdiv(tl.cdiv(kv_end - ctx_lo, num_splits), BLOCK_N), 2) * BLOCK_N
            kv_lo = ctx_lo + split * part
            kv_hi = tl.minimum(kv_lo + part, kv_end)
        else:
            kv_lo = tl.maximum(kv_lo, ctx_lo)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    head_offset = kv_head.to(tl.int64) * stride_c_head
    if ROTARY:
        # The program whose partition holds the token's own position rotates its KV head's key and
        # writes it and the value into the cache at the token's slot, then reads them back there with
        # the rest of its context: the barrier makes the block's stores visible to all its threads (one
        # writer per (sequence, KV head); no other program reads that slot). A padding token (slot < 0)
        # writes nothing, as in rotary_and_cache.
        own_pos = seq_len - 1
        slot = tl.load(slot_mapping_ptr + q_begin).to(tl.int64)
        if (slot >= 0) & (kv_lo <= own_pos) & (own_pos < kv_hi):
            token = q_begin.to(tl.int64)
            k_row = key_ptr + token * stride_k_tok + kv_head.to(tl.int64) * stride_k_head
            k = tl.load(k_row + dims, mask=dim_valid, other=0.0).to(tl.float32)
            k_turned = tl.load(k_row + turned, mask=dim_valid, other=0.0).to(tl.float32)
            k = rotated(k, tl.where(first_half, -k_turned, k_turned), cos, sin, dtype, RN)  # [D_PAD]
            v = tl.load(value_ptr + token * stride_v_tok + kv_head.to(tl.int64) * stride_v_head + dims,
                        mask=dim_valid)
            cache_dtype = key_cache_ptr.dtype.element_ty
            cached = slot * stride_c_slot + head_offset + dims
            tl.store(key_cache_ptr + cached, as_cached(k, k_inv_scale, cache_dtype, FP8_CACHE),
                     mask=dim_valid)
            tl.store(value_cache_ptr + cached, as_cached(v, v_inv_scale, cache_dtype, FP8_CACHE),
                     mask=dim_valid)
        tl.debug_barrier()
    if DETERMINISTIC:  # no split: [kv_lo, kv_hi) is the tile's whole context (or window), all masked
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset,
            kv_lo // BLOCK_N * BLOCK_N, kv_hi, kv_hi, row_pos, dims, dim_valid, scale_log2, stride_c_block,
            stride_c_slot, window, softcap_log2, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, SLIDING, SOFTCAP,
        )
    else:  # BULK_N > 0 (a PrefillTuning): its unmasked loop
        acc, m_i, l_i = _attend_context(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, kv_lo, kv_hi, kv_end,
            first_row_pos, row_pos, dims, dim_valid, scale_log2, stride_c_block, stride_c_slot, window,
            softcap_log2, BLOCK_N, BLOCK_SIZE, DOT_PRECISION, SLIDING, SOFTCAP, BULK_N, BLOCK_ADDR, EVEN_D,
            FMA_SOFTMAX, OFFSET32, BULK_TAIL,
        )

    if SCALE_V:  # an FP8 cache holds V / v_scale (the split reduce is linear in acc)
        acc = acc * v_scale
    if BALANCED:  # a sequence of one chunk writes its rows; of several, the last chunk to finish does
        write = num_chunks == 1
        if num_chunks > 1:
            acc, l_i, write = _fold_chunks(
                acc, m_i, l_i, part_acc_ptr, part_max_ptr, part_sum_ptr,
                tickets_ptr + seq * num_kv_heads + kv_head,
                (row_global * num_heads + row_head) * num_splits, split, num_chunks, row_valid, dims, D_PAD,
            )
        if write:
            out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
            tl.store(
                out_ptr + row_global[:, None] * stride_o_tok + row_head[:, None] * stride_o_head
                + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=q_mask,
            )
    elif SPLIT:
        part_row = (row_global * num_heads + row_head) * num_splits + split  # [BLOCK_M]
        tl.store(part_max_ptr + part_row, m_i, mask=row_valid)
        tl.store(part_sum_ptr + part_row, l_i, mask=row_valid)
        tl.store(part_acc_ptr + part_row[:, None] * D_PAD + dims[None, :], acc, mask=row_valid[:, None])
    else:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + row_global[:, None] * stride_o_tok + row_head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty), mask=q_mask,
        )


@triton.jit
def _fold_chunks(acc, m_i, l_i, part_acc_ptr, part_max_ptr, part_sum_ptr, ticket_ptr, first_row, chunk,
                 num_chunks, row_valid, dims, D_PAD: tl.constexpr):
    """A balanced launch's chunk `chunk` of a sequence of num_chunks (> 1) on one KV head: stores its
    partial (rows first_row + chunk) and takes a ticket; the last of the sequence's chunks to finish
    (its ticket num_chunks - 1) zeroes the ticket for the next launch and returns the combined
    (acc, l_i, True), the others (acc, l_i, False). The chunks are combined in their own order, read back
    from L2, so the bits do not depend on which one finished last."""
    own = first_row + chunk  # [BLOCK_M]
    tl.store(part_max_ptr + own, m_i, mask=row_valid)
    tl.store(part_sum_ptr + own, l_i, mask=row_valid)
    tl.store(part_acc_ptr + own[:, None] * D_PAD + dims[None, :], acc, mask=row_valid[:, None])
    tl.debug_barrier()  # every thread's stores before the ticket's release (one thread takes it)
    ticket = tl.atomic_add(ticket_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()  # and the other chunks' stores, acquired by that thread, before any thread reads
    last = ticket == num_chunks - 1
    if last:
        tl.store(ticket_ptr, 0)
        m = tl.zeros_like(m_i) + float("-inf")
        for c in range(0, num_chunks):
            m = tl.maximum(m, tl.load(part_max_ptr + first_row + c, mask=row_valid, other=float("-inf"),
                                      cache_modifier=".cg"))
        m = tl.where(m == float("-inf"), 0.0, m)  # rows of no head (masked): nothing to weigh
        acc = tl.zeros_like(acc)
        l_i = tl.zeros_like(l_i)
        for c in range(0, num_chunks):
            rows = first_row + c
            weight = tl.exp2(tl.load(part_max_ptr + rows, mask=row_valid, other=float("-inf"),
                                     cache_modifier=".cg") - m)
            l_i += weight * tl.load(part_sum_ptr + rows, mask=row_valid, other=0.0, cache_modifier=".cg")
            acc += weight[:, None] * tl.load(part_acc_ptr + rows[:, None] * D_PAD + dims[None, :],
                                             mask=row_valid[:, None], other=0.0, cache_modifier=".cg")
    return acc, l_i, last


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_splits_kernel(
    out_ptr, part_acc_ptr, part_max_ptr, part_sum_ptr,
    num_heads, num_splits, head_dim, stride_o_tok, stride_o_head,
    S_PAD: tl.constexpr, D_PAD: tl.constexpr, PDL: tl.constexpr = False,
):
    if PDL:  # kernels.pdl
        gdc_wait()
        gdc_launch_dependents()
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, S_PAD)
    dims = tl.arange(0, D_PAD)
    split_valid = splits < num_splits
    part_row = (token * num_heads + head) * num_splits + splits  # [S_PAD]
    part_max = tl.load(part_max_ptr + part_row, mask=split_valid, other=float("-inf"))
    part_sum = tl.load(part_sum_ptr + part_row, mask=split_valid, other=0.0)
    acc_ptrs = part_acc_ptr + part_row[:, None] * D_PAD + dims[None, :]
    acc = tl.load(acc_ptrs, mask=split_valid[:, None], other=0.0)  # [S_PAD, D_PAD]
    # the split holding the row's own position has a finite max (others, e.g. before a sliding
    # window, may hold -inf and weigh 0)
    weight = tl.exp2(part_max - tl.max(part_max, axis=0))
    out = tl.sum(acc * weight[:, None], axis=0) / tl.sum(part_sum * weight, axis=0)  # [D_PAD]
    tl.store(
        out_ptr + token * stride_o_tok + head * stride_o_head + dims,
        out.to(out_ptr.dtype.element_ty), mask=dims < head_dim,
    )


def balanced_chunks(
    seq_lens: list[int], num_kv_heads: int, balance_programs: int, max_chunks: int,
    min_partition: int = _MIN_PARTITION, grain: int = UNSPLIT_DECODE_TILE[0],
) -> tuple[int, list[int]]:
    """The plan of a balanced decode launch (the kernel's arithmetic, for tests and benchmarks): the
    partition size, the larger of the step's positions times its KV heads shared by `balance_programs`
    programs and the longest context in `max_chunks` (rounded up to whole `grain`-position tiles, at
    least `min_partition`), and each sequence's chunk count (1 to max_chunks)."""
    share = -(-sum(seq_lens) * num_kv_heads // balance_programs)
    longest = -(-max(seq_lens, default=0) // max_chunks)
    part = max(-(-max(share, longest) // grain) * grain, min_partition)
    return part, [max(-(-n // part), 1) for n in seq_lens]


_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED_TICKETS: list[torch.Tensor] = []  # replaced buffers, kept for the graphs that point at them


def balance_tickets(device: torch.device, count: int) -> torch.Tensor:
    """The balanced launches' tickets on `device` (int32, zero between launches: the last chunk of each
    sequence and KV head zeroes its own), at least `count` of them. One buffer a device, allocated once
    for BALANCED_MAX_SEQS x 128 KV heads (512 KiB) and kept, so every CUDA graph captured on the device
    replays launches that point at live memory; a larger count (more KV heads) gets a larger one, and
    the one it replaces is kept alive for the graphs that hold it."""
    have = _TICKETS.get(device)
    if have is None or have.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # a buffer made inside a capture is zeroed only when the graph replays
            raise RuntimeError("balanced decode's tickets are allocated by an eager launch on the device "
                               "before any CUDA graph capture (a warm-up pass of the same shape)")
        fresh = torch.zeros(max(count, BALANCED_MAX_SEQS * 128), dtype=torch.int32, device=device)
        if have is not None:
            _RETIRED_TICKETS.append(have)
        _TICKETS[device] = have = fresh
    return have


def split_slots(device: torch.device) -> int:
    """Grid size (programs) from which the context is not split: two programs per SM.

    Calibrated on an H100 (132 SMs), decode tile (BLOCK_N 64, d 128, 4 warps, 3 stages: 128
    registers, 39 KB shared, so 4 resident programs per SM by registers): 512 programs unsplit beat
    every split for (64 seqs, 1024 or 4096 context); 128 programs were fastest split 3, 4 or 8 ways
    (within 1 %), while 5 ways (640 programs, 1.2 x the 528 resident) ran 15 % slower. Unsplit
    launches take UNSPLIT_DECODE_TILE since 2026-11-27 (one warp, more programs an SM); this
    threshold was not swept again with it."""
    if device.type != "cuda":
        return 8
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def choose_num_splits(
    num_programs: int, max_seq_len: int, num_slots: int, fp8_decode: bool = False, min_splits: int = 1
) -> int:
    """Split-K count for a grid of num_programs (tiles x KV heads); num_slots from split_slots();
    at least min_splits where max_seq_len holds that many partitions (FP8_MHA_MIN_SPLITS).

    A grid of at least 3/4 of num_slots programs is left alone. A smaller one is split into the
    fewest partitions that give at least 0.9 x num_slots programs (about a wave of two programs an
    SM); fp8_decode (the FP8 cache's one-warp decode tile, many programs an SM): at least 1.5 x
    num_slots, in waves of num_slots the last at least 90 % full (H100 16 x 16384: 207 us split in
    four, 283 in two). Partitions stay >= _MIN_PARTITION positions (of max_seq_len; the kernel splits
    each context evenly into the count chosen here).

    The 3/4: on an H100 (264 slots), 32 sequences of 1024 positions x 8 KV heads = 256 programs took
    1689 us of attention per llama3-8b decode step unsplit and 1832 us split in two. The 0.9: the split
    launch held to 128 registers (EVEN_SPLIT_DECODE_MAXNREG, four programs an SM), H100, one layer,
    1,024 / 4,096 / 16,384 positions: 24 sequences 54.5 / 153.0 / 545.8 us split in two against
    57.2 / 163.1 / 578.7 in four (the rule before, 1.5 x num_slots programs); 20 sequences 48.5 /
    131.6 / 463.3 in two against 49.8 / 134.6 / 470.8 in three; 16 sequences 42.0 / 111.5 / 381.5 in
    two, 43.5 / 111.5 / 375.4 in four; 8 sequences 27.6 / 66.5 / 201.2 in four, 28.1 / 66.4 / 198.8
    in eight (docs/benchmarks.md, "Paged decode attention")."""
    max_splits = max(1, math.ceil(max_seq_len / _MIN_PARTITION))
    least = min(min_splits, max_splits)
    if num_programs >= 0.75 * num_slots:
        return least
    for splits in range(max(2, least), max_splits + 1):
        programs = num_programs * splits
        if fp8_decode:
            if programs >= 1.5 * num_slots and programs >= 0.9 * math.ceil(programs / num_slots) * num_slots:
                return splits
        elif programs >= 0.9 * num_slots:
            return splits
    return max_splits


@dataclass(frozen=True, slots=True)
class DecodeRotary:
    """What a decode launch needs to rotate its query and write the step's K/V itself: the tokens'
    positions [T] and slots [T] (< 0: padding, nothing written), the unrotated key and value [T, KV, D]
    (views of the QKV projection are fine), the rotary tables [P, D / 2] and the FP8 cache's scales."""

    positions: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    slot_mapping: torch.Tensor
    cos_cache: torch.Tensor
    sin_cache: torch.Tensor
    k_scale: float = 1.0
    v_scale: float = 1.0

    def kernel_args(self, query: torch.Tensor, key_cache: torch.Tensor) -> tuple:
        key, value = self.key, self.value
        num_tokens, num_heads, head_dim = query.shape
        shape = (num_tokens, key_cache.shape[2], head_dim)
        if (key.shape, value.shape) != (shape, shape) or not key.dtype == value.dtype == query.dtype:
            raise ValueError(f"rotary key and value must be {query.dtype} {shape}, got "
                             f"{key.dtype} {tuple(key.shape)} and {value.dtype} {tuple(value.shape)}")
        if key.stride(2) != 1 or value.stride(2) != 1 or head_dim % 2:
            raise ValueError("rotary needs an even head_dim, contiguous in key and value")
        if self.cos_cache.stride(-1) != 1 or self.cos_cache.stride() != self.sin_cache.stride():
            raise ValueError("rotary cos and sin tables must share strides, the last one 1")
        if self.positions.shape != (num_tokens,) or self.slot_mapping.shape != (num_tokens,):
            raise ValueError(f"rotary positions and slot_mapping must be [{num_tokens}]")
        return (
            self.positions, self.slot_mapping, self.cos_cache, self.sin_cache, key, value,
            self.cos_cache.stride(0), key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            1.0 / self.k_scale, 1.0 / self.v_scale,
        )


def rotary_cache_attention(
    positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
    block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
    sliding_window: int = 0, logit_softcap: float = 0.0, *, deterministic: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, decode_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """triton_layers.rotary_and_cache, then paged_attention over the rotated query: the same bits, in
    one launch where it is a decode launch (max_query_len 1, not deterministic, no window or softcap)
    that kernels.fused_rotary takes (by default up to kernels.FUSED_ROTARY_MAX_SEQS sequences). Each
    program rotates its query rows; the program whose partition holds a sequence's own position (one
    per sequence and KV head) rotates that token's key, writes K and V into the cache at the token's
    slot, and after a block barrier (its stores visible to all its threads) reads its context, that
    position included, as the two launches do. The step's kernel count falls by one a layer (the
    rotary + cache launch and the boundary before it). Other launches run the two ops. Token i of a
    decode launch is the query token of the sequence whose query_start_loc is i; a token of no
    sequence must have slot < 0 (a CUDA graph's padding), and no other program may read a slot the
    step writes (the scheduler's blocks: a sequence's last block is its own, copied on write when
    shared)."""
    check_scales(key_cache.dtype, k_scale, v_scale)
    attend = dict(sliding_window=sliding_window, logit_softcap=logit_softcap, deterministic=deterministic,
                  k_scale=k_scale, v_scale=v_scale, decode_order=decode_order)
    # A window or a softcap keeps two launches: the rotating launch takes them (interpreter tests), but
    # was compiled and measured on a GPU without them only (round 24)
    if (max_query_len != 1 or deterministic or sliding_window > 0 or logit_softcap > 0
            or not fused_rotary(seq_lens.shape[0])):
        from kernels import triton_layers

        query = triton_layers.rotary_and_cache(
            positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
            k_scale, v_scale,
        )
        return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                               max_query_len, max_seq_len, scale, **attend)
    rotary = DecodeRotary(positions, key, value, slot_mapping, cos_cache, sin_cache, k_scale, v_scale)
    return paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
                           max_query_len, max_seq_len, scale, rotary=rotary, **attend)


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
    max_query_len, max_seq_len, scale, sliding_window: int = 0, logit_softcap: float = 0.0, *,
    num_splits: int | None = None,
    tile: tuple[int, int, int] | None = None, block_m: int | None = None, deterministic: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, fp8_f16: bool | None = None,
    prefill_tuning: PrefillTuning | None = None,
    fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None, fresh_tuning: FreshTuning | None = None,
    no_cached_prefix: bool = False, out: torch.Tensor | None = None,
    prefill_tile_starts: torch.Tensor | None = None, rotary: DecodeRotary | None = None,
    balance_programs: int | None = None, balance_chunks: int | None = None,
    decode_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """See kernels/reference.py (sliding_window > 0 masks keys that many positions or more before
    the query; 0 compiles the kernel without any window code; logit_softcap > 0 caps the scores,
    likewise compiled only when set). num_splits forces the split-K count
    (1 = none; > 1: partitions of max_seq_len / num_splits positions, the same for every sequence,
    those wholly before a tile's window left empty); tile forces
    (BLOCK_N, num_warps, num_stages) and block_m the rows of a prefill tile (benchmark sweeps).
    deterministic: batch-invariant rows (module docstring): one tile shape (max(16, G_PAD) rows) for
    every step, no split; it takes no num_splits > 1, tile or block_m. k_scale, v_scale: an FP8
    cache holds K / k_scale and V / v_scale; its tiles are read in the query's dtype, k_scale
    folded into the softmax scale and v_scale into the output. fp8_f16: a bf16 query over an FP8
    cache computes in f16 (None: so it does; False: in bf16, for comparisons). prefill_tuning: a
    PrefillTuning for prefill and mixed launches (not with tile, block_m or deterministic).
    fresh_kv: (key, value) [T, KV, D] of this step's tokens, the values the cache holds for them (the
    rotated keys), and finite in every row (a CUDA graph's padding tokens included); where
    fresh_kv_usable, a prefill or mixed launch runs its decode rows through the decode launch and its
    prefill rows through _fresh_prefill_kernel (TMA tiles of the fresh K/V, the cached prefix through
    the block table), with fresh_tuning or fresh_tuning_for's choice; not with num_splits, tile,
    block_m or prefill_tuning (the varlen kernel's sweeps). On sm_90 (without a forced fresh_tuning)
    the prefill rows run the warp-specialized Gluon kernel instead (kernels/gluon_prefill.py: the
    cached prefix through the block table, then the fresh K/V), where it takes the cache (block size
    8-64). no_cached_prefix (with fresh_kv): the caller knows no prefill row's sequence has a cached
    prefix (seq_len == its query length; a caller that is wrong gets rows that ignore the prefix):
    those kernels are compiled without their prefix code.
    out: write into this [T, H, D] tensor instead of a new one. prefill_tile_starts: the Gluon kernel's
    work list (kernels.prefill_tile_starts(query_start_loc)) when the caller has it. rotary: the query
    comes unrotated, and the launch rotates it and writes the step's K/V (rotary_cache_attention; a
    decode launch only). balance_programs, balance_chunks: a decode launch over a cache of the query's
    dtype without a window runs balanced (balanced_chunks) with these (benchmark sweeps; by default
    kernels.balanced_decode decides, with BALANCE_PROGRAMS programs and BALANCED_MAX_CHUNKS chunks).
    decode_order: int32 [B], a permutation of the sequences (kernels.decode_order: longest context
    first): a decode launch that kernels.ordered_decode lets take it hands them to the SMs in that order
    (module docstring, "Longest first"); the output is the same bits in any order. Other launches
    ignore it."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(2) == 1 and key_cache.is_contiguous() and value_cache.is_contiguous()
    assert key_cache.shape == value_cache.shape and block_tables.stride(1) == 1
    check_scales(key_cache.dtype, k_scale, v_scale)
    q_f16 = key_cache.element_size() == 1 and query.dtype == torch.bfloat16 and fp8_f16 is not False
    if out is None:
        out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    elif out.shape != query.shape or out.dtype != query.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be a {query.dtype} tensor shaped like the query {tuple(query.shape)} "
                         f"with a contiguous last dimension, got {tuple(out.shape)} {out.dtype}")
    if num_tokens == 0:
        return out
    forced = num_splits is not None or tile is not None or block_m is not None or prefill_tuning is not None
    usable = fresh_kv_usable(query, key_cache, fresh_kv, sliding_window, logit_softcap, deterministic)
    if max_query_len > 1 and not forced and usable:
        # decode rows (sequences of one query token; the decode kernel skips the others), then the rest.
        # Not split: a split's reduce runs over every token of the step (4 x 2048 tokens: 3x the time)
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 1,
                        max_seq_len, scale, num_splits=1, out=out, decode_order=decode_order)
        hopper = query.is_cuda and torch.cuda.get_device_capability(query.device) == (9, 0)
        if fresh_tuning is None and hopper:
            from kernels import gluon_prefill  # (imported here: only on sm_90, and only with fresh_kv)

            if gluon_prefill.supported(query, *fresh_kv) and (
                    no_cached_prefix or gluon_prefill.cache_supported(key_cache)):
                cache = {} if no_cached_prefix else dict(
                    key_cache=key_cache, value_cache=value_cache, block_tables=block_tables,
                    seq_lens=seq_lens,
                )
                gluon_prefill.gluon_fresh_prefill(
                    out, query, *fresh_kv, query_start_loc, scale, tile_starts=prefill_tile_starts, **cache
                )
                return out
        fresh_prefill(out, query, fresh_kv[0], fresh_kv[1], key_cache, value_cache, block_tables, seq_lens,
                      query_start_loc, scale, fresh_tuning or fresh_tuning_for(num_tokens, num_seqs),
                      prefix=not no_cached_prefix)
        return out
    if fresh_tuning is not None:
        raise ValueError("fresh_tuning needs a prefill launch that can read fresh_kv (fresh_kv_usable)")
    if no_cached_prefix and fresh_kv is None:
        raise ValueError("no_cached_prefix describes fresh_kv's prefill rows; it needs fresh_kv")
    group = num_heads // num_kv_heads
    # A mixed launch that cannot read fresh K/V (an FP8 cache, a window, a softcap, no TMA), without GQA
    # or over an FP8 cache with many sequences: the varlen tile skips its decode rows, which the decode
    # launch computes after it (module docstring, "Decode rows of a mixed launch")
    skip_decode = max_query_len > 1 and not forced and not deterministic and (
        group == 1 or (key_cache.element_size() == 1
                       and num_seqs * num_kv_heads >= FP8_GQA_SPLIT_DECODE_MIN_PROGRAMS))
    g_pad = triton.next_power_of_2(group)
    d_pad = max(16, triton.next_power_of_2(head_dim))
    if deterministic and ((num_splits or 1) > 1 or tile is not None or block_m is not None):
        raise ValueError("deterministic attention has one tile shape and no split")
    if prefill_tuning is not None:
        if not isinstance(prefill_tuning, PrefillTuning):
            raise TypeError(f"prefill_tuning must be a PrefillTuning, got {type(prefill_tuning).__name__}")
        if deterministic or tile is not None or block_m is not None:
            raise ValueError("prefill_tuning replaces tile and block_m and has no deterministic form")
    is_decode = max_query_len == 1 and not deterministic  # deterministic: decode rows in the varlen tile
    if (prefill_tuning is None and not (deterministic or is_decode or tile is not None or block_m is not None)
            and num_tokens >= PREFILL_TUNING_MIN_TOKENS_PER_SEQ * num_seqs):
        prefill_tuning = DEFAULT_PREFILL_TUNING
    if is_decode:
        block_q, block_m, block_n, num_warps, num_stages = 1, max(16, g_pad), 64, 4, 3
        if key_cache.element_size() == 1:  # e4m3 (dots in f16): small tiles, one warp, deep pipeline
            block_n, num_warps, num_stages = FP8_MHA_DECODE_TILE if group == 1 else FP8_DECODE_TILE
        num_tiles = num_seqs
    elif prefill_tuning is not None:
        block_m = max(prefill_tuning.block_m, g_pad)
        block_q, block_n = block_m // g_pad, prefill_tuning.block_n
        num_warps, num_stages = prefill_tuning.num_warps, prefill_tuning.num_stages
    else:
        block_m = max(16, g_pad) if deterministic else max(block_m or 64, g_pad)
        block_q, block_n, num_warps = block_m // g_pad, 64, 4
        num_stages = 3 if deterministic else 2  # the decode tile's pipelining depth (no effect on the bits)
    if not is_decode:
        num_tiles = num_tokens // block_q + num_seqs  # upper bound; surplus tiles exit at once
    tuned = prefill_tuning is not None and not is_decode
    fp8_decode = is_decode and key_cache.element_size() == 1 and tile is None
    if tile is not None:
        block_n, num_warps, num_stages = tile
    partition_size = _NO_PARTITION
    even_splits = False
    if deterministic:
        num_splits = 1
    elif num_splits is None:
        num_splits = choose_num_splits(  # FP8_MHA_DECODE_TILE's programs balance better split
            num_tiles * num_kv_heads, max_seq_len, split_slots(query.device), fp8_decode=fp8_decode,
            min_splits=FP8_MHA_MIN_SPLITS if fp8_decode and group == 1 else 1,
        )
        even_splits = num_splits > 1  # each tile's own context split evenly (in the kernel)
    elif num_splits > 1:  # forced: partitions of a fixed size, as a sweep over split counts needs
        partition_size = triton.cdiv(max_seq_len, num_splits)
        num_splits = triton.cdiv(max_seq_len, partition_size)
    # A decode launch over a cache of the query's dtype, no window: balanced chunks where the rule (or
    # the caller) says so (balanced_chunks; module docstring, "Balanced decode")
    can_balance = is_decode and tile is None and key_cache.element_size() > 1 and sliding_window <= 0
    if (balance_programs is not None or balance_chunks is not None) and not can_balance:
        raise ValueError("balance_programs and balance_chunks take a decode launch (q_len 1, not "
                         "deterministic, no tile) over a cache of the query's dtype without a sliding "
                         "window; "
                         f"this one has max_query_len {max_query_len}, deterministic {deterministic}, tile "
                         f"{tile}, a {key_cache.dtype} cache, sliding_window {sliding_window}")
    balanced = (can_balance and (
        balance_programs is not None or balance_chunks is not None
        or (not forced and num_seqs <= BALANCED_MAX_SEQS and balanced_decode(
            num_splits, num_tiles * num_kv_heads / split_slots(query.device)))))
    if balanced:
        if num_seqs > BALANCED_MAX_SEQS:
            raise ValueError(f"a balanced decode launch takes at most {BALANCED_MAX_SEQS} sequences, got "
                             f"{num_seqs}")
        balance_programs = balance_programs or BALANCE_PROGRAMS
        max_chunks = balance_chunks or BALANCED_MAX_CHUNKS
        if balance_programs < 1 or max_chunks < 1:
            raise ValueError(f"balance_programs and balance_chunks must be >= 1, got {balance_programs} "
                             f"and {max_chunks}")
        num_splits, even_splits, partition_size = 1, False, _NO_PARTITION
    split = num_splits > 1
    # an unsplit decode launch over a cache of the query's dtype: UNSPLIT_DECODE_TILE through _attend_bulk
    bulk_decode = fp8_decode or (is_decode and not split and tile is None and key_cache.element_size() > 1)
    if bulk_decode and not fp8_decode:
        block_n, num_warps, num_stages = UNSPLIT_DECODE_TILE
        programs_per_slot = num_tiles * num_kv_heads / split_slots(query.device)
        if (not balanced and sliding_window <= 0 and group > 1 and key_cache.element_size() == 2
                and d_pad <= 128
                and BALANCED_MAX_PROGRAMS_PER_SLOT < programs_per_slot <= WIDE_DECODE_MAX_PROGRAMS_PER_SLOT):
            block_n, num_warps, num_stages = WIDE_DECODE_TILE
    tuning = dict(BULK_N=0, BLOCK_ADDR=False, EVEN_D=False, FMA_SOFTMAX=False, OFFSET32=False,
                  BULK_TAIL=False)
    compact = kv_addressing() == "32"  # kernels.KV_ADDRESSING_ENV
    launch = {}
    if is_decode and even_splits and not fp8_decode and EVEN_SPLIT_DECODE_MAXNREG:
        launch["maxnreg"] = EVEN_SPLIT_DECODE_MAXNREG
    if tuned:
        t = prefill_tuning
        tuning.update(
            BULK_N=t.bulk_block_n,
            # the unmasked loop starts block-aligned: no window, and partitions (if split) of whole tiles
            BLOCK_ADDR=t.block_addressing and sliding_window <= 0 and partition_size == _NO_PARTITION
            and block_n % block_size == 0 and t.bulk_block_n % block_size == 0,
            EVEN_D=head_dim == d_pad, FMA_SOFTMAX=t.fma_softmax,
        )
        if t.maxnreg is not None:
            launch["maxnreg"] = t.maxnreg
    elif bulk_decode:  # the whole tiles through _attend_bulk, the scale in exp2; the last one too if aligned
        block_addr = sliding_window <= 0 and partition_size == _NO_PARTITION and block_n % block_size == 0
        tuning.update(BULK_N=block_n, FMA_SOFTMAX=True, BLOCK_ADDR=block_addr)
        if compact:
            tuning.update(EVEN_D=head_dim == d_pad, BULK_TAIL=block_addr)
    if tuning["BULK_N"] and compact:
        tuning["OFFSET32"] = offsets_fit_int32(key_cache)
    grain = math.lcm(block_n, block_size)  # a balanced chunk starts at whole K/V tiles and blocks

    if rotary is not None and not is_decode:
        raise ValueError("rotary: a decode launch only (max_query_len 1, not deterministic)")
    rotary_args = rotary.kernel_args(query, key_cache) if rotary is not None else (
        query, query, query, query, query, query, 0, 0, 0, 0, 0, 1.0, 1.0)

    on = pdl(query.device, "attention", num_seqs if is_decode else None)
    f32 = dict(dtype=torch.float32, device=query.device)
    if balanced:  # the grid's axis 2: a sequence's chunks (those past its count exit at once)
        num_splits = max_chunks
        part_acc = torch.empty(num_tokens, num_heads, num_splits, d_pad, **f32)
        part_max = torch.empty(num_tokens, num_heads, num_splits, **f32)
        part_sum = torch.empty(num_tokens, num_heads, num_splits, **f32)
    else:
        part_acc = torch.empty(num_tokens, num_heads, num_splits, d_pad, **f32) if split else out
        part_max = torch.empty(num_tokens, num_heads, num_splits, **f32) if split else out
        part_sum = torch.empty(num_tokens, num_heads, num_splits, **f32) if split else out
    seq_pad = triton.next_power_of_2(num_seqs) if balanced else 1
    if is_decode and decode_order is not None and (
            decode_order.shape != (num_seqs,) or decode_order.dtype != torch.int32
            or decode_order.device != query.device):
        raise ValueError(f"decode_order must be int32 [{num_seqs}] on {query.device} (kernels.decode_order), "
                         f"got {decode_order.dtype} {tuple(decode_order.shape)} on {decode_order.device}")
    # longest first where kernels.ordered_decode says (the rule: unsplit, unbalanced, a plain cache)
    ordered = is_decode and decode_order is not None and ordered_decode(
        split or balanced, key_cache.element_size() > 1 and sliding_window <= 0)
    grid = (num_tiles * num_kv_heads * num_splits,) if ordered else (num_tiles, num_kv_heads, num_splits)
    _paged_attention_kernel[grid](
        out, part_acc, part_max, part_sum,
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * k_scale * math.log2(math.e), num_seqs, max(0, (num_seqs - 1).bit_length()), partition_size,
        num_heads, num_splits, head_dim,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        max(sliding_window, 0), logit_softcap * math.log2(math.e), v_scale, balance_programs or 1,
        _MIN_PARTITION, balance_tickets(query.device, num_seqs * num_kv_heads) if balanced else seq_lens,
        decode_order if ordered else seq_lens, num_kv_heads,
        *rotary_args,
        GROUP=group, G_PAD=g_pad, BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_SIZE=block_size, D_PAD=d_pad, IS_DECODE=is_decode, SPLIT=split,
        EVEN_SPLITS=even_splits,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32",
        SLIDING=sliding_window > 0, SOFTCAP=logit_softcap > 0, DETERMINISTIC=deterministic,
        SCALE_V=v_scale != 1.0, Q_F16=q_f16, SKIP_DECODE=skip_decode, **tuning,
        ROTARY=rotary is not None, RN=query.is_cuda, FP8_CACHE=is_fp8(key_cache.dtype),
        num_warps=num_warps, num_stages=num_stages, **launch,
        PDL=on, **pdl_launch(on), BALANCED=balanced, SEQ_PAD=seq_pad, GRAIN=grain if balanced else 1,
        ORDERED=ordered,
    )
    if split:
        on_reduce = pdl(query.device, "reduce")
        _reduce_splits_kernel[(num_tokens, num_heads)](
            out, part_acc, part_max, part_sum, num_heads, num_splits, head_dim, out.stride(0), out.stride(1),
            S_PAD=triton.next_power_of_2(num_splits), D_PAD=d_pad, num_warps=4,
            PDL=on_reduce, **pdl_launch(on_reduce),
        )
    if skip_decode:  # after the split reduce, which writes every row of the step (the decode rows too)
        paged_attention(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, 1,
                        max_seq_len, scale, sliding_window, logit_softcap, num_splits=1, k_scale=k_scale,
                        v_scale=v_scale, fp8_f16=fp8_f16, out=out, decode_order=decode_order)
    return out


# ---- prefill rows over the step's own K/V (fresh_kv): TMA tiles; the cached prefix via the block table ----


@triton.jit
def _find_sequence_at_once(query_start_loc_ptr, tile_id, num_seqs, UNIT: tl.constexpr, SEQ_PAD: tl.constexpr):
    """_find_sequence's answer (first tile of sequence i: query_start_loc[i] // UNIT + i) from one
    vector load of the SEQ_PAD >= num_seqs starts: one memory latency, not log2(num_seqs) dependent ones."""
    offs = tl.arange(0, SEQ_PAD)
    valid = offs < num_seqs
    first_tile = tl.load(query_start_loc_ptr + offs, mask=valid, other=0) // UNIT + offs
    return tl.sum((valid & (first_tile <= tile_id)).to(tl.int32), axis=0) - 1


@triton.jit
def _fresh_tile(
    out_ptr, q_desc, k_desc, v_desc, key_cache_ptr, value_cache_ptr, block_table, q_begin, q_len,
    context_start, q_tile_start, head, scale_log2, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head,
    GROUP: tl.constexpr, PACKED: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFIX: tl.constexpr, PREFIX_STAGES: tl.constexpr, PREFIX_BULK: tl.constexpr,
):
    """Query rows [q_tile_start, q_tile_start + BLOCK_Q) of one sequence x one query head (PACKED: the
    GROUP heads of KV head `head`): the cached prefix, then the fresh tokens up to the diagonal; the
    normalized rows stored."""
    rows = tl.arange(0, BLOCK_M)
    if PACKED:
        kv_head = head
        row_token = q_tile_start + rows // GROUP
        row_head = kv_head * GROUP + rows % GROUP
        q = q_desc.load([q_begin + q_tile_start, kv_head * GROUP, 0]).reshape([BLOCK_M, D])
    else:
        kv_head = head // GROUP
        row_token = q_tile_start + rows
        row_head = head + rows * 0
        q = q_desc.load([q_begin + q_tile_start, head * D])
    dims = tl.arange(0, D)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)

    # the cached prefix [0, context_start): every row sees all of it; gathered through the block table
    if PREFIX and PREFIX_BULK:  # whole tiles unmasked (block-aligned addresses), the rest masked by position
        head_offset = kv_head.to(tl.int64) * stride_c_head
        prefix_bulk = context_start // BLOCK_N * BLOCK_N
        acc, m_i, l_i = _attend_bulk(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, 0, prefix_bulk,
            dims, dims < D, scale_log2, stride_c_block, stride_c_slot, 0.0,
            BLOCK_N, BLOCK_SIZE, DOT_PRECISION, False, BLOCK_N % BLOCK_SIZE == 0, True, True,
        )
        acc, m_i, l_i = _attend_tiles(
            acc, m_i, l_i, q, key_cache_ptr, value_cache_ptr, block_table, head_offset, prefix_bulk,
            context_start, context_start, context_start + row_token, dims, dims < D, scale_log2,
            stride_c_block, stride_c_slot, 0, 0.0, BLOCK_N, BLOCK_SIZE, True, DOT_PRECISION, False, False,
        )
    elif PREFIX:  # one loop, every tile masked (H100: 10 % faster than the two at 16 x 512, no prefix)
        head_offset = kv_head.to(tl.int64) * stride_c_head
        rows_n = tl.arange(0, BLOCK_N)
        for start in tl.range(0, context_start, BLOCK_N, num_stages=PREFIX_STAGES):
            pos = start + rows_n
            in_prefix = pos < context_start
            block = tl.load(block_table + pos // BLOCK_SIZE, mask=in_prefix, other=0).to(tl.int64)
            kv_offset = block * stride_c_block + (pos % BLOCK_SIZE) * stride_c_slot + head_offset
            # past the prefix: rows of block 0, K masked out of the scores, V zeroed (a cache's unused
            # rows may hold anything, NaN included, and 0 * NaN is NaN)
            k = tl.load(key_cache_ptr + kv_offset[:, None] + dims[None, :])
            v = tl.load(
                value_cache_ptr + kv_offset[:, None] + dims[None, :], mask=in_prefix[:, None], other=0.0
            )
            s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
            s = tl.where(in_prefix[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: the tile holds a prefix position
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

    # the fresh tokens: whole tiles before the first row unmasked, then the causal diagonal
    fresh_lo = q_tile_start // BLOCK_N * BLOCK_N
    fresh_hi = tl.minimum(q_tile_start + BLOCK_Q, q_len)
    k_col = kv_head * D
    for j in tl.range(0, fresh_lo, BLOCK_N, num_stages=NUM_STAGES):
        k = k_desc.load([q_begin + j, k_col])
        v = v_desc.load([q_begin + j, k_col])
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * scale_log2)
        p = tl.exp2(s * scale_log2 - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    for j in tl.range(fresh_lo, fresh_hi, BLOCK_N):
        cols = j + tl.arange(0, BLOCK_N)
        k = k_desc.load([q_begin + j, k_col])
        v = v_desc.load([q_begin + j, k_col])  # rows past the sequence: weight 0, finite (fresh_kv)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
        s = tl.where(cols[None, :] <= row_token[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    row_global = (q_begin + row_token).to(tl.int64)
    tl.store(
        out_ptr + row_global[:, None] * stride_o_tok + row_head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty), mask=(row_token < q_len)[:, None],
    )


@triton.jit(do_not_specialize=["num_seqs", "num_search_steps", "stride_bt_seq"])
def _fresh_prefill_kernel(
    out_ptr, q_desc, k_desc, v_desc, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr,
    query_start_loc_ptr, scale_log2, num_seqs, num_search_steps, stride_o_tok, stride_o_head,
    stride_c_block, stride_c_slot, stride_c_head, stride_bt_seq,
    GROUP: tl.constexpr, PACKED: tl.constexpr, PAIRED: tl.constexpr, SEQ_PAD: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, D: tl.constexpr, NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr, PREFIX: tl.constexpr, PREFIX_STAGES: tl.constexpr, PREFIX_BULK: tl.constexpr,
):
    """One program: query tiles of BLOCK_Q tokens of one sequence with q_len >= 2 (decode rows are the
    decode launch's) x one query head (PACKED: the GROUP heads of one KV head, rows r = t * GROUP + g).
    PAIRED: the program owns tiles p and n - 1 - p of the sequence's n, so that under the causal mask
    every program of an n-tile sequence does the same work (n + 1 K/V tiles' worth) and pays its
    start-up (sequence lookup, first loads) once for two tiles; else tile p. Sequence i's programs
    are ids [query_start_loc[i] // UNIT + i, ...), UNIT = BLOCK_Q (2 * BLOCK_Q paired): at least the
    n (ceil(n / 2)) it needs; the surplus exits. Keys: the cached prefix [0, context_start) gathered
    through the block table, then the fresh tokens [0, last row] read as TMA tiles from rows
    q_begin + j of the fresh K/V, causal on the diagonal. Tiles past the sequence's end (the next
    sequence's rows, padding rows, zeros past the tensor) are masked by the causal test; their V rows
    get weight 0, so they must be finite (0 * NaN is NaN): rotary_and_cache(rotate_key_in_place=True)
    zeroes the padding tokens' rows. (Zeroing them here instead, with a select on the V tile, cost
    20-60 % of the kernel's time on the H100.)"""
    tile_id = tl.program_id(0)
    head = tl.program_id(1)  # PACKED: the KV head; else the query head
    UNIT: tl.constexpr = 2 * BLOCK_Q if PAIRED else BLOCK_Q
    if SEQ_PAD > 0:
        seq = _find_sequence_at_once(query_start_loc_ptr, tile_id, num_seqs, UNIT, SEQ_PAD)
    else:
        seq = _find_sequence(query_start_loc_ptr, tile_id, num_seqs, num_search_steps, UNIT)
    q_begin = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_begin
    program = tile_id - (q_begin // UNIT + seq)
    if PAIRED:
        num_q_tiles = tl.cdiv(q_len, BLOCK_Q)
        mirror = num_q_tiles - 1 - program
    if q_len < 2 or program * BLOCK_Q >= q_len:
        return
    if PAIRED and mirror < program:  # the pair was the program before's
        return
    context_start = tl.load(seq_lens_ptr + seq) - q_len
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt_seq
    if PAIRED:  # the longer tile first, then the shorter one unless it is the same tile
        for t in range(2 - (mirror == program).to(tl.int32)):
            q_tile_start = tl.where(t == 0, mirror, program) * BLOCK_Q
            _fresh_tile(
                out_ptr, q_desc, k_desc, v_desc, key_cache_ptr, value_cache_ptr, block_table, q_begin,
                q_len, context_start, q_tile_start, head, scale_log2, stride_o_tok, stride_o_head,
                stride_c_block, stride_c_slot, stride_c_head,
                GROUP, PACKED, BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_SIZE, D, NUM_STAGES, DOT_PRECISION, PREFIX,
                PREFIX_STAGES, PREFIX_BULK,
            )
    else:
        _fresh_tile(
            out_ptr, q_desc, k_desc, v_desc, key_cache_ptr, value_cache_ptr, block_table, q_begin, q_len,
            context_start, program * BLOCK_Q, head, scale_log2, stride_o_tok, stride_o_head,
            stride_c_block, stride_c_slot, stride_c_head,
            GROUP, PACKED, BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_SIZE, D, NUM_STAGES, DOT_PRECISION, PREFIX,
            PREFIX_STAGES, PREFIX_BULK,
        )


# the one-shot sequence lookup holds query_start_loc[:SEQ_PAD] in registers: up to this many sequences
FRESH_LOOKUP_MAX_SEQS = 1024


def _descriptor(t: torch.Tensor, block_shape: list[int]):
    from triton.tools.tensor_descriptor import TensorDescriptor

    num_tokens, heads, dim = t.shape
    if len(block_shape) == 3:  # [T, heads, D] boxes of [tokens, heads, D]
        return TensorDescriptor(t, [num_tokens, heads, dim], [t.stride(0), dim, 1], block_shape)
    return TensorDescriptor(t, [num_tokens, heads * dim], [t.stride(0), 1], block_shape)


def fresh_prefill(
    out, query, key, value, key_cache, value_cache, block_tables, seq_lens, query_start_loc, scale,
    tuning: FreshTuning, prefix: bool = True,
) -> None:
    """The prefill rows (sequences with >= 2 query tokens) of a step into `out`, keys from the cached
    prefix and the step's own K/V (key, value [T, KV, D], what the cache holds for those tokens).
    prefix=False: the caller knows no prefill row has a cached prefix (seq_len == query length);
    the kernel is compiled without the prefix loop (fewer registers)."""
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    packed = tuning.packed and _is_pow2(group) and tuning.block_m >= group
    block_m = tuning.block_m
    block_q = block_m // group if packed else block_m
    if packed:
        q_desc = _descriptor(query, [block_q, group, head_dim])
    else:
        q_desc = _descriptor(query, [block_m, head_dim])
    k_desc = _descriptor(key, [tuning.block_n, head_dim])
    v_desc = _descriptor(value, [tuning.block_n, head_dim])
    unit = 2 * block_q if tuning.paired else block_q
    num_programs = num_tokens // unit + num_seqs  # upper bound; surplus programs and decode rows exit
    seq_pad = triton.next_power_of_2(num_seqs) if num_seqs <= FRESH_LOOKUP_MAX_SEQS else 0
    _fresh_prefill_kernel[(num_programs, num_kv_heads if packed else num_heads)](
        out, q_desc, k_desc, v_desc, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        scale * math.log2(math.e), num_seqs, max(0, (num_seqs - 1).bit_length()),
        out.stride(0), out.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
        GROUP=group, PACKED=packed, PAIRED=tuning.paired, SEQ_PAD=seq_pad, BLOCK_Q=block_q, BLOCK_M=block_m,
        BLOCK_N=tuning.block_n,
        BLOCK_SIZE=block_size, D=head_dim, NUM_STAGES=tuning.num_stages,
        DOT_PRECISION="ieee" if query.dtype == torch.float32 else "tf32", PREFIX=prefix,
        PREFIX_STAGES=tuning.prefix_stages, PREFIX_BULK=tuning.prefix_bulk,
        num_warps=tuning.num_warps, num_stages=tuning.num_stages,
    )
