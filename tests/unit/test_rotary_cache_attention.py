"""rotary_cache_attention (a decode step's rotary, K/V cache write and attention in one launch) against
what it replaces, rotary_and_cache then paged_attention, bit for bit: the Triton kernels under the Triton
interpreter (split and unsplit launches, GQA and MHA, a padded head_dim, a sliding window and a softcap,
an FP8 cache, a CUDA graph's padding tokens and sequences), the CPU dispatch, and the launches that keep
the two ops (prompts, deterministic mode, PAGEDSERVE_FUSED_ROTARY=0).

Bit for bit: equal integer views of the output rows that belong to a sequence and of the whole cache.
Module setup as in tests/unit/test_kernels_triton.py.
"""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from kernels import reference, triton_attention, triton_cache, triton_layers  # noqa: E402
from kernels.testing import relative_error, scattered_block_tables  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_cache = importlib.reload(triton_cache)
    triton_layers = importlib.reload(triton_layers)
    triton_attention = importlib.reload(triton_attention)

patch_interpreter_for_numpy()

E4M3 = torch.float8_e4m3fn
MAX_POSITION = 256


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    differ = int((bits(got) != bits(want)).sum())
    assert differ == 0, f"{what}: {differ} of {got.numel()} elements differ"


def decode_case(seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, cache_dtype, seed,
                num_padding_tokens=0, num_padding_seqs=0):
    """A decode step as the engine runs it: q, k, v strided views of one QKV output [T, (H + 2 KV) D]
    (unrotated), the token of sequence i at row i, its position seq_len - 1 and its slot that position's
    place in the block table; caches of random data. Padding as a CUDA graph pads: tokens past the last
    sequence (slot -1, position 0) and sequences of no query token (seq_len 0)."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs, num_tokens = len(seq_lens), len(seq_lens) + num_padding_tokens
    num_blocks = sum(-(-n // block_size) for n in seq_lens) + 3
    tables = scattered_block_tables(seq_lens, block_size, num_blocks, gen)  # [B, M] int32
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(num_tokens, width, generator=gen).to(dtype)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    positions = torch.zeros(num_tokens, dtype=torch.int64)
    slots = torch.full((num_tokens,), -1, dtype=torch.int64)
    for i, n in enumerate(seq_lens):
        positions[i] = n - 1
        slots[i] = int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
    inv_freq = torch.rand(head_dim // 2, generator=gen)
    freqs = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).clamp(-448, 448).to(cache_dtype) for _ in range(2)]
    pad_tables = torch.zeros(num_padding_seqs, tables.shape[1], dtype=torch.int32)
    return dict(
        positions=positions, query=q.view(num_tokens, num_heads, head_dim),
        key=k.view(num_tokens, num_kv_heads, head_dim), value=v.view(num_tokens, num_kv_heads, head_dim),
        caches=caches, slot_mapping=slots, cos_cache=freqs.cos(), sin_cache=freqs.sin(),
        block_tables=torch.cat([tables, pad_tables]),
        seq_lens=torch.tensor(list(seq_lens) + [0] * num_padding_seqs, dtype=torch.int32),
        query_start_loc=torch.tensor(list(range(num_seqs + 1)) + [num_seqs] * num_padding_seqs,
                                     dtype=torch.int32),
        max_seq_len=max(seq_lens), scale=head_dim**-0.5, num_seqs=num_seqs,
    )


def fused(case, impl=triton_attention, max_query_len=1, **kwargs):
    caches = [c.clone() for c in case["caches"]]
    out = impl.rotary_cache_attention(
        case["positions"], case["query"], case["key"], case["value"], *caches, case["slot_mapping"],
        case["cos_cache"], case["sin_cache"], case["block_tables"], case["seq_lens"], case["query_start_loc"],
        max_query_len, case["max_seq_len"], case["scale"], **kwargs,
    )
    return out, caches


def fused_launch(case, k_scale=1.0, v_scale=1.0, **kwargs):
    """paged_attention's rotating decode launch itself, whatever rotary_cache_attention's rule says."""
    caches = [c.clone() for c in case["caches"]]
    rotary = triton_attention.DecodeRotary(
        case["positions"], case["key"], case["value"], case["slot_mapping"], case["cos_cache"],
        case["sin_cache"], k_scale, v_scale,
    )
    out = triton_attention.paged_attention(
        case["query"], *caches, case["block_tables"], case["seq_lens"], case["query_start_loc"], 1,
        case["max_seq_len"], case["scale"], rotary=rotary, k_scale=k_scale, v_scale=v_scale, **kwargs,
    )
    return out, caches


def unfused(case, sliding_window=0, logit_softcap=0.0, k_scale=1.0, v_scale=1.0, **kwargs):
    """The launches the engine ran before: rotary_and_cache, then paged_attention (Triton)."""
    caches = [c.clone() for c in case["caches"]]
    q = triton_layers.rotary_and_cache(
        case["positions"], case["query"], case["key"], case["value"], *caches, case["slot_mapping"],
        case["cos_cache"], case["sin_cache"], k_scale, v_scale,
    )
    out = triton_attention.paged_attention(
        q, *caches, case["block_tables"], case["seq_lens"], case["query_start_loc"], 1, case["max_seq_len"],
        case["scale"], sliding_window, logit_softcap, k_scale=k_scale, v_scale=v_scale, **kwargs,
    )
    return out, caches


def assert_same_step(got, want, case):
    (out, caches), (out_want, caches_want) = got, want
    rows = case["num_seqs"]  # padding tokens' rows are never written (cuda_graphs' layout)
    assert_same_bits(out[:rows], out_want[:rows], "attention output")
    for name, cache, cache_want in zip(("key cache", "value cache"), caches, caches_want, strict=True):
        assert_same_bits(cache, cache_want, name)


def record_launches(monkeypatch):
    launches = []
    real = triton_attention._paged_attention_kernel

    class Recorder:
        def __getitem__(self, grid):
            def call(*args, **kwargs):
                launches.append((grid, kwargs["ROTARY"]))
                return real[grid](*args, **kwargs)

            return call

    monkeypatch.setattr(triton_attention, "_paged_attention_kernel", Recorder())
    return launches


def count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, wrapper)
    return calls


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim", "block_size"),
    [(8, 2, 32, 16), (4, 4, 16, 8), (4, 2, 24, 16)],  # GQA; MHA; head_dim 24 padded to 32 (a masked tail)
)
@pytest.mark.parametrize("num_splits", [None, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_decode_is_bit_identical_to_rotary_and_cache_then_attention(
    monkeypatch, num_heads, num_kv_heads, head_dim, block_size, num_splits, dtype
):
    """Lengths of one position, block multiples and several K/V tiles; split launches put a sequence's
    own position in its last partition (the one that writes K/V), unsplit ones in the only one."""
    case = decode_case([1, 17, 16, 70, 33], num_heads, num_kv_heads, head_dim, block_size, dtype, dtype,
                       seed=head_dim + num_heads + (num_splits or 0))
    launches = record_launches(monkeypatch)
    extra = {} if num_splits is None else {"num_splits": num_splits}
    # a forced split count goes through paged_attention's keyword, as a sweep would force it
    got = fused(case) if num_splits is None else fused_launch(case, **extra)
    assert [fused_launch for _, fused_launch in launches] == [True]  # one attention launch, fused
    assert_same_step(got, unfused(case, **extra), case)
    # and it did what the reference does: the cache holds the rotated keys (bf16 within a few ulps: the
    # interpreter's float32 -> bf16 casts do not round to nearest), the output is attention (float32
    # only: the interpreter's bf16 dots are not the GPU's; tests/gpu compares the compiled kernels)
    ref = fused(case, impl=reference)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for cache, cache_ref in zip(got[1], ref[1], strict=True):
        assert relative_error(cache, cache_ref) < tol
    if dtype == torch.float32:
        assert relative_error(got[0][: case["num_seqs"]], ref[0][: case["num_seqs"]]) < 1e-5


@pytest.mark.parametrize(("window", "softcap"), [(5, 0.0), (0, 30.0), (20, 5.0)])
def test_rotating_launch_with_a_window_and_a_softcap(monkeypatch, window, softcap):
    """The kernel's rotating decode launch takes a window and a softcap; rotary_cache_attention keeps
    two launches for them (not yet compiled on a GPU with both: kernels.fused_rotary)."""
    case = decode_case([3, 40, 25], 4, 2, 16, 8, torch.float32, torch.float32, seed=window + int(softcap))
    want = unfused(case, sliding_window=window, logit_softcap=softcap)
    assert_same_step(fused_launch(case, sliding_window=window, logit_softcap=softcap), want, case)
    launches = record_launches(monkeypatch)
    assert_same_step(fused(case, sliding_window=window, logit_softcap=softcap), want, case)
    assert [rotates for _, rotates in launches] == [False]
    monkeypatch.setenv(kernels.FUSED_ROTARY_ENV, "all")  # not even with every size fused
    fused(case, sliding_window=window, logit_softcap=softcap)
    assert [rotates for _, rotates in launches] == [False, False]


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (2.0**-3, 4.0), (0.3, 0.07)])
def test_fused_decode_over_an_fp8_cache(k_scale, v_scale):
    """The step's K/V quantized on the way in as reshape_and_cache does, and read back as e4m3 with the
    rest; bf16 queries (the dots in f16, as the decode launch runs them)."""
    case = decode_case([9, 48, 17], 8, 2, 32, 16, torch.bfloat16, E4M3, seed=7)
    case["key"].mul_(30.0), case["value"].mul_(30.0)
    got = fused(case, k_scale=k_scale, v_scale=v_scale)
    assert_same_step(got, unfused(case, k_scale=k_scale, v_scale=v_scale), case)


def test_graph_padding_writes_nothing_and_reads_nothing():
    """Orphan tokens (slot -1) and empty sequences (seq_len 0) as a CUDA graph's bucket pads a step:
    the cache changes at the real tokens' slots only."""
    case = decode_case([5, 30], 4, 2, 16, 8, torch.float32, torch.float32, seed=3,
                       num_padding_tokens=3, num_padding_seqs=3)
    got = fused(case)
    assert_same_step(got, unfused(case), case)
    changed = (got[1][0] != case["caches"][0]).flatten(0, 1).flatten(1).any(dim=1)  # [num_slots]
    real = case["slot_mapping"][case["slot_mapping"] >= 0]
    assert changed[real].all() and int(changed.sum()) == real.numel()


@pytest.mark.parametrize("kwargs", [{}, {"num_splits": 3}, {"balance_programs": 3, "balance_chunks": 4}])
def test_longest_first_order_is_the_same_step(kwargs, monkeypatch):
    """The rotating launch in decode_order (longest first), with a CUDA graph's padding sequences
    sorted last: the same output and cache bits as in the sequences' own order, unsplit (the program
    of a sequence's own position writes its K/V), split, and balanced (the last chunk writes it; these
    two take the order on PAGEDSERVE_DECODE_ORDER=all only)."""
    monkeypatch.setenv(kernels.DECODE_ORDER_ENV, "all")
    case = decode_case([5, 250, 30, 71], 4, 2, 16, 8, torch.float32, torch.float32, seed=11,
                       num_padding_tokens=2, num_padding_seqs=2)
    order = kernels.decode_order(case["seq_lens"])
    assert order.tolist() == [1, 3, 2, 0, 4, 5]
    got = fused_launch(case, decode_order=order, **kwargs)
    assert_same_step(got, fused_launch(case, **kwargs), case)
    forced = {k: v for k, v in kwargs.items() if k == "num_splits"}  # (balanced: its own plan)
    if not kwargs.keys() - forced.keys():
        assert_same_step(got, unfused(case, **forced), case)


def test_cpu_dispatch_is_the_reference_composition():
    case = decode_case([4, 19], 4, 2, 16, 8, torch.bfloat16, torch.bfloat16, seed=5)
    got = fused(case, impl=kernels)
    caches = [c.clone() for c in case["caches"]]
    q = reference.rotary_and_cache(
        case["positions"], case["query"], case["key"], case["value"], *caches, case["slot_mapping"],
        case["cos_cache"], case["sin_cache"],
    )
    out = reference.paged_attention(
        q, *caches, case["block_tables"], case["seq_lens"], case["query_start_loc"], 1, case["max_seq_len"],
        case["scale"],
    )
    assert_same_step(got, (out, caches), case)


def test_launches_that_keep_two_ops(monkeypatch):
    """Deterministic mode (decode rows in the varlen tile), a step with prompts and
    PAGEDSERVE_FUSED_ROTARY=0 run rotary_and_cache and then an attention launch that does not rotate."""
    case = decode_case([6, 21], 4, 2, 16, 8, torch.float32, torch.float32, seed=9)
    launches = record_launches(monkeypatch)
    rotary_calls = count_calls(monkeypatch, triton_layers, "rotary_and_cache")
    got = fused(case, deterministic=True)
    assert_same_step(got, unfused(case, deterministic=True), case)
    monkeypatch.setenv(kernels.FUSED_ROTARY_ENV, "0")
    assert_same_step(fused(case), unfused(case), case)
    assert not any(rotates for _, rotates in launches)
    assert len(rotary_calls) == 4  # each fused() and each unfused() above
    with pytest.raises(ValueError, match="decode launch only"):
        triton_attention.paged_attention(
            case["query"], *case["caches"], case["block_tables"], case["seq_lens"], case["query_start_loc"],
            2, case["max_seq_len"], case["scale"],
            rotary=triton_attention.DecodeRotary(case["positions"], case["key"], case["value"],
                                                 case["slot_mapping"], case["cos_cache"], case["sin_cache"]),
        )


def test_the_rule_fuses_small_decode_launches_only(monkeypatch):
    """kernels.fused_rotary: up to FUSED_ROTARY_MAX_SEQS sequences by default (a graph bucket's padded
    count), every decode launch with 'all', none with '0'; an unknown value is refused, also by the
    check an executor runs at its start."""
    monkeypatch.delenv(kernels.FUSED_ROTARY_ENV, raising=False)
    limit = kernels.FUSED_ROTARY_MAX_SEQS
    assert kernels.fused_rotary(1) and kernels.fused_rotary(limit) and not kernels.fused_rotary(limit + 1)
    monkeypatch.setattr(kernels, "FUSED_ROTARY_MAX_SEQS", 2)
    launches = record_launches(monkeypatch)
    case = decode_case([6, 21, 9], 4, 2, 16, 8, torch.float32, torch.float32, seed=2)
    assert_same_step(fused(case), unfused(case), case)  # 3 sequences > 2: two launches
    monkeypatch.setenv(kernels.FUSED_ROTARY_ENV, "all")
    assert_same_step(fused(case), unfused(case), case)
    assert [rotates for _, rotates in launches] == [False, False, True, False]  # fused, unfused, twice
    kernels.check_launch_env()
    monkeypatch.setenv(kernels.FUSED_ROTARY_ENV, "yes")
    with pytest.raises(ValueError, match="PAGEDSERVE_FUSED_ROTARY='yes': expected unset"):
        kernels.check_launch_env()
    with pytest.raises(ValueError, match="'0' \\(never\\) or 'all'"):
        fused(case)


def test_careless_arguments_are_refused():
    case = decode_case([6, 21], 4, 2, 16, 8, torch.float32, torch.float32, seed=9)
    with pytest.raises(ValueError, match="not scaled"):
        fused(case, k_scale=0.5)  # scales are for an FP8 cache only
    short = dict(case, key=case["key"][:1], value=case["value"][:1])
    with pytest.raises(ValueError, match="rotary key and value"):
        fused(short)
    with pytest.raises(ValueError, match="positions and slot_mapping"):
        fused(dict(case, positions=case["positions"][:1]))
