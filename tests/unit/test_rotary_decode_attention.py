"""The decode launch of paged attention with the rotary and the cache write inside (paged_attention's
`rotary`, what kernels.rotary_cache_and_attention takes on CUDA) against what it replaces,
rotary_and_cache then paged_attention, bit for bit: the output and both caches, under the Triton
interpreter. Splits (even, forced, none), GQA, a masked head_dim tail, a sliding window, an FP8
cache with scales, a sequence without a slot (a graph's padding); the refusals; and a tiny model's
decode steps through the dispatcher. tests/gpu/test_rotary_decode_attention_gpu.py compares the
compiled kernels. Module setup as in tests/unit/test_kernels_triton.py.
"""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernels", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from executor_svc.layers.attention import AttentionMetadata  # noqa: E402
from executor_svc.models.config import ModelConfig  # noqa: E402
from executor_svc.models.loader import load_model  # noqa: E402
from kernels import triton_attention, triton_cache, triton_layers  # noqa: E402
from kernels.testing import decode_rotary_inputs, make_paged_case  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_attention._paged_attention_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_cache = importlib.reload(triton_cache)
    triton_layers = importlib.reload(triton_layers)
    triton_attention = importlib.reload(triton_attention)

patch_interpreter_for_numpy()

E4M3 = torch.float8_e4m3fn


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.equal(bits(got), bits(want))


def run_both(case, inputs, k_scale=1.0, v_scale=1.0, **kwargs):
    """(out, key_cache, value_cache) of the fused launch and of rotary_and_cache + paged_attention."""
    results = []
    for fused in (True, False):
        key_cache, value_cache = case.key_cache.clone(), case.value_cache.clone()
        attention = (case.block_tables, case.seq_lens, case.query_start_loc, 1, case.max_seq_len, case.scale)
        if fused:
            rotary = (inputs["positions"], inputs["k"], inputs["v"], inputs["slot_mapping"], inputs["cos"],
                      inputs["sin"])
            out = triton_attention.paged_attention(
                inputs["q"], key_cache, value_cache, *attention, k_scale=k_scale, v_scale=v_scale,
                rotary=rotary, **kwargs,
            )
        else:
            q = triton_layers.rotary_and_cache(
                inputs["positions"], inputs["q"], inputs["k"], inputs["v"], key_cache, value_cache,
                inputs["slot_mapping"], inputs["cos"], inputs["sin"], k_scale, v_scale,
            )
            out = triton_attention.paged_attention(
                q, key_cache, value_cache, *attention, k_scale=k_scale, v_scale=v_scale, **kwargs
            )
        results.append((out, key_cache, value_cache))
    return results


def test_kernel_is_interpreted():
    assert type(triton_attention._paged_attention_kernel).__name__ == "InterpretedFunction"


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "dtype", "extra"),
    [
        ([5, 17, 9], 4, 2, 16, torch.bfloat16, {}),  # GQA, no split
        ([5, 17, 9], 4, 4, 16, torch.float16, {}),  # MHA
        ([300, 40], 4, 2, 16, torch.bfloat16, {}),  # 4 programs: even splits, the last one writes
        ([23, 11], 4, 2, 16, torch.bfloat16, {"num_splits": 3}),  # forced fixed partitions
        ([13, 6], 6, 2, 40, torch.bfloat16, {}),  # head_dim 40: D_PAD 64, a masked tail in each half
        ([30, 9], 4, 2, 16, torch.float32, {"sliding_window": 7}),
    ],
    ids=["gqa", "mha", "even-splits", "forced-splits", "head-dim-40", "window"],
)
def test_fused_decode_is_bit_identical_to_rotary_and_cache_then_attention(
    seq_lens, num_heads, num_kv_heads, head_dim, dtype, extra
):
    case = make_paged_case(seq_lens, [1] * len(seq_lens), num_heads, num_kv_heads, head_dim, 4, dtype, "cpu",
                           seed=sum(seq_lens) + head_dim)
    inputs = decode_rotary_inputs(case, seed=head_dim)
    (out, k_cache, v_cache), (want, k_want, v_want) = run_both(case, inputs, **extra)
    assert_same_bits(out, want)
    assert_same_bits(k_cache, k_want)
    assert_same_bits(v_cache, v_want)
    # the step's own K/V went in (the cache changed at each slot) and nowhere else
    slots = inputs["slot_mapping"]
    changed = (k_cache != case.key_cache).flatten(0, 1).flatten(1).any(dim=1)  # [num_slots]
    assert changed[slots].all() and changed.sum() == len(slots)
    assert torch.equal(v_cache.flatten(0, 1)[slots], inputs["v"])


def test_fp8_cache_with_scales():
    """Into an e4m3 cache: the fused write quantizes as rotary_and_cache does (the interpreter's cast in
    both; tests/unit/test_fp8_kv_triton.py), and the attention reads it back scaled."""
    case = make_paged_case([21, 8, 300], [1, 1, 1], 4, 2, 16, 8, torch.bfloat16, "cpu", seed=5)
    case = type(case)(**{**case.__dict__, "key_cache": (case.key_cache * 4).to(E4M3),
                         "value_cache": (case.value_cache * 4).to(E4M3)})
    inputs = decode_rotary_inputs(case, seed=6)
    (out, k_cache, v_cache), (want, k_want, v_want) = run_both(case, inputs, k_scale=0.25, v_scale=0.5)
    assert_same_bits(out, want)
    assert_same_bits(k_cache, k_want)
    assert_same_bits(v_cache, v_want)


def test_a_sequence_without_a_slot_writes_nothing_and_reads_the_cache():
    """slot < 0 (a CUDA graph's padding sequence): no write; its row attends to what the cache holds, as
    after rotary_and_cache, which skips it too."""
    case = make_paged_case([9, 14], [1, 1], 4, 2, 16, 4, torch.bfloat16, "cpu", seed=3)
    inputs = decode_rotary_inputs(case, seed=4)
    inputs["slot_mapping"][0] = -1
    (out, k_cache, v_cache), (want, k_want, v_want) = run_both(case, inputs)
    assert_same_bits(out, want)
    assert_same_bits(k_cache, k_want)
    changed = (k_cache != case.key_cache).flatten(0, 1).flatten(1).any(dim=1)
    assert changed.sum() == 1 and changed[inputs["slot_mapping"][1]]


def test_rotary_is_refused_outside_a_decode_launch():
    case = make_paged_case([9, 14], [3, 1], 4, 2, 16, 4, torch.bfloat16, "cpu", seed=3)
    rotary = (torch.zeros(4, dtype=torch.long), case.query[:, :2], case.query[:, :2],
              torch.zeros(4, dtype=torch.long), torch.ones(16, 8), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="3 query tokens"):
        triton_attention.paged_attention(*case.args(), rotary=rotary)
    case = make_paged_case([9, 14], [1, 1], 4, 2, 16, 4, torch.bfloat16, "cpu", seed=3)
    rotary = (torch.zeros(2, dtype=torch.long), case.query[:, :2], case.query[:, :2],
              torch.zeros(2, dtype=torch.long), torch.ones(16, 8), torch.zeros(16, 8))
    with pytest.raises(ValueError, match="deterministic"):
        triton_attention.paged_attention(*case.args(), deterministic=True, rotary=rotary)
    with pytest.raises(ValueError, match="must be"):  # key of the wrong head count
        triton_attention.paged_attention(*case.args(), rotary=(rotary[0], case.query, *rotary[2:]))


def test_tiny_model_decode_through_the_dispatcher_is_bit_identical(tiny_model_dirs, monkeypatch):
    """A tiny llama's prefill and two decode steps, Triton kernels throughout: the dispatcher
    (kernels.rotary_cache_and_attention) taking the fused decode launch, then not; logits and the whole
    cache equal."""
    folder = tiny_model_dirs["llama"]
    config = ModelConfig.from_dir(folder)
    model = load_model(folder, config, torch.bfloat16, torch.device("cpu"))
    monkeypatch.setattr(kernels, "rotary_and_cache", triton_layers.rotary_and_cache)
    monkeypatch.setattr(kernels, "paged_attention", triton_attention.paged_attention)
    i32 = dict(dtype=torch.int32)
    tables = torch.tensor([[2, 0], [5, 1]], **i32)
    steps = [
        (torch.tensor([0, 1, 2, 3, 4, 0, 1, 2]), AttentionMetadata(
            torch.tensor([8, 9, 10, 11, 0, 20, 21, 22]), tables, torch.tensor([5, 3], **i32),
            torch.tensor([0, 5, 8], **i32), 5, 5)),
        (torch.tensor([5, 3]), AttentionMetadata(
            torch.tensor([1, 23]), tables, torch.tensor([6, 4], **i32), torch.tensor([0, 1, 2], **i32), 1,
            6)),
        (torch.tensor([6, 4]), AttentionMetadata(
            torch.tensor([2, 4]), tables, torch.tensor([7, 5], **i32), torch.tensor([0, 1, 2], **i32), 1,
            7)),
    ]
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(3, 500, (len(p),), generator=gen) for p, _ in steps]
    shape = (config.num_layers, 2, 8, 4, config.num_kv_heads, config.head_dim)
    fused_calls = []

    def run(fused: bool):
        module = None
        if fused:
            def module(query):
                fused_calls.append(1)
                return triton_attention
        monkeypatch.setattr(kernels, "_fused_attention_module", module or (lambda query: None))
        kv_cache = torch.zeros(shape, dtype=torch.bfloat16)
        logits = []
        with torch.inference_mode():
            for input_ids, (positions, meta) in zip(ids, steps, strict=True):
                hidden = model(input_ids, positions, kv_cache, meta)
                logits.append(model.compute_logits(hidden[meta.query_start_loc[1:].long() - 1]))
        return logits, kv_cache

    fused_logits, fused_cache = run(True)
    assert len(fused_calls) == 3 * config.num_layers
    plain_logits, plain_cache = run(False)
    for got, want in zip(fused_logits, plain_logits, strict=True):
        assert_same_bits(got, want)
    assert_same_bits(fused_cache, plain_cache)
    assert fused_cache[:, :, 0].abs().sum() > 0  # the decode steps wrote block 0 (slots 1, 2 and 4)
