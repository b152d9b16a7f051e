"""Causal prefill attention over a step's own K/V on Hopper (sm_90), warp-specialized, in Gluon.

Triton's `tl` kernels (kernels/triton_attention.py `_fresh_prefill_kernel`) leave the tensor cores idle
while a program computes its softmax, and pay every tile's start-up (sequence lookup, Q load, first
K/V loads) with nothing to hide it: 0.73-0.82x SDPA at 16 x 512 and 4 x 2048 on the H100. This
kernel splits the work the way Hopper's asynchronous units allow (H100: 0.95-0.98x SDPA on those
shapes before the prefix support, 0.84-0.96x with its code compiled in; docs/benchmarks.md "Prefill"):

- a persistent grid (one program an SM) works through work items (a 128-row query tile x one query
  head; heads fastest, so a GQA group's heads share K/V in L2, and each sequence's last, longest
  tiles first). A program claims its next item from a global counter when it is ready for one
  (a relaxed atomic), so programs that drew light items take more: a fixed round-robin left the
  slowest program 6-15 % more work than the mean on the bench's shapes (4 x 2048: 296 -> 271 us);
- a producer warp claims the items, looks up their sequence, hands each valid one to the consumers
  through shared memory beside its Q tile (consumers never search or skip), and issues the TMA
  loads: the two 64-row halves of the item's Q tile (double-buffered across items, so the next
  item's Q arrives while this one finishes) and the K/V tiles into a ring of STAGES stages, each
  guarded by ready / empty mbarriers;
- two consumer warpgroups each own one 64-row half of the tile. Each issues tile j's scores
  (Q K_j^T) and tile j - 1's P V together as asynchronous wgmmas, rescales its accumulator while
  the score matmul runs and computes tile j's softmax while the P V runs; the upper half skips the
  K/V tiles wholly after its rows (with 64-key tiles, the default); with PINGPONG the two warpgroups
  take turns issuing (an mbarrier token passed back and forth), so one's softmax runs while the
  other's matmuls use the tensor cores.

Scope: query rows of sequences with >= 2 query tokens, bf16 / fp16, head_dim 64 or 128, GQA by a query
head's KV head = head // (H / KV). A sequence's keys are its cached prefix [0, seq_len - q_len) (with
the caches: the producer loads one TMA box per cache block through the block table; the prefix's last
tile is masked past its end and its value rows there zeroed in shared memory by the producer warp, since
other cache slots may hold NaN) and then its own rows of `key` / `value`. Rows of one-token sequences
are not written (the decode launch's). The programs draw only real work: items come from `tile_starts`
(kernels.prefill_tile_starts: the cumulative 128-row tiles of the sequences with prompts), so decode
rows and padding sequences cost nothing. As in fresh_prefill, tiles may read past a sequence's end (the
next sequence's rows, or TMA's zero fill past the tensor): those keys are masked by the causal test and
their values get weight 0, so they must be finite.

How we know it works: tests/gpu/test_gluon_prefill_gpu.py against a plain-torch reference (mixed
lengths, GQA, ragged tails, one-token rows left alone, cached prefixes with block sizes 8-64 and NaN
outside the sequences, a padded decode-heavy step, a CUDA graph); the figure it must reach:
>= 0.9x the fastest SDPA form on the prefill bench's causal shapes (python -m kernels.bench --only
prefill, docs/benchmarks.md "Prefill").
"""

from __future__ import annotations

import math

import torch

from kernels import PREFILL_TILE_ROWS, prefill_tile_starts

try:  # Gluon ships with Triton >= 3.5; without it (or without sm_90) callers use the tl kernels
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared,
        mbarrier,
        tma,
        warpgroup_mma,
        warpgroup_mma_wait,
    )
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    HAVE_GLUON = True
except ImportError:  # pragma: no cover - depends on the installed Triton
    HAVE_GLUON = False

_GL_DTYPES = {}
if HAVE_GLUON:
    _GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def supported(query: torch.Tensor, *kv: torch.Tensor) -> bool:
    """Whether this kernel can run these tensors here (query [T, H, D], then key and / or value
    [T, KV, D]): Hopper, bf16 / fp16, head_dim 64 or 128, rows contiguous in the last dimension and
    16-byte aligned (TMA)."""
    if not (HAVE_GLUON and query.is_cuda and torch.cuda.get_device_capability(query.device) == (9, 0)):
        return False
    if query.dtype not in _GL_DTYPES or query.shape[-1] not in (64, 128):
        return False
    if any(t.dtype != query.dtype or t.shape[0] != query.shape[0] or t.shape[2] != query.shape[2]
           for t in kv):
        return False
    elem = query.element_size()
    for t in (query, *kv):
        if t.stride(2) != 1 or t.stride(1) != t.shape[2] or (t.stride(0) * elem) % 16 or t.data_ptr() % 16:
            return False
    return True


if HAVE_GLUON:

    @gluon.jit
    def _work_item(query_start_loc_ptr, tile_starts_ptr, num_seqs, num_search_steps, num_tiles, num_heads, w,
                   BLOCK_M: gl.constexpr):
        """Work item w -> (seq, head, q_begin, q_len, q_start, valid). Items run heads fastest (the GQA
        group's heads share K/V in L2) and tiles from the last: tile t of sequence i is
        tile_starts[i] + q_start // BLOCK_M (kernels.prefill_tile_starts: only sequences of >= 2 query
        tokens have tiles), so a sequence's last (longest) tiles come first and no item is empty."""
        head = w % num_heads
        tile_id = num_tiles - 1 - w // num_heads
        lo = tile_id * 0
        hi = lo + num_seqs
        for _ in range(num_search_steps):  # largest i < num_seqs with tile_starts[i] <= tile_id
            mid = (lo + hi) // 2
            right = gl.load(tile_starts_ptr + mid) <= tile_id
            lo = gl.where(right, mid, lo)
            hi = gl.where(right, hi, mid)
        q_begin = gl.load(query_start_loc_ptr + lo)
        q_len = gl.load(query_start_loc_ptr + lo + 1) - q_begin
        q_start = (tile_id - gl.load(tile_starts_ptr + lo)) * BLOCK_M
        valid = (q_len >= 2) & (q_start < q_len)  # (false only for tile starts that do not match the queries)
        return lo, head, q_begin, q_len, q_start, valid

    @gluon.jit
    def _producer(q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                  k_ready, v_ready, kv_empty, v_fix, info, counter_ptr, query_start_loc_ptr, tile_starts_ptr,
                  seq_lens_ptr, block_tables_ptr, stride_bt, num_seqs, num_search_steps, num_heads,
                  GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                  STAGES: gl.constexpr, PREFIX: gl.constexpr, BLOCK_SIZE: gl.constexpr):
        """One warp: claims the work items, hands each valid one to the consumers (`info`, beside its
        Q tile) and issues the TMA loads of its Q halves, its cached prefix's K/V tiles (PREFIX: one
        box a cache block, through the block table) and its fresh K/V tiles; then an item of q_len 0."""
        HALF: gl.constexpr = BLOCK_M // 2
        BOXES: gl.constexpr = BLOCK_N // BLOCK_SIZE
        q_bytes: gl.constexpr = 2 * q_desc.block_type.nbytes
        k_bytes: gl.constexpr = k_desc.block_type.nbytes
        v_bytes: gl.constexpr = v_desc.block_type.nbytes
        q_count = 0
        kv_count = 0
        fixes = 0
        num_tiles = gl.load(tile_starts_ptr + num_seqs)
        num_items = num_tiles * num_heads
        # the next unclaimed item: programs free sooner take more. Relaxed: the index is all it hands
        # out (an acquiring atomic would also empty this SM's L1, and the lookups behind it would miss)
        w = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        while w < num_items:
            seq, head, q_begin, q_len, q_start, valid = _work_item(
                query_start_loc_ptr, tile_starts_ptr, num_seqs, num_search_steps, num_tiles, num_heads, w,
                BLOCK_M,
            )
            if valid:
                context_start = q_len * 0
                if PREFIX:
                    context_start = gl.load(seq_lens_ptr + seq) - q_len
                qb = q_count % 2
                mbarrier.wait(q_empty.index(qb), ((q_count // 2) & 1) ^ 1)
                _put_item(info.index(qb), head, q_begin, q_len, q_start, context_start)
                mbarrier.expect(q_ready.index(qb), q_bytes)
                row = q_begin + q_start
                tma.async_copy_global_to_shared(
                    q_desc, [row, head * D], q_ready.index(qb), q_smem.index(2 * qb)
                )
                tma.async_copy_global_to_shared(
                    q_desc, [row + HALF, head * D], q_ready.index(qb), q_smem.index(2 * qb + 1)
                )
                q_count += 1
                kv_col = (head // GROUP) * D
                if PREFIX:
                    # tiles of BLOCK_N cached positions, a box per cache block; a tile's blocks at or
                    # past the prefix's end load the prefix's last block instead (always a valid entry):
                    # those keys are masked and their value rows zeroed (below)
                    block_table = block_tables_ptr + seq.to(gl.int64) * stride_bt
                    last_block = (context_start - 1) // BLOCK_SIZE
                    for t in range(gl.cdiv(context_start, BLOCK_N)):
                        s = kv_count % STAGES
                        mbarrier.wait(kv_empty.index(s), ((kv_count // STAGES) & 1) ^ 1)
                        mbarrier.expect(k_ready.index(s), k_bytes)
                        # the prefix's last tile, if it runs past the prefix's end: its values land on
                        # v_fix, this warp zeroes the rows past the end, then signals v_ready itself
                        straddles = (t + 1) * BLOCK_N > context_start
                        if straddles:
                            mbarrier.expect(v_fix, v_bytes)
                        else:
                            mbarrier.expect(v_ready.index(s), v_bytes)
                        for i in gl.static_range(BOXES):
                            index = gl.minimum(t * BOXES + i, last_block)
                            block = gl.load(block_table + index)
                            tma.async_copy_global_to_shared(
                                kc_desc, [block * BLOCK_SIZE, kv_col], k_ready.index(s),
                                k_smem.index(s).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                            )
                            if straddles:
                                tma.async_copy_global_to_shared(
                                    vc_desc, [block * BLOCK_SIZE, kv_col], v_fix,
                                    v_smem.index(s).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                                )
                            else:
                                tma.async_copy_global_to_shared(
                                    vc_desc, [block * BLOCK_SIZE, kv_col], v_ready.index(s),
                                    v_smem.index(s).slice(i * BLOCK_SIZE, BLOCK_SIZE),
                                )
                        if straddles:
                            mbarrier.wait(v_fix, fixes & 1)
                            fixes += 1
                            _zero_past_prefix(v_smem.index(s), t * BLOCK_N, context_start, BLOCK_N, D)
                            mbarrier.arrive(v_ready.index(s), count=1)
                        kv_count += 1
                num_kv = gl.cdiv(gl.minimum(q_start + BLOCK_M, q_len), BLOCK_N)
                for j in range(num_kv):
                    s = kv_count % STAGES
                    mbarrier.wait(kv_empty.index(s), ((kv_count // STAGES) & 1) ^ 1)
                    mbarrier.expect(k_ready.index(s), k_bytes)
                    tma.async_copy_global_to_shared(
                        k_desc, [q_begin + j * BLOCK_N, kv_col], k_ready.index(s), k_smem.index(s)
                    )
                    mbarrier.expect(v_ready.index(s), v_bytes)
                    tma.async_copy_global_to_shared(
                        v_desc, [q_begin + j * BLOCK_N, kv_col], v_ready.index(s), v_smem.index(s)
                    )
                    kv_count += 1
            w = gl.atomic_add(counter_ptr, 1, sem="relaxed")
        # the end: an item of q_len 0
        qb = q_count % 2
        mbarrier.wait(q_empty.index(qb), ((q_count // 2) & 1) ^ 1)
        _put_item(info.index(qb), 0, 0, 0, 0, 0)
        mbarrier.arrive(q_ready.index(qb), count=1)
        # the last program to stop claiming zeroes the counters for the next launch (acquire-release:
        # every program's last claim is ordered before its count here, so before the reset)
        if gl.atomic_add(counter_ptr + 1, 1, sem="acq_rel") == gl.num_programs(0) - 1:
            gl.store(counter_ptr, 0)
            gl.store(counter_ptr + 1, 0)

    @gluon.jit
    def _put_item(slot, head, q_begin, q_len, q_start, context_start):
        """The producer's item for the consumers: (head, q_begin, q_len, q_start, context_start) into
        an int32[8] of shared memory, visible to them once the q_ready arrival that follows completes."""
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [1], [0])
        k = gl.arange(0, 8, layout=layout)
        item = gl.where(k == 0, head, gl.where(k == 1, q_begin, gl.where(k == 2, q_len, gl.where(
            k == 3, q_start, context_start))))
        slot.store(item)
        gl.thread_barrier()  # every lane's store before the arrival (which one lane makes)

    @gluon.jit
    def _get_item(slot):
        layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
        item = slot.load(layout)
        k = gl.arange(0, 8, layout=layout)
        head = gl.sum(gl.where(k == 0, item, 0), axis=0)
        q_begin = gl.sum(gl.where(k == 1, item, 0), axis=0)
        q_len = gl.sum(gl.where(k == 2, item, 0), axis=0)
        q_start = gl.sum(gl.where(k == 3, item, 0), axis=0)
        context_start = gl.sum(gl.where(k == 4, item, 0), axis=0)
        return head, q_begin, q_len, q_start, context_start

    @gluon.jit
    def _softmax_tile(s, m_i, l_i, t, num_prefix, context_start, row_pos, cols, first_row, scale_log2,
                      BLOCK_N: gl.constexpr):
        """Online-softmax step over score tile t (tiles [0, num_prefix) of the cached prefix, then the
        fresh ones): (p, new max, new sum, rescale factor). Prefix tiles mask positions at or past
        the prefix's end (the last one only); fresh tiles the causal diagonal."""
        if t < num_prefix:
            if (t + 1) * BLOCK_N > context_start:
                s = gl.where((t * BLOCK_N + cols)[None, :] < context_start, s, float("-inf"))
        else:
            j = t - num_prefix
            if j * BLOCK_N + BLOCK_N - 1 > first_row:  # a tile crossing the diagonal
                s = gl.where((j * BLOCK_N + cols)[None, :] <= row_pos[:, None], s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2)  # finite: key 0 is every row's
        p = gl.exp2(s * scale_log2 - m_new[:, None])
        alpha = gl.exp2(m_i - m_new)
        l_new = l_i * alpha + gl.sum(p, axis=1)
        return p, m_new, l_new, alpha

    @gluon.jit
    def _zero_past_prefix(v_tile, first_pos, context_start, BLOCK_N: gl.constexpr, D: gl.constexpr):
        """The prefix's last value tile (positions first_pos ..): rows at or past the prefix's end (other
        cache slots, which may hold anything, NaN included: 0 * NaN is NaN) set to zero by the producer
        warp, eight rows at a time, before the consumers are told the tile is ready."""
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
        rows = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
        for c in gl.static_range(BLOCK_N // 8):
            if first_pos + c * 8 + 7 >= context_start:
                chunk = v_tile.slice(c * 8, 8)
                v = chunk.load(layout)
                keep = (first_pos + c * 8 + rows < context_start)[:, None]
                chunk.store(gl.where(keep, v, gl.zeros_like(v)))
        fence_async_shared()  # these stores before the asynchronous proxy's (the wgmma's) reads

    @gluon.jit
    def _consumer(out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turn, info,
                  scale_log2, stride_o_tok, stride_o_head, WG: gl.constexpr, PINGPONG: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
        """One warpgroup: rows [64 WG, 64 WG + 64) of every item's query tile, over its cached prefix's
        tiles and then its fresh ones."""
        HALF: gl.constexpr = BLOCK_M // 2
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16]
        )
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, D, 16]
        )
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        out_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
        dtype: gl.constexpr = k_smem.dtype
        rows = gl.arange(0, HALF, layout=row_layout)
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        out_rows = gl.arange(0, HALF, layout=gl.SliceLayout(1, out_layout))
        out_dims = gl.arange(0, D, layout=gl.SliceLayout(0, out_layout))
        zero_s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
        q_count = 0
        kv_count = 0
        turns = 0
        mbarrier.wait(q_ready.index(0), 0)
        head, q_begin, q_len, q_start, context_start = _get_item(info.index(0))
        while q_len > 0:
            qb = q_count % 2
            q = q_smem.index(2 * qb + WG)
            first_row = q_start + WG * HALF
            row_pos = first_row + rows
            num_prefix = gl.cdiv(context_start, BLOCK_N)
            # the producer's tiles, and this half's (its fresh tiles up to its last row)
            num_loaded = num_prefix + gl.cdiv(gl.minimum(q_start + BLOCK_M, q_len), BLOCK_N)
            num_tiles = num_prefix + gl.cdiv(gl.minimum(first_row + HALF, q_len), BLOCK_N)
            m_i = gl.full([HALF], float("-inf"), gl.float32, row_layout)
            l_i = gl.zeros([HALF], gl.float32, row_layout)
            acc = gl.zeros([HALF, D], gl.float32, o_layout)

            # tile 0: scores only
            s = kv_count % STAGES
            mbarrier.wait(k_ready.index(s), (kv_count // STAGES) & 1)
            if PINGPONG:
                mbarrier.wait(turn.index(WG), (turns + 1 - WG) & 1)
            scores = warpgroup_mma(
                q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True
            )
            if PINGPONG:
                mbarrier.arrive(turn.index(1 - WG), count=1)
                turns += 1
            scores = warpgroup_mma_wait(0, deps=(scores,))
            p, m_i, l_i, alpha = _softmax_tile(
                scores, m_i, l_i, 0, num_prefix, context_start, row_pos, cols, first_row, scale_log2, BLOCK_N
            )
            p_op = gl.convert_layout(p.to(dtype), p_layout)
            alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
            prev = s
            prev_phase = (kv_count // STAGES) & 1
            kv_count += 1

            # tile t's scores and tile t - 1's P V in flight together; the accumulator's rescale
            # for tile t - 1 and P_t's conversion to bf16 done while a matmul runs (not between)
            for t in range(1, num_tiles):
                s = kv_count % STAGES
                mbarrier.wait(k_ready.index(s), (kv_count // STAGES) & 1)
                mbarrier.wait(v_ready.index(prev), prev_phase)
                if PINGPONG:
                    mbarrier.wait(turn.index(WG), (turns + 1 - WG) & 1)
                scores = warpgroup_mma(
                    q, k_smem.index(s).permute((1, 0)), zero_s, use_acc=False, is_async=True
                )
                acc = acc * alpha_o[:, None]
                acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
                if PINGPONG:
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                    turns += 1
                scores = warpgroup_mma_wait(1, deps=(scores,))
                p, m_i, l_i, alpha = _softmax_tile(
                    scores, m_i, l_i, t, num_prefix, context_start, row_pos, cols, first_row, scale_log2,
                    BLOCK_N,
                )
                p_next = gl.convert_layout(p.to(dtype), p_layout)
                alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
                acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
                mbarrier.arrive(kv_empty.index(prev), count=1)
                p_op = p_next
                prev = s
                prev_phase = (kv_count // STAGES) & 1
                kv_count += 1

            mbarrier.arrive(q_empty.index(qb), count=1)  # this item's score matmuls are done
            acc = acc * alpha_o[:, None]
            mbarrier.wait(v_ready.index(prev), prev_phase)
            acc = warpgroup_mma(p_op, v_smem.index(prev), acc, is_async=True)
            acc, p_op = warpgroup_mma_wait(0, deps=(acc, p_op))
            mbarrier.arrive(kv_empty.index(prev), count=1)
            # tiles wholly after this half's last row (the upper half's, BLOCK_N < BLOCK_M): released
            # once loaded, so that a stage's release counts one round at a time; turns kept in step
            for _ in range(num_tiles, num_loaded):
                s = kv_count % STAGES
                mbarrier.wait(v_ready.index(s), (kv_count // STAGES) & 1)
                if PINGPONG:
                    mbarrier.wait(turn.index(WG), (turns + 1 - WG) & 1)
                    mbarrier.arrive(turn.index(1 - WG), count=1)
                    turns += 1
                mbarrier.arrive(kv_empty.index(s), count=1)
                kv_count += 1

            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            o = gl.convert_layout((acc / l_o[:, None]).to(dtype), out_layout)
            tok = first_row + out_rows
            ptrs = (
                out_ptr
                + (q_begin + tok).to(gl.int64)[:, None] * stride_o_tok
                + head * stride_o_head
                + out_dims[None, :]
            )
            gl.store(ptrs, o, mask=(tok < q_len)[:, None])
            q_count += 1
            mbarrier.wait(q_ready.index(q_count % 2), (q_count // 2) & 1)
            head, q_begin, q_len, q_start, context_start = _get_item(info.index(q_count % 2))

    @gluon.jit
    def _gluon_fresh_prefill_kernel(
        out_ptr, q_desc, k_desc, v_desc, kc_desc, vc_desc, query_start_loc_ptr, tile_starts_ptr, seq_lens_ptr,
        block_tables_ptr, counter_ptr, scale_log2, stride_bt, num_seqs, num_search_steps,
        num_heads, stride_o_tok, stride_o_head,
        GROUP: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
        STAGES: gl.constexpr, PINGPONG: gl.constexpr, CONSUMER_REGS: gl.constexpr, PREFIX: gl.constexpr,
        BLOCK_SIZE: gl.constexpr,
    ):
        HALF: gl.constexpr = BLOCK_M // 2
        dtype: gl.constexpr = q_desc.dtype
        q_smem = gl.allocate_shared_memory(dtype, [4, HALF, D], q_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        q_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        kv_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        v_fix = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        info = gl.allocate_shared_memory(gl.int32, [2, 8], gl.SwizzledSharedLayout(1, 1, 1, [0]))
        for i in gl.static_range(2):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_empty.index(i), count=2)  # both consumer warpgroups release it
            mbarrier.init(turn.index(i), count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_ready.index(i), count=1)
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(kv_empty.index(i), count=2)
        mbarrier.init(v_fix, count=1)
        # (literal tuples: Gluon keeps their constexprs; a tuple built with + does not)
        gl.warp_specialize(
            [
                (_consumer, (
                    out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turn, info,
                    scale_log2, stride_o_tok, stride_o_head, 0, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )),
                (_consumer, (
                    out_ptr, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, v_ready, kv_empty, turn, info,
                    scale_log2, stride_o_tok, stride_o_head, 1, PINGPONG, BLOCK_M, BLOCK_N, D, STAGES,
                )),
                (_producer, (
                    q_desc, k_desc, v_desc, kc_desc, vc_desc, q_smem, k_smem, v_smem, q_ready, q_empty,
                    k_ready, v_ready, kv_empty, v_fix, info, counter_ptr, query_start_loc_ptr,
                    tile_starts_ptr, seq_lens_ptr, block_tables_ptr, stride_bt, num_seqs, num_search_steps,
                    num_heads, GROUP, BLOCK_M, BLOCK_N, D, STAGES, PREFIX, BLOCK_SIZE,
                )),
            ],
            [4, 1],
            [CONSUMER_REGS, 56],  # (the producer zeroes a prefix's last value rows: 8 x D a step)
        )


# per (device, stream): [next unclaimed item, programs done claiming], zero between launches (the
# kernel's last program resets them). Launches sharing a counter must not overlap in time: one
# stream's launches run in order (a CUDA graph keeps the counter of the stream it was captured on,
# and must not be replayed beside another launch on that stream's counter).
_CLAIM_COUNTERS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _claim_counter(device: torch.device) -> torch.Tensor:
    key = (device, torch.cuda.current_stream(device).cuda_stream)
    counter = _CLAIM_COUNTERS.get(key)
    if counter is None:
        counter = _CLAIM_COUNTERS[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter


def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def gluon_fresh_prefill(
    out: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
    query_start_loc: torch.Tensor, scale: float, *, key_cache: torch.Tensor | None = None,
    value_cache: torch.Tensor | None = None, block_tables: torch.Tensor | None = None,
    seq_lens: torch.Tensor | None = None, tile_starts: torch.Tensor | None = None, block_n: int = 64,
    stages: int = 4, pingpong: bool = True, consumer_regs: int = 240, num_programs: int | None = None,
) -> None:
    """out[rows of sequences with >= 2 query tokens] = causal attention of those rows over their
    sequence's keys: the cached prefix [0, seq_len - q_len) from key_cache / value_cache through
    block_tables (when given; else no sequence has one), then its own rows of key / value ([T, KV,
    D] views, e.g. of the QKV projection's output). query [T, H, D], out [T, H, D] (last dim
    contiguous), query_start_loc [num_seqs + 1] and seq_lens [num_seqs] int32 on the device, the
    caches [num_blocks, block_size, KV, D] in the query's dtype with block_size 8, 16, 32 or 64.
    tile_starts: kernels.prefill_tile_starts(query_start_loc) (int32 [num_seqs + 1] on the device),
    the work list: callers that build their metadata on the host pass it (the engine's
    AttentionMetadata.prefill_tile_starts); without it three small device ops compute it. Tile starts
    that do not match query_start_loc leave rows unwritten.
    block_n: keys a K/V tile (64, or 128 with two stages: more exceed shared memory); stages: the
    K/V ring's depth; pingpong: the consumer warpgroups take turns issuing their matmuls;
    consumer_regs: their register budget (setmaxnreg); num_programs: the persistent grid (default one
    program an SM). The defaults are the H100's fastest on the prefill bench (docs/benchmarks.md).
    Launches on one stream share a work-claiming counter (so a graph replayed beside another launch
    of the stream it was captured on is not supported)."""
    if not supported(query, key, value):
        raise ValueError("gluon_fresh_prefill: needs sm_90, bf16/fp16, head_dim 64/128, TMA-aligned rows")
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[1]
    if block_n not in (64, 128) or not 2 <= stages <= (4 if block_n == 64 else 2):
        raise ValueError(f"gluon_fresh_prefill: block_n 64 (2-4 stages) or 128 (2 stages; more exceed "
                         f"shared memory), got block_n={block_n}, stages={stages}")
    if consumer_regs % 8 or not 24 <= consumer_regs <= 256 or (num_programs is not None and num_programs < 1):
        raise ValueError(f"gluon_fresh_prefill: consumer_regs a multiple of 8 in [24, 256] (setmaxnreg), "
                         f"num_programs >= 1; got {consumer_regs}, {num_programs}")
    if (num_heads % num_kv_heads or out.shape != query.shape or out.dtype != query.dtype
            or out.stride(2) != 1):
        raise ValueError("gluon_fresh_prefill: heads must be a multiple of KV heads; out shaped like query")
    starts = query_start_loc
    if starts.dtype != torch.int32 or starts.dim() != 1 or not len(starts) or starts.device != query.device:
        raise ValueError("gluon_fresh_prefill: query_start_loc must be 1-d int32 on the query's device")
    num_seqs = query_start_loc.shape[0] - 1
    if tile_starts is None:
        tile_starts = prefill_tile_starts(query_start_loc)
    elif (tile_starts.dtype != torch.int32 or tile_starts.dim() != 1 or tile_starts.shape[0] != num_seqs + 1
            or tile_starts.device != query.device):
        raise ValueError(f"gluon_fresh_prefill: tile_starts must be int32 [{num_seqs + 1}] on the query's "
                         f"device (kernels.prefill_tile_starts), got {tile_starts.dtype} "
                         f"{tuple(tile_starts.shape)} on {tile_starts.device}")
    prefix = key_cache is not None
    if prefix:
        _check_cache(query, key_cache, value_cache, block_tables, seq_lens, num_seqs, block_n)
    if num_tokens == 0 or num_seqs == 0:
        return
    block_m = PREFILL_TILE_ROWS
    half = block_m // 2
    dtype = _GL_DTYPES[query.dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([half, head_dim], dtype)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], dtype)

    def descriptor(t: torch.Tensor, rows: int) -> TensorDescriptor:  # [len(t), heads * D], [rows, D] boxes
        shape = [t.shape[0], t.shape[1] * head_dim]
        layout = q_layout if t is query else kv_layout
        return TensorDescriptor(t, shape, [t.stride(0), 1], [rows, head_dim], layout)

    q_desc = descriptor(query, half)
    k_desc = descriptor(key, block_n)
    v_desc = descriptor(value, block_n)
    if prefix:  # the caches as [num_blocks * block_size, KV * D], a box a block
        block_size = key_cache.shape[1]
        kc_desc = descriptor(key_cache.view(-1, num_kv_heads, head_dim), block_size)
        vc_desc = descriptor(value_cache.view(-1, num_kv_heads, head_dim), block_size)
    else:  # (unused: compiled out)
        block_size, kc_desc, vc_desc, block_tables, seq_lens = block_n, k_desc, v_desc, starts, starts
    max_tiles = num_tokens // block_m + num_seqs  # >= the sum of ceil(q_len / block_m)
    programs = num_programs or _sm_count(query.device)
    _gluon_fresh_prefill_kernel[(max(1, min(programs, max_tiles * num_heads)),)](
        out, q_desc, k_desc, v_desc, kc_desc, vc_desc, query_start_loc, tile_starts, seq_lens,
        block_tables, _claim_counter(query.device), scale * math.log2(math.e),
        block_tables.stride(0) if prefix else 0, num_seqs, max(0, (num_seqs - 1).bit_length()), num_heads,
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads, BLOCK_M=block_m, BLOCK_N=block_n, D=head_dim, STAGES=stages,
        PINGPONG=pingpong, CONSUMER_REGS=consumer_regs, PREFIX=prefix, BLOCK_SIZE=block_size, num_warps=4,
    )


def cache_supported(key_cache: torch.Tensor, block_n: int = 64) -> bool:
    """Whether the kernel can read a cached prefix from this cache (its block size a TMA box's rows)."""
    size = key_cache.shape[1] if key_cache.dim() == 4 else 0
    return size in (8, 16, 32, 64) and block_n % size == 0


def _check_cache(query, key_cache, value_cache, block_tables, seq_lens, num_seqs, block_n) -> None:
    """ValueError unless the cached prefix's inputs are what the kernel reads."""
    if value_cache is None or block_tables is None or seq_lens is None:
        raise ValueError("gluon_fresh_prefill: key_cache needs value_cache, block_tables and seq_lens")
    num_kv = key_cache.shape[2] if key_cache.dim() == 4 else -1
    for cache in (key_cache, value_cache):
        if (cache.dim() != 4 or cache.shape != key_cache.shape or cache.dtype != query.dtype
                or not cache.is_contiguous() or cache.shape[3] != query.shape[2] or cache.data_ptr() % 16
                or cache.device != query.device):
            raise ValueError("gluon_fresh_prefill: the caches must be contiguous [num_blocks, block_size, "
                             "KV, D] tensors in the query's dtype, on its device")
    if key_cache.shape[1] not in (8, 16, 32, 64) or block_n % key_cache.shape[1] or num_kv < 1:
        raise ValueError(f"gluon_fresh_prefill: block_size must be 8, 16, 32 or 64 and divide block_n "
                         f"({block_n}), got {key_cache.shape[1]}")
    if (block_tables.dtype != torch.int32 or block_tables.dim() != 2 or block_tables.stride(1) != 1
            or block_tables.shape[0] < num_seqs or seq_lens.dtype != torch.int32 or seq_lens.dim() != 1
            or seq_lens.shape[0] < num_seqs):
        raise ValueError("gluon_fresh_prefill: block_tables [num_seqs, max_blocks] and seq_lens [num_seqs] "
                         "must be int32, the block table's rows contiguous")
