"""Kernels of pagedserve: the dispatching entry points (signatures in docs/interfaces.md).

Each op runs the Triton implementation when its tensors are on CUDA and the plain-torch reference
(`kernels.reference`) otherwise. The Triton modules are imported on first CUDA use, so CPU-only
processes never import triton. Tests call `kernels.triton_*` directly to run Triton on CPU under
TRITON_INTERPRET=1.

Deliberately no `__version__` here: transformers probes for an unrelated PyPI package named
`kernels` (tests/unit/test_layering.py).
"""

import contextlib
import functools
import importlib
import os

import torch

from kernels import reference

__all__ = [
    "batch_invariant_matmul",
    "blas_library",
    "copy_blocks",
    "decode_order",
    "fused_moe",
    "gemma_rms_norm",
    "greedy_sample",
    "layer_norm",
    "paged_attention",
    "pdl",
    "pdl_launch",
    "prefill_tile_starts",
    "reshape_and_cache",
    "rms_norm",
    "rotary_and_cache",
    "rotary_cache_attention",
    "rotary_embedding",
    "silu_and_mul",
    "skinny_gate_up_silu",
    "skinny_linear",
    "skinny_usable",
    "swap_blocks",
]


# The Hopper prefill kernel's (kernels/gluon_prefill.py) query tile: its work list counts these.
PREFILL_TILE_ROWS = 128


def prefill_tile_starts(query_start_loc: torch.Tensor) -> torch.Tensor:
    """int32 [B + 1] on query_start_loc's device: entry i = the PREFILL_TILE_ROWS-row query tiles of
    sequences 0 .. i - 1 that have >= 2 query tokens (one-token sequences are the decode launch's), so
    the prefill kernel's programs draw only real work. Host-built metadata computes it on the host
    (executor_svc/runner/inputs.py) and sends it with the step; works on any device."""
    lens = (query_start_loc[1:] - query_start_loc[:-1]).to(torch.int32)
    tiles = torch.where(lens >= 2, (lens + PREFILL_TILE_ROWS - 1) // PREFILL_TILE_ROWS, 0)
    starts = torch.zeros(lens.shape[0] + 1, dtype=torch.int32, device=query_start_loc.device)
    torch.cumsum(tiles, 0, dtype=torch.int32, out=starts[1:])
    return starts


# ---- programmatic dependent launch (PDL, sm_90+): a kernel's programs start while the one before ends ----

PDL_ENV = "PAGEDSERVE_PDL"  # "0": launch every kernel plainly (for comparisons)
# A comma-separated list of the decode path's kernels to launch plainly while the rest keep PDL (names:
# PDL_KERNELS; "" = every one with PDL). Set, it alone decides; unset, the default rule holds: a
# decode-only paged-attention launch of fewer than PDL_ATTENTION_MIN_SEQS sequences launches plainly.
# Why (H200, llama3-8b, decode graphs at 800 positions, docs/benchmarks.md round 18): with every kernel
# chained by PDL, graphs of 40-64 sequences ran 3-7 % longer than with none, and launching any one kind
# of kernel of a layer plainly took most of that back, attention the most (16 sequences kept PDL's
# gain); attention launched plainly at 96-256 sequences was 1.2-1.5 % slower than with PDL. Giving the
# early-launched attention programs work before their wait (an L2 prefetch of the cached K/V, whose
# positions no kernel of the step writes) made 16-96-sequence graphs 0-7 % slower, not faster (round 19).
PDL_OFF_ENV = "PAGEDSERVE_PDL_OFF"
PDL_KERNELS = ("skinny", "rms_norm", "rotary_cache", "attention", "reduce")
PDL_ATTENTION_MIN_SEQS = 96


@functools.cache
def _pdl_on(device_index: int) -> bool:
    if os.environ.get(PDL_ENV, "1") == "0":
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


@functools.cache
def _pdl_off_kernels(value: str) -> frozenset[str]:
    names = frozenset(name.strip() for name in value.split(",") if name.strip())
    unknown = sorted(names - set(PDL_KERNELS))
    if unknown:
        raise ValueError(
            f"{PDL_OFF_ENV}: unknown kernel(s) {', '.join(unknown)}; known: {', '.join(PDL_KERNELS)}"
        )
    return names


def check_pdl_env() -> None:
    """Refuses (ValueError naming the known kernels) a PAGEDSERVE_PDL_OFF with an unknown name, so
    an executor says so at its start instead of at its first kernel launch."""
    _pdl_off_kernels(os.environ.get(PDL_OFF_ENV, ""))


def pdl(device: torch.device, kernel: str | None = None, num_seqs: int | None = None) -> bool:
    """Whether the decode path's Triton kernels (the skinny GEMMs, RMSNorm, rotary + cache write,
    paged attention and its split reduce) launch on `device` with programmatic dependent launch.

    Launched so, a kernel's programs may become resident before the kernel ahead of it in the stream has
    finished; each program first waits (`griddepcontrol.wait`, every program, before any load of a value
    an earlier kernel may write and before any store) for that kernel to complete and its writes to be
    visible, then lets the next kernel launch. So the order of a step's effects is the order of its
    launches, as without PDL (a kernel that completes has waited for the one before, so the chain holds
    across kernels launched plainly, cuBLAS's or torch's, too); what overlaps is the launch and a
    program's set-up, and in the skinny GEMM the prefetch of its first weight columns into L2 (the weights
    are never written by a step). On for Hopper and later GPUs, tensor-parallel ranks included (an NCCL
    kernel is launched plainly, so it waits for the kernel before it to complete, and a PDL kernel after
    it waits for it); off on other devices, on the CPU and under the Triton interpreter, and with
    PAGEDSERVE_PDL=0; `kernel` (one of PDL_KERNELS) is launched plainly where PAGEDSERVE_PDL_OFF names it;
    `num_seqs` (attention's decode-only launches): fewer than PDL_ATTENTION_MIN_SEQS launch plainly while
    PAGEDSERVE_PDL_OFF is unset. How we know it works: the GPU tests of every kernel and model run with it
    on (the default), a two-GPU rank gives the same logits with it on and off
    (tests/gpu/test_tensor_parallel_gpu.py), and `clients.bench.step` prints a decode step's graph time
    with and without it (docs/benchmarks.md, rounds 12 and 18)."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return False
    listed = os.environ.get(PDL_OFF_ENV)
    if listed is None:
        if kernel == "attention" and num_seqs is not None and num_seqs < PDL_ATTENTION_MIN_SEQS:
            return False
    elif kernel is not None and kernel in _pdl_off_kernels(listed):
        return False
    return _pdl_on(device.index if device.index is not None else torch.cuda.current_device())


# ---- a decode step's rotary and K/V cache write inside its attention launch (rotary_cache_attention) ----

FUSED_ROTARY_ENV = "PAGEDSERVE_FUSED_ROTARY"  # unset: FUSED_ROTARY_MAX_SEQS; "0": never; "all": always
# Decode launches of at most this many sequences rotate inside attention. H200, llama3-8b decode graphs
# at 500 positions, paired processes: round 24, 16 / 32 / 48 / 64 / 128 sequences 1.3 / 2.0 / 1.5 / 0.2 /
# 0.4 % shorter fused, 256 0.5 % longer; round 25 (two rounds, medians), 160 / 192 / 224 sequences 0.4 /
# 0.6 / 0.4 % shorter, 256 even, 384 0.8 % longer (docs/benchmarks.md). Likely, not profiled: the block
# barrier after a program's K/V stores holds back its first K/V loads, and the ~8 waves of programs at
# 256 sequences each pay that. 224 is a decode graph bucket (runner/cuda_graphs.py DECODE_BUCKETS).
FUSED_ROTARY_MAX_SEQS = 224


def fused_rotary(num_seqs: int) -> bool:
    """Whether a decode launch of `num_seqs` sequences (a CUDA graph's bucket: its padded count) rotates
    its query and writes the step's K/V itself (kernels/triton_attention.py rotary_cache_attention)
    instead of after a rotary_and_cache launch; PAGEDSERVE_FUSED_ROTARY decides, an unknown value is a
    ValueError naming the known ones."""
    mode = os.environ.get(FUSED_ROTARY_ENV, "")
    if mode == "":
        return num_seqs <= FUSED_ROTARY_MAX_SEQS
    if mode in ("0", "all"):
        return mode == "all"
    raise ValueError(f"{FUSED_ROTARY_ENV}={mode!r}: expected unset (the rule: fused up to "
                     f"{FUSED_ROTARY_MAX_SEQS} sequences), '0' (never) or 'all' (every decode launch)")


# ---- decode attention in chunks balanced over the step's lengths (triton_attention.balanced_chunks) ----

BALANCED_DECODE_ENV = "PAGEDSERVE_BALANCED_DECODE"  # unset or "rule": the rule; "0": never; "all": always
# The rule: launches that would not split, of at most this many programs (sequences x KV heads) a split
# slot (2 x SMs; H200: 25-66 sequences of llama3-8b's 8 KV heads), and those that would split in two
# (H200: 15-24 sequences). H200, sharegpt-400's decode steps, attention alone (docs/benchmarks.md round
# 26), two chunks of half the longest context: 24-49 sequences 0.72-0.91 of the unsplit launch's time, 64
# 0.96, 97-338 1.05-1.16 (the reduce launch and the lengths' load cost more than the balance wins there).
# The default since round 27: through the engine, sharegpt-400 offline on the H200, A B B A, it gave
# 12,558 / 12,518 out tok/s against 12,366 / 12,387 with it off (+1.3 %; the 16-63-sequence decode steps
# 5 % shorter, the others unchanged); online at 32 and 48 req/s the ITL and TPOT percentiles were
# unchanged within the runs' spread. (Over every unsplit launch, four chunks and a share of split_slots,
# the offline run had been 0.5 % slower: round 26.) Round 28, the reduce folded into the launch's last
# chunk: attention alone 0.89-0.96 of round 26's balanced times at 24-97 sequences (and no longer slower
# than the unsplit launch from 129 on, yet no shorter in the decode graphs there); decode graphs at
# sharegpt's lengths 0.98-0.99 of round 27's at 33-64 sequences; and at 24 sequences, where the launch
# would split in two, balanced took 0.968 of the even split's graph step (0.964-0.971 in two rounds).
BALANCED_MAX_PROGRAMS_PER_SLOT = 2.0


def balanced_decode(num_splits: int, programs_per_slot: float = 1.0) -> bool:
    """Whether a decode launch over a cache of the query's dtype (no window) runs balanced chunks
    (kernels/triton_attention.py, "Balanced decode") instead of one program a sequence and KV head
    (`num_splits` 1: the grid fills the GPU) or each context split evenly in `num_splits`; its grid has
    `programs_per_slot` programs a split slot. PAGEDSERVE_BALANCED_DECODE decides: unset or "rule" (the
    default) the launches that would not split up to BALANCED_MAX_PROGRAMS_PER_SLOT and those that would
    split in two, "0" never, "all" every one; another value is a ValueError naming these."""
    mode = os.environ.get(BALANCED_DECODE_ENV, "")
    if mode == "0":
        return False
    if mode in ("", "rule"):
        return num_splits == 2 or (num_splits == 1 and programs_per_slot <= BALANCED_MAX_PROGRAMS_PER_SLOT)
    if mode == "all":
        return True
    raise ValueError(f"{BALANCED_DECODE_ENV}={mode!r}: expected unset or 'rule' (the default: the "
                     f"launches that would not split, up to {BALANCED_MAX_PROGRAMS_PER_SLOT} programs a "
                     f"split slot, and those that would split in two), '0' (never) or 'all' (every decode "
                     f"launch)")


# ---- the K/V addresses of paged attention's block-aligned loop (triton_attention._attend_bulk) ----

KV_ADDRESSING_ENV = "PAGEDSERVE_KV_ADDRESSING"  # unset or "32": the rule; "64": round 31's form
# The rule (round 32): int32 element offsets where the layer's cache fits them (offsets_fit_int32), and a
# decode launch's partial last K/V tile through the same block-aligned loop, masked by position
# (BULK_TAIL), no head-dim mask at a power-of-two head_dim. "64": 64-bit offsets, the last tile through
# the masked _attend_tiles loop, head-dim masks: the form before it, kept for paired comparisons. sm_90
# compile of the one-warp decode tile (python -m kernels.sass): 392 against 532 instructions a
# 32-position tile, 515 against 869 for the last one (docs/benchmarks.md round 32).


def kv_addressing() -> str:
    """PAGEDSERVE_KV_ADDRESSING: "32" (unset or "32", the default) or "64"; another value is a ValueError
    naming these."""
    mode = os.environ.get(KV_ADDRESSING_ENV, "") or "32"
    if mode not in ("32", "64"):
        raise ValueError(f"{KV_ADDRESSING_ENV}={mode!r}: expected unset or '32' (the default: 32-bit K/V "
                         f"offsets where the cache fits them, a decode launch's last tile block-aligned) "
                         f"or '64' (64-bit offsets, the last tile masked: the form before round 32)")
    return mode


# ---- decode attention's programs, longest context first (triton_attention "Longest first") ----

DECODE_ORDER_ENV = "PAGEDSERVE_DECODE_ORDER"  # unset or "rule": the rule; "0": never; "all": every launch
# The rule: the decode launches that neither split nor run balanced, over a cache of the query's dtype
# without a window, take their sequences longest first; the engine sorts the lengths only for a step of
# more than BALANCED_MAX_PROGRAMS_PER_SLOT programs a split slot, below which the rule's launch is
# balanced or split. H200, llama3-8b's decode graphs at sharegpt's lengths (docs/benchmarks.md round
# 29): longest first on every launch against the sequences' own order, 129-338 sequences 3.5-5.4 %
# shorter steps in both rounds, 24-97 sequences 0.3-0.9 % longer (balanced chunks gain nothing from the
# order, and the sort costs its launches); the rule against "0", 97-257 sequences 1.3-5.9 % shorter
# (112-257 in every round), 48-64 unchanged; sharegpt-400 offline, A B B A, 12,799 / 12,780 out tok/s
# against 12,504 / 12,514 (+2.3 %).


def decode_order_mode() -> str:
    """PAGEDSERVE_DECODE_ORDER: "rule" (unset or "rule", the default), "0" or "all"; another value is a
    ValueError naming these."""
    mode = os.environ.get(DECODE_ORDER_ENV, "") or "rule"
    if mode not in ("rule", "0", "all"):
        raise ValueError(f"{DECODE_ORDER_ENV}={mode!r}: expected unset or 'rule' (the default: the decode "
                         f"launches that neither split nor run balanced take their sequences longest "
                         f"context first), '0' (every launch in the step's own order) or 'all' (every "
                         f"decode launch longest first)")
    return mode


def ordered_decode(split_or_balanced: bool, plain_cache: bool) -> bool:
    """Whether a decode launch that is given a decode_order takes it: under the rule, one that neither
    splits nor runs balanced (`split_or_balanced` False) over a cache of the query's dtype without a
    sliding window (`plain_cache`); every one on "all", none on "0"."""
    mode = decode_order_mode()
    return mode == "all" or (mode == "rule" and not split_or_balanced and plain_cache)


def needs_decode_order(
    num_seqs: int, num_kv_heads: int, device: torch.device, plain_cache: bool = True
) -> bool:
    """Whether a CUDA decode step of num_seqs sequences sorts their lengths (decode_order) for its
    attention launches: always on "all"; under the rule where its grid is over
    BALANCED_MAX_PROGRAMS_PER_SLOT programs a split slot (fewer: the rule's launch is split or
    balanced, and takes no order) and its cache is of the model's dtype (`plain_cache`; an FP8 cache's
    launches take no order under the rule); never on "0" or off CUDA."""
    mode = decode_order_mode()
    if device.type != "cuda" or mode == "0" or (mode == "rule" and not plain_cache):
        return False
    slots = _cuda_module("triton_attention").split_slots(device)
    return mode == "all" or num_seqs * num_kv_heads > BALANCED_MAX_PROGRAMS_PER_SLOT * slots


def decode_order(seq_lens: torch.Tensor) -> torch.Tensor:
    """int32 [B] on seq_lens' device: the sequences by descending seq_lens (ties in their own order), the
    order in which a decode launch hands its sequences to the GPU's SMs. Device ops only, so a CUDA
    graph that captures it sorts each replay's lengths; one per forward pass serves every layer."""
    return torch.argsort(seq_lens, descending=True, stable=True).to(torch.int32)


def check_launch_env() -> None:
    """Refuses (ValueError) a PAGEDSERVE_PDL_OFF, PAGEDSERVE_FUSED_ROTARY, PAGEDSERVE_BALANCED_DECODE,
    PAGEDSERVE_DECODE_ORDER or PAGEDSERVE_KV_ADDRESSING it does not know, so an executor says so at its
    start instead of at its first kernel launch."""
    check_pdl_env()
    fused_rotary(1)
    balanced_decode(1)
    decode_order_mode()
    kv_addressing()


def pdl_launch(on: bool) -> dict:
    """The launch keyword that goes with a kernel's PDL constexpr `on` (= pdl(device))."""
    return {"launch_pdl": True} if on else {}


def _cuda_module(name: str):
    return importlib.import_module(f"kernels.{name}")


def reshape_and_cache(
    key, value, key_cache, value_cache, slot_mapping, k_scale: float = 1.0, v_scale: float = 1.0
) -> None:
    """k_scale, v_scale: an FP8 cache stores K / k_scale and V / v_scale (1.0 for any other cache)."""
    args = (key, value, key_cache, value_cache, slot_mapping, k_scale, v_scale)
    if key_cache.is_cuda:
        return _cuda_module("triton_cache").reshape_and_cache(*args)
    return reference.reshape_and_cache(*args)


def paged_attention(
    query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
    sliding_window: int = 0, logit_softcap: float = 0.0, deterministic: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, fresh_kv: tuple[torch.Tensor, torch.Tensor] | None = None,
    prefill_tile_starts: torch.Tensor | None = None, decode_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """deterministic: batch-invariant rows (kernels/triton_attention.py); the CPU reference ignores it.
    k_scale, v_scale: the scales the (FP8) cache was written with. fresh_kv: (key, value) [T, KV, D] of
    this step's tokens, equal to what the cache holds for them and finite in every row: the CUDA kernel
    may read the prefill rows' keys from there (TMA tiles); the reference reads the cache.
    prefill_tile_starts: kernels.prefill_tile_starts(query_start_loc) on the query's device, when the
    caller has it (the Hopper prefill kernel's work list; computed on the device otherwise).
    decode_order: decode_order(seq_lens), the order a CUDA decode launch takes its sequences in (the
    output does not depend on it; the reference ignores it)."""
    args = (
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
        max_query_len, max_seq_len, scale, sliding_window, logit_softcap,
    )
    if query.is_cuda:
        return _cuda_module("triton_attention").paged_attention(
            *args, deterministic=deterministic, k_scale=k_scale, v_scale=v_scale, fresh_kv=fresh_kv,
            prefill_tile_starts=prefill_tile_starts, decode_order=decode_order,
        )
    return reference.paged_attention(*args, k_scale, v_scale)


def rotary_cache_attention(
    positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
    block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
    sliding_window: int = 0, logit_softcap: float = 0.0, deterministic: bool = False,
    k_scale: float = 1.0, v_scale: float = 1.0, decode_order: torch.Tensor | None = None,
) -> torch.Tensor:
    """rotary_and_cache, then paged_attention over the rotated query (the bits of the two one after
    the other); on CUDA a decode step (max_query_len 1, not deterministic) runs it as one launch
    (kernels/triton_attention.py rotary_cache_attention) where fused_rotary(num_seqs) says so.
    decode_order: as for paged_attention."""
    args = (
        positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
        block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale, sliding_window,
        logit_softcap,
    )
    if query.is_cuda:
        return _cuda_module("triton_attention").rotary_cache_attention(
            *args, deterministic=deterministic, k_scale=k_scale, v_scale=v_scale, decode_order=decode_order
        )
    return reference.rotary_cache_attention(*args, k_scale, v_scale)


def copy_blocks(kv_cache, block_mapping) -> None:
    if kv_cache.is_cuda:
        return _cuda_module("triton_cache").copy_blocks(kv_cache, block_mapping)
    return reference.copy_blocks(kv_cache, block_mapping)


def swap_blocks(src_cache, dst_cache, block_mapping) -> None:
    if src_cache.is_cuda or dst_cache.is_cuda:
        return _cuda_module("triton_cache").swap_blocks(src_cache, dst_cache, block_mapping)
    return reference.swap_blocks(src_cache, dst_cache, block_mapping)


def rms_norm(x, weight, eps, residual=None) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _cuda_module("triton_layers") if x.is_cuda else reference
    return impl.rms_norm(x, weight, eps, residual)


def rotary_embedding(positions, query, key, cos_cache, sin_cache) -> tuple[torch.Tensor, torch.Tensor]:
    impl = _cuda_module("triton_layers") if query.is_cuda else reference
    return impl.rotary_embedding(positions, query, key, cos_cache, sin_cache)


def rotary_and_cache(
    positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
    k_scale: float = 1.0, v_scale: float = 1.0, rotate_key_in_place: bool = False,
) -> torch.Tensor:
    """rotary_embedding of query and key, then reshape_and_cache of the rotated key and the value, in
    one launch on CUDA; returns the rotated query (the same bits as the two ops one after the other).
    rotate_key_in_place: the rotated keys also overwrite `key`, and padding tokens' (slot < 0) key and
    value rows are zeroed (for paged_attention's fresh_kv)."""
    impl = _cuda_module("triton_layers") if query.is_cuda else reference
    return impl.rotary_and_cache(
        positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
        k_scale, v_scale, rotate_key_in_place,
    )


def silu_and_mul(x) -> torch.Tensor:
    return (_cuda_module("triton_layers") if x.is_cuda else reference).silu_and_mul(x)


def greedy_sample(logits) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [S, V] -> (token ids [S] int64: each row's first argmax, their log-softmax [S] float32),
    in one read of the logits on CUDA (kernels/triton_sampling.py)."""
    return (_cuda_module("triton_sampling") if logits.is_cuda else reference).greedy_sample(logits)


@contextlib.contextmanager
def blas_library(name: str | None):
    """torch's matmuls inside run on cuBLASLt ("cublaslt") or cuBLAS ("cublas"); None leaves the
    setting as it is. The setting is process-wide: restored on the way out."""
    if name is None:
        yield
        return
    before = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(name)
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(before)


def cublaslt_algos(x, weight, bias=None, count: int | None = None, wide: int = 0) -> list[str]:
    """Up to `count` (kernels.cublaslt.MAX_ALGOS by default) of cuBLASLt's listed algorithms for
    x [M, K] @ weight [N, K].T (+ bias), best-ranked first, then up to `wide` of their variants (a
    wider search), as hex (kernels/cublaslt.py; CUDA only)."""
    return _cuda_module("cublaslt").listed(x, weight, bias, count, wide)


def cublaslt_linear(x, weight, bias, algo: str) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] through cuBLASLt with one of `cublaslt_algos`'s
    algorithms; ValueError if that algorithm does not fit the product."""
    return _cuda_module("cublaslt").linear(x, weight, bias, algo)


# ---- decode-batch GEMMs (kernels/triton_skinny.py): the weight streamed through TMA ----

SKINNY_MAX_ROWS = 64  # at more rows cuBLAS is as fast (docs/benchmarks.md "Decode GEMMs")
# The gated kernel (gate_up + SiLU-and-mul) also takes SKINNY_GATED_WIDE_ROWS, with a 128-row token tile
# three stages deep: H100, llama3-8b's gate_up, 96 / 112 / 128 rows 87.8 / 87.7 / 89.2 us against
# cuBLAS + silu_and_mul's 94.7 / 96.2 / 95.5 (docs/benchmarks.md, round 10); at 80 rows it was slower.
SKINNY_GATED_WIDE_ROWS = range(96, 129)
SKINNY_GATED_BLOCK_N = 64  # the gated kernel's tile of gate (and of up) rows
SKINNY_SMEM_MARGIN = 8 * 1024  # shared memory Triton adds to the pipeline's buffers (barriers, epilogue)


def skinny_usable(x: torch.Tensor, weight: torch.Tensor, gated: bool = False, split_k: bool = False) -> bool:
    """Whether the layers take skinny_linear (gated: skinny_gate_up_silu) for x [M, K] @ weight [N, K].T:
    a Hopper GPU (sm_9x; other GPUs with TMA keep cuBLAS until it is measured there), bf16 or fp16
    alike, 1 <= M <= SKINNY_MAX_ROWS (gated: or M in SKINNY_GATED_WIDE_ROWS), rows contiguous and
    16-byte aligned (gated: weight stored gate | up, each half whole SKINNY_GATED_BLOCK_N-row tiles),
    and the device's shared memory a block holds the pipeline's buffers. split_k: whether its split-K
    form (skinny_linear's split_k) takes the product: plain products whose K has two slices."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if torch.cuda.get_device_capability(x.device)[0] != 9:  # Hopper: measured and tested there only
        return False
    skinny = _cuda_module("triton_skinny")
    config = skinny.SPLIT_CONFIG if split_k else None
    if skinny.refusal(x, weight, gated, config) is not None:
        return False
    # its pipeline needs ~200 KB of shared memory a block (an H100 has 227)
    n = weight.shape[0] // 2 if gated else weight.shape[0]
    need = skinny.shared_memory_bytes(x.shape[0], n, x.shape[1], gated, x.element_size(), config)
    limit = getattr(torch.cuda.get_device_properties(x.device), "shared_memory_per_block_optin", 0)
    return need + SKINNY_SMEM_MARGIN <= limit


def skinny_linear(x, weight, bias=None, split_k: bool = False) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] where skinny_usable(x, weight, split_k=split_k).
    split_k: K in two slices a tile (triton_skinny.SPLIT_CONFIG; more programs where the weight has
    few tiles), summed in one order by the tile's last program: the same bits every run, not those
    without it."""
    skinny = _cuda_module("triton_skinny")
    return skinny.skinny_linear(x, weight, bias, config=skinny.SPLIT_CONFIG if split_k else None)


def skinny_gate_up_silu(x, weight) -> torch.Tensor:
    """silu_and_mul(x @ weight.T) [M, I] in one launch, weight [2I, K] stored gate | up, where
    skinny_usable(x, weight, gated=True); rounded as the two ops round."""
    return _cuda_module("triton_skinny").skinny_gate_up_silu(x, weight)


def fused_moe(
    hidden, w13, w2, router_logits, top_k, renormalize, deterministic: bool = False
) -> torch.Tensor:
    impl = _cuda_module("triton_moe") if hidden.is_cuda else reference
    return impl.fused_moe(hidden, w13, w2, router_logits, top_k, renormalize, deterministic)


# ---- deterministic mode (kernels/triton_batch_invariant.py): each row computed alike in any batch ----


def batch_invariant_matmul(x, weight, bias=None) -> torch.Tensor:
    impl = _cuda_module("triton_batch_invariant").matmul if x.is_cuda else reference.batch_invariant_matmul
    return impl(x, weight, bias)


def gemma_rms_norm(x, weight, eps) -> torch.Tensor:
    impl = _cuda_module("triton_batch_invariant") if x.is_cuda else reference
    return impl.gemma_rms_norm(x, weight, eps)


def layer_norm(x, weight, bias, eps) -> torch.Tensor:
    impl = _cuda_module("triton_batch_invariant") if x.is_cuda else reference
    return impl.layer_norm(x, weight, bias, eps)
