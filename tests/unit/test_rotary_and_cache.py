"""rotary_and_cache (one launch: rotary of q and k, the K/V cache write) against what it replaces,
rotary_embedding then reshape_and_cache, bit for bit: the Triton kernels under the Triton interpreter,
the CPU dispatch, and tiny models whose attention layers take the fused path.

Bit for bit means the integer views are equal (torch.equal on floats calls -0.0 and 0.0 equal). The
FP8 cases compare the fused kernel with the unfused Triton kernels only: the interpreter's float32 ->
e4m3 cast does not round to nearest (tests/unit/test_fp8_kv_triton.py), the same cast in both, so they
must still agree; tests/gpu/test_rotary_and_cache_gpu.py compares the compiled kernels. Module setup
as in tests/unit/test_kernels_triton.py.
"""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from executor_svc.layers.attention import AttentionMetadata, PagedAttention  # noqa: E402
from executor_svc.models.config import ModelConfig  # noqa: E402
from executor_svc.models.loader import load_model  # noqa: E402
from executor_svc.runner.kv_calibration import attention_layers  # noqa: E402
from kernels import reference, triton_cache, triton_layers  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_layers._rotary_and_cache_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_cache = importlib.reload(triton_cache)
    triton_layers = importlib.reload(triton_layers)

patch_interpreter_for_numpy()

E4M3 = torch.float8_e4m3fn
NUM_BLOCKS, BLOCK_SIZE, MAX_POSITION = 6, 4, 64


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(bits(got), bits(want))


def make_case(num_tokens, num_heads, num_kv_heads, head_dim, dtype, cache_dtype, magnitude=1.0, seed=0):
    """q, k, v as strided views of one QKV projection output [T, (H + 2 KV) * D]; random positions;
    slots scattered over the cache with every third token a padding row (-1); caches of random data
    (a write that lands in the wrong place changes them)."""
    gen = torch.Generator().manual_seed(seed)
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = (torch.randn(num_tokens, width, generator=gen) * magnitude).to(dtype)  # [T, (H + 2 KV) * D]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.view(num_tokens, num_heads, head_dim)  # [T, H, D], views: no copies
    k = k.view(num_tokens, num_kv_heads, head_dim)  # [T, KV, D]
    v = v.view(num_tokens, num_kv_heads, head_dim)  # [T, KV, D]
    inv_freq = torch.rand(head_dim // 2, generator=gen)  # [D / 2]
    freqs = torch.arange(MAX_POSITION, dtype=torch.float32)[:, None] * inv_freq
    cos, sin = freqs.cos(), freqs.sin()  # [P, D / 2] float32, as RotaryEmbedding keeps them
    positions = torch.randint(0, MAX_POSITION, (num_tokens,), generator=gen)  # [T] int64
    slots = torch.randperm(NUM_BLOCKS * BLOCK_SIZE, generator=gen)[:num_tokens]  # [T] int64
    slots[::3] = -1
    shape = (NUM_BLOCKS, BLOCK_SIZE, num_kv_heads, head_dim)
    caches = [torch.randn(shape, generator=gen).clamp(-448, 448).to(cache_dtype) for _ in range(2)]
    return dict(positions=positions, q=q, k=k, v=v, caches=caches, slots=slots, cos=cos, sin=sin)


def run_fused(case, impl, k_scale=1.0, v_scale=1.0):
    caches = [c.clone() for c in case["caches"]]
    q_out = impl.rotary_and_cache(
        case["positions"], case["q"], case["k"], case["v"], *caches, case["slots"], case["cos"], case["sin"],
        k_scale, v_scale,
    )
    return q_out, caches


def run_unfused(case, rotary, cache_write, k_scale=1.0, v_scale=1.0):
    caches = [c.clone() for c in case["caches"]]
    q_out, k_out = rotary(case["positions"], case["q"], case["k"], case["cos"], case["sin"])
    cache_write(k_out, case["v"], *caches, case["slots"], k_scale, v_scale)
    return q_out, caches


def test_kernel_is_interpreted():
    assert type(triton_layers._rotary_and_cache_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"),
    [
        (4, 2, 64),  # GQA
        (4, 4, 64),  # MHA
        (4, 2, 80),  # head_dim / 2 = 40: a masked tail in each half
        (12, 4, 128),  # 8 heads a program: two query programs a token, the second part empty
    ],
)
def test_triton_fused_is_bit_identical_to_rotary_then_reshape_and_cache(
    dtype, num_heads, num_kv_heads, head_dim
):
    case = make_case(7, num_heads, num_kv_heads, head_dim, dtype, dtype, seed=head_dim + num_heads)
    q_out, caches = run_fused(case, triton_layers)
    q_want, caches_want = run_unfused(case, triton_layers.rotary_embedding, triton_cache.reshape_and_cache)
    assert_same_bits(q_out, q_want)
    for got, want in zip(caches, caches_want, strict=True):
        assert_same_bits(got, want)
    assert not torch.equal(q_out, case["q"])  # rotated
    # padding rows leave the cache alone: only the real rows' slots changed
    real = case["slots"][case["slots"] >= 0]
    changed = (caches[0] != case["caches"][0]).flatten(0, 1).flatten(1).any(dim=1)  # [num_slots]
    untouched = torch.ones(NUM_BLOCKS * BLOCK_SIZE, dtype=torch.bool)
    untouched[real] = False
    assert not changed[untouched].any() and changed[real].all()
    assert torch.equal(caches[1].flatten(0, 1)[real], case["v"][case["slots"] >= 0])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_triton_fused_agrees_with_the_reference(dtype):
    """The torch reference rounds as the kernels do (each product and the sum to the dtype). Not
    bf16 here: the interpreter's float32 -> bf16 casts do not round to nearest (a few ulps off)."""
    case = make_case(5, 4, 2, 64, dtype, dtype, seed=3)
    q_out, caches = run_fused(case, triton_layers)
    q_ref, caches_ref = run_fused(case, reference)
    assert_same_bits(q_out, q_ref)
    for got, want in zip(caches, caches_ref, strict=True):
        assert_same_bits(got, want)


@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (2.0**-3, 4.0), (0.3, 0.07)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_triton_fused_fp8_cache_is_bit_identical_to_reshape_and_cache(dtype, k_scale, v_scale):
    """|K|, |V| up to ~120: at k_scale 2^-3 some K clamp at +-448, most values round."""
    case = make_case(8, 4, 2, 64, dtype, E4M3, magnitude=30.0, seed=11)
    q_out, caches = run_fused(case, triton_layers, k_scale, v_scale)
    q_want, caches_want = run_unfused(
        case, triton_layers.rotary_embedding, triton_cache.reshape_and_cache, k_scale, v_scale
    )
    assert_same_bits(q_out, q_want)
    for got, want in zip(caches, caches_want, strict=True):
        assert_same_bits(got, want)
    real = case["slots"][case["slots"] >= 0]
    if k_scale == 2.0**-3:
        assert caches[0].flatten(0, 1)[real].float().abs().max() == 448.0  # the clamp was exercised


def test_cpu_dispatch_is_the_reference_composition():
    for cache_dtype, scales in ((torch.bfloat16, (1.0, 1.0)), (E4M3, (0.5, 2.0))):
        case = make_case(6, 4, 2, 16, torch.bfloat16, cache_dtype, seed=5)
        q_out, caches = run_fused(case, kernels, *scales)
        q_want, caches_want = run_unfused(
            case, reference.rotary_embedding, reference.reshape_and_cache, *scales
        )
        assert_same_bits(q_out, q_want)
        for got, want in zip(caches, caches_want, strict=True):
            assert_same_bits(got, want)


@pytest.mark.parametrize("impl", [triton_layers, reference])
def test_no_tokens_and_careless_arguments(impl):
    case = make_case(0, 4, 2, 16, torch.float32, torch.float32)
    q_out, caches = run_fused(case, impl)
    assert q_out.shape == (0, 4, 16)
    assert all(torch.equal(a, b) for a, b in zip(caches, case["caches"], strict=True))
    case = make_case(3, 4, 2, 16, torch.float32, torch.float32)
    with pytest.raises(ValueError, match="not scaled"):
        run_fused(case, impl, 0.5, 1.0)  # scales are for an FP8 cache only


def test_attention_without_positions_is_refused():
    attn = PagedAttention(4, 2, 16, 0.25)
    case = make_case(3, 4, 2, 16, torch.float32, torch.float32)
    rope = type("Rope", (), {"cos_cache": case["cos"], "sin_cache": case["sin"]})()
    kv_cache = torch.stack(case["caches"])
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        case["slots"], torch.zeros(1, 1, **i32), torch.tensor([3], **i32), torch.tensor([0, 3], **i32), 3, 3
    )
    with pytest.raises(ValueError, match="positions"):
        attn(case["q"], case["k"], case["v"], kv_cache, meta, rotary=rope)


# ---- a tiny model's layers on the fused path and on the path it replaced ----------------------------


def steps():
    """A prefill of two sequences (5 and 3 tokens), then a decode step of both plus a padding row (slot
    -1, belonging to no sequence, as a CUDA graph pads); block tables [[2, 0], [5, 1]], block size 4."""
    i32 = dict(dtype=torch.int32)
    tables = torch.tensor([[2, 0], [5, 1]], **i32)
    prefill = AttentionMetadata(
        slot_mapping=torch.tensor([8, 9, 10, 11, 0, 20, 21, 22]),
        block_tables=tables, seq_lens=torch.tensor([5, 3], **i32),
        query_start_loc=torch.tensor([0, 5, 8], **i32), max_query_len=5, max_seq_len=5,
    )
    decode = AttentionMetadata(
        slot_mapping=torch.tensor([1, 23, -1]),
        block_tables=tables, seq_lens=torch.tensor([6, 4], **i32),
        query_start_loc=torch.tensor([0, 1, 2], **i32), max_query_len=1, max_seq_len=6,
    )
    gen = torch.Generator().manual_seed(7)
    return [
        (torch.randint(3, 500, (8,), generator=gen), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), prefill, 8),
        (torch.randint(3, 500, (3,), generator=gen), torch.tensor([5, 3, 0]), decode, 2),
    ]


def unfused_attention_forward(monkeypatch):
    """PagedAttention.forward as the models called it before: rotary first (RotaryEmbedding, through
    kernels.rotary_embedding), then attention with the rotated q and k (reshape_and_cache)."""
    fused_forward = PagedAttention.forward

    def forward(self, q, k, v, kv_cache, meta, rotary=None, positions=None):
        if rotary is not None:
            q, k = rotary(positions, q, k)
        return fused_forward(self, q, k, v, kv_cache, meta)

    monkeypatch.setattr(PagedAttention, "forward", forward)


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3"])
@pytest.mark.parametrize("cache", ["model", "fp8"])
@pytest.mark.parametrize("triton", [True, False], ids=["triton", "reference"])
def test_tiny_model_logits_and_cache_are_bit_identical_fused_and_unfused(
    tiny_model_dirs, monkeypatch, family, cache, triton
):
    """The model's own layers (q / k norms before rotary in qwen3 and gemma3), bf16: logits of the
    sampled rows and the whole KV cache after a prefill and a decode step, fused against unfused."""
    folder = tiny_model_dirs[family]
    config = ModelConfig.from_dir(folder)
    model = load_model(folder, config, torch.bfloat16, torch.device("cpu"))
    if cache == "fp8":
        for i, layer in enumerate(attention_layers(model)):
            layer.k_scale, layer.v_scale = 2.0**-i / 16, 0.3 / (i + 1)
    cache_dtype = E4M3 if cache == "fp8" else torch.bfloat16
    shape = (config.num_layers, 2, 8, 4, config.num_kv_heads, config.head_dim)
    if triton:  # the dispatcher's CUDA choices, on CPU tensors
        monkeypatch.setattr(kernels, "rotary_and_cache", triton_layers.rotary_and_cache)
        monkeypatch.setattr(kernels, "rotary_embedding", triton_layers.rotary_embedding)
        monkeypatch.setattr(kernels, "reshape_and_cache", triton_cache.reshape_and_cache)
        # the decode step's rotary and cache write through the Triton kernel too; its attention stays the
        # reference (the interpreter's bf16 dots are not the GPU's: the fused Triton launch runs in
        # tests/unit/test_rotary_cache_attention.py, and compiled in a model in
        # tests/gpu/test_rotary_and_cache_gpu.py)
        monkeypatch.setattr(kernels, "rotary_cache_attention", decode_rotary_through_triton)

    def run():
        kv_cache = torch.zeros(shape, dtype=cache_dtype)
        logits = []
        with torch.inference_mode():
            for input_ids, positions, meta, num_rows in steps():
                hidden = model(input_ids, positions, kv_cache, meta)
                rows = meta.query_start_loc[1:].long() - 1
                logits.append(model.compute_logits(hidden[rows[:num_rows]]))
        return logits, kv_cache

    calls, decode_calls = [], []
    monkeypatch.setattr(kernels, "rotary_and_cache", counted(kernels.rotary_and_cache, calls))
    monkeypatch.setattr(
        kernels, "rotary_cache_attention", counted(kernels.rotary_cache_attention, decode_calls)
    )
    fused_logits, fused_cache = run()
    # every layer took the fused kernels: the prefill step rotary_and_cache, the decode step
    # rotary_cache_attention (rotary, cache write and attention in one launch on CUDA)
    assert len(calls) == len(decode_calls) == config.num_layers
    unfused_attention_forward(monkeypatch)
    unfused_logits, unfused_cache = run()
    assert len(calls) == len(decode_calls) == config.num_layers  # and the unfused run did not
    for got, want in zip(fused_logits, unfused_logits, strict=True):
        assert_same_bits(got, want)
    assert_same_bits(fused_cache, unfused_cache)
    assert fused_cache.float().abs().amax(dim=(2, 3, 4, 5)).min() > 0  # every layer wrote K and V


def decode_rotary_through_triton(
    positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache, *attend,
    deterministic=False, k_scale=1.0, v_scale=1.0, decode_order=None,  # (the order: no effect on the bits)
):
    query = triton_layers.rotary_and_cache(
        positions, query, key, value, key_cache, value_cache, slot_mapping, cos_cache, sin_cache,
        k_scale, v_scale,
    )
    return reference.paged_attention(query, key_cache, value_cache, *attend, k_scale, v_scale)


def counted(fn, calls: list):
    def wrapper(*args, **kwargs):
        calls.append(1)
        return fn(*args, **kwargs)

    return wrapper


@pytest.mark.parametrize("impl_name", ["triton", "reference"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rotate_key_in_place_writes_the_rotated_keys_over_key(impl_name, dtype):
    """rotate_key_in_place: the QKV buffer's key columns hold the rotated keys of the tokens with a slot
    (bit for bit rotary_embedding's), the padding tokens' key and value rows are zero, and nothing else
    in the buffer changes; the query and cache results are those of the default call."""
    impl = triton_layers if impl_name == "triton" else reference
    case = make_case(7, 4, 2, 64, dtype, dtype, seed=11)
    qkv_before = case["q"]._base.clone() if case["q"]._base is not None else None
    q_want, caches_want = run_fused(case, impl)
    _, k_rotated = triton_layers.rotary_embedding(
        case["positions"], case["q"], case["k"], case["cos"], case["sin"])
    k_before = case["k"].clone()
    caches = [c.clone() for c in case["caches"]]
    q_out = impl.rotary_and_cache(
        case["positions"], case["q"], case["k"], case["v"], *caches, case["slots"], case["cos"], case["sin"],
        1.0, 1.0, True,
    )
    assert_same_bits(q_out, q_want)
    for got, want in zip(caches, caches_want, strict=True):
        assert_same_bits(got, want)
    real = case["slots"] >= 0
    assert (~real).any() and k_before[~real].abs().sum() > 0
    assert_same_bits(case["k"][real], k_rotated[real])
    assert (case["k"][~real] == 0).all() and (case["v"][~real] == 0).all()  # padding rows zeroed
    assert qkv_before is not None
    qkv = case["q"]._base
    width_q = 4 * 64
    assert_same_bits(qkv[:, :width_q], qkv_before[:, :width_q])  # queries untouched
    values = qkv[:, width_q + 2 * 64 :]
    assert_same_bits(values[real], qkv_before[:, width_q + 2 * 64 :][real])  # real tokens' values untouched
