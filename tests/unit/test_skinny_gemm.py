"""The decode-batch GEMM (kernels/triton_skinny.py) under the Triton interpreter against torch, its
refusals, and the layers' policy: the skinny kernel only inside `graph_gemms()` (what the CUDA graphs
record), never in deterministic mode, never for tensors it cannot take (on CPU: never at all).
tests/gpu/test_skinny_gemm_gpu.py runs the compiled kernel. Module setup as in
tests/unit/test_kernels_triton.py.
"""

import importlib
import os

import pytest
import torch
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_skinny_gemm_gpu.py runs the compiled kernel",
                allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from executor_svc.layers import determinism  # noqa: E402
from executor_svc.layers import linear as linear_mod  # noqa: E402
from executor_svc.layers.mlp import GatedMLP  # noqa: E402
from kernels import reference, triton_skinny  # noqa: E402
from kernels.triton_skinny import SkinnyConfig, skinny_config  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_skinny._skinny_kernel).__name__ != "InterpretedFunction":  # imported earlier, compiled
    triton_skinny = importlib.reload(triton_skinny)

patch_interpreter_for_numpy()

SMALL = SkinnyConfig(block_n=32, block_k=64, stages=1, warps=1)


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# (M, N, K): one row; N not a multiple of the tile; K not a multiple of BLOCK_K (the weight's last
# slice read past its end as zeros); M just above a power of two; the largest M
@pytest.mark.parametrize("rows,n,k", [(1, 64, 128), (3, 100, 200), (17, 72, 136), (64, 40, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_linear_matches_torch_float32(rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows * 1000 + n + k)
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    out = triton_skinny.skinny_linear(x, w, b, config=SMALL)
    assert out.shape == (rows, n) and out.dtype == x.dtype
    assert torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)


# split-K: K in 4 slices of 64 over 2, 3 (one slice empty: 2 + 2 + 0) and 4 programs a tile; odd N, M
@pytest.mark.parametrize("split_k", [2, 3, 4])
@pytest.mark.parametrize("bias", [False, True])
def test_skinny_split_k_matches_torch_and_leaves_its_counters_at_zero(split_k, bias):
    gen = torch.Generator().manual_seed(split_k)
    rows, n, k = 5, 72, 200
    x = torch.randn(rows, k, generator=gen)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    cfg = SkinnyConfig(block_n=32, block_k=64, stages=1, warps=1, split_k=split_k)
    out = triton_skinny.skinny_linear(x, w, b, config=cfg)
    assert torch.allclose(out, F.linear(x, w, b), rtol=1e-5, atol=1e-4)
    assert not triton_skinny._counters(x.device, 3)[:16].any()  # the next launch starts from zero
    again = triton_skinny.skinny_linear(x, w, b, config=cfg)
    assert torch.equal(out, again)  # the slices are summed in one order


def test_skinny_split_k_counters_grow_without_freeing_the_old_ones(monkeypatch):
    """A launch with more tiles than the counters hold gets a larger set; the smaller one stays
    referenced, since a CUDA graph captured with it keeps its address."""
    monkeypatch.setattr(triton_skinny, "_COUNTERS", {})
    monkeypatch.setattr(triton_skinny, "_OUTGROWN", [])
    small = triton_skinny._counters(torch.device("cpu"), 10)
    assert small.numel() == 4096 and triton_skinny._counters(torch.device("cpu"), 4096) is small
    large = triton_skinny._counters(torch.device("cpu"), 5000)
    assert large.numel() == 5000 and not large.any()
    assert len(triton_skinny._OUTGROWN) == 1 and triton_skinny._OUTGROWN[0] is small


def test_skinny_split_k_refusals():
    x, w = torch.randn(4, 128), torch.randn(64, 128)
    assert "slices" in triton_skinny.refusal(x, w, config=SkinnyConfig(32, 64, 1, 1, split_k=3))
    assert "slices" in triton_skinny.refusal(x, w, config=SkinnyConfig(32, 64, 1, 1, split_k=0))
    assert "gated" in triton_skinny.refusal(x, torch.randn(128, 128), gated=True,
                                            config=SkinnyConfig(32, 64, 1, 1, split_k=2))
    with pytest.raises(ValueError, match="slices"):
        triton_skinny.skinny_linear(x, w, config=SkinnyConfig(32, 64, 1, 1, split_k=4))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_skinny_linear_16_bit_within_one_rounding(dtype):
    """float32 accumulation, one rounding to the dtype at the end: within an ulp or so of torch's
    float32 product rounded once."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 200, generator=gen).to(dtype)
    w = (torch.randn(96, 200, generator=gen) * 0.05).to(dtype)
    out = triton_skinny.skinny_linear(x, w, config=SMALL)
    ref = F.linear(x.float(), w.float())
    assert out.dtype == dtype
    assert _rel(out, ref) < (8e-3 if dtype == torch.bfloat16 else 1e-3)


def test_skinny_linear_writes_only_its_rows_and_columns():
    """`out` wider than the product (a strided view): the store masks rows >= M and columns >= N."""
    x = torch.randn(3, 64)
    w = torch.randn(40, 64)
    full = torch.full((3, 48), 7.0)
    triton_skinny.skinny_linear(x, w, out=full[:, :40], config=SMALL)
    assert torch.allclose(full[:, :40], x @ w.T, rtol=1e-5, atol=1e-4)
    assert torch.equal(full[:, 40:], torch.full((3, 8), 7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_up_silu_matches_silu_and_mul_of_the_projection(dtype):
    gen = torch.Generator().manual_seed(3)
    inter = 64  # two tiles of SMALL's 32 rows per half
    x = torch.randn(6, 136, generator=gen).to(dtype)
    w = (torch.randn(2 * inter, 136, generator=gen) * 0.1).to(dtype)
    out = triton_skinny.skinny_gate_up_silu(x, w, config=SMALL)
    ref = reference.silu_and_mul(F.linear(x.float(), w.float()).to(dtype))
    assert out.shape == (6, inter) and out.dtype == dtype
    assert _rel(out, ref) < (1e-5 if dtype == torch.float32 else 2e-2)


WIDE = kernels.SKINNY_GATED_WIDE_ROWS


@pytest.mark.parametrize("rows", [WIDE.start, WIDE.stop - 1])
def test_gate_up_silu_takes_the_wide_rows(rows):
    """The gated kernel also takes SKINNY_GATED_WIDE_ROWS (a 128-row token tile; the engine's default
    config three stages deep); the plain one does not, nor the gated one just below the range."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 136, generator=gen)
    w = torch.randn(2 * 64, 136, generator=gen) * 0.1
    out = triton_skinny.skinny_gate_up_silu(x, w, config=SMALL)
    assert _rel(out, reference.silu_and_mul(F.linear(x, w))) < 1e-5
    assert skinny_config(rows, 14336, 4096, gated=True).stages == 3
    assert skinny_config(kernels.SKINNY_MAX_ROWS, 14336, 4096, gated=True).stages == 4
    assert triton_skinny.refusal(x, w) is not None  # not the plain kernel
    below = torch.randn(kernels.SKINNY_GATED_WIDE_ROWS.start - 1, 136)
    assert "rows" in triton_skinny.refusal(below, w, gated=True)
    above = torch.randn(kernels.SKINNY_GATED_WIDE_ROWS.stop, 136)
    assert "rows" in triton_skinny.refusal(above, w, gated=True)


def test_refusals_name_the_problem():
    x, w = torch.randn(4, 64), torch.randn(32, 64)
    with pytest.raises(ValueError, match="not x"):
        triton_skinny.skinny_linear(x, torch.randn(32, 48))
    with pytest.raises(ValueError, match="rows"):
        triton_skinny.skinny_linear(torch.randn(kernels.SKINNY_MAX_ROWS + 1, 64), w)
    with pytest.raises(ValueError, match="rows"):
        triton_skinny.skinny_linear(torch.randn(0, 64), w)
    with pytest.raises(ValueError, match="differ"):
        triton_skinny.skinny_linear(x.double(), w)
    with pytest.raises(ValueError, match="16-byte"):
        triton_skinny.skinny_linear(torch.randn(4, 66)[:, :63], torch.randn(32, 63))
    with pytest.raises(ValueError, match="tiles"):
        triton_skinny.skinny_gate_up_silu(x, torch.randn(2 * 40, 64), config=SMALL)


def test_config_choice():
    assert skinny_config(8, 128256, 4096).block_n == 128  # many columns: wide tiles
    assert skinny_config(8, 4096, 4096).block_n == 64
    assert skinny_config(8, 14336, 4096, gated=True).block_n == kernels.SKINNY_GATED_BLOCK_N


def test_usable_only_on_cuda_with_few_rows():
    x, w = torch.randn(4, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert not kernels.skinny_usable(x, w)


def test_layers_keep_torch_outside_cuda_and_outside_graph_gemms(monkeypatch):
    """The policy: the skinny kernel (or a GEMM plan) is consulted only inside graph_gemms(), for CUDA
    tensors, not in deterministic mode; on CPU results equal F.linear and silu_and_mul of it exactly."""
    asked = []
    real = kernels.skinny_usable
    monkeypatch.setattr(kernels, "skinny_usable",
                        lambda x, w, gated=False: asked.append(gated) or real(x, w, gated))
    mlp = GatedMLP(64, 128, bias=False, tp_rank=0, tp_size=1)
    for p in mlp.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(3, 64)
    expected = F.linear(reference.silu_and_mul(F.linear(x, mlp.gate_up_proj.weight)), mlp.down_proj.weight)
    assert torch.equal(mlp(x), expected)
    assert asked == []  # outside graph_gemms: not even asked
    with linear_mod.graph_gemms():
        assert torch.equal(mlp(x), expected)
        assert asked == []  # CPU tensors: not asked either
        determinism.set_deterministic(True)
        try:
            linear_mod.linear(x, mlp.gate_up_proj.weight)
        finally:
            determinism.set_deterministic(False)
    assert asked == [] and linear_mod._GRAPH_GEMMS.get() is None


def test_shared_memory_of_the_pipelines():
    """What kernels.skinny_usable compares with the device's shared memory a block: 227 KB on an H100
    (every shape fits with the margin); 99 KB would not hold any (cuBLAS rather than a failed launch)."""
    margin, hopper, rtx50 = kernels.SKINNY_SMEM_MARGIN, 227 * 1024, 99 * 1024
    cases = [(64, 6144, 4096, False), (64, 128256, 4096, False), (64, 14336, 4096, True),
             (1, 4096, 14336, False), (128, 14336, 4096, True)]
    for rows, n, k, gated in cases:
        need = triton_skinny.shared_memory_bytes(rows, n, k, gated)
        assert need + margin <= hopper, (rows, n, k, gated, need)
        assert need > rtx50, (rows, n, k, gated, need)
    assert triton_skinny.shared_memory_bytes(64, 6144, 4096) == 6 * (64 + 64) * 128 * 2
    assert triton_skinny.shared_memory_bytes(8, 14336, 4096, gated=True) == 4 * (16 + 2 * 64) * 128 * 2
    assert triton_skinny.shared_memory_bytes(96, 14336, 4096, gated=True) == 3 * (128 + 2 * 64) * 128 * 2


def test_pdl_only_on_a_gpu_and_not_when_turned_off(monkeypatch):
    import kernels

    kernels._pdl_on.cache_clear()
    try:
        assert not kernels.pdl(torch.device("cpu"))
        assert kernels.pdl_launch(False) == {} and kernels.pdl_launch(True) == {"launch_pdl": True}
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter runs no inline PTX
        assert not kernels.pdl(torch.device("cuda", 0))
        monkeypatch.delenv("TRITON_INTERPRET")
        monkeypatch.setenv(kernels.PDL_ENV, "0")  # decided before any CUDA query: works without a GPU
        assert not kernels.pdl(torch.device("cuda", 0))
    finally:
        kernels._pdl_on.cache_clear()


def test_pdl_per_kernel_list_and_the_small_decode_attention_rule(monkeypatch):
    """PAGEDSERVE_PDL_OFF unset: only a decode-only attention launch of fewer than
    PDL_ATTENTION_MIN_SEQS sequences goes plainly; set, its list alone decides; an unknown name is
    refused with the known ones. (The GPU itself is faked: `_pdl_on` answers for a Hopper.)"""
    import kernels

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv(kernels.PDL_OFF_ENV, raising=False)
    monkeypatch.setattr(kernels, "_pdl_on", lambda index: True)
    gpu = torch.device("cuda", 0)
    small, big = kernels.PDL_ATTENTION_MIN_SEQS - 1, kernels.PDL_ATTENTION_MIN_SEQS
    assert kernels.pdl(gpu) and kernels.pdl(gpu, "skinny", small) and kernels.pdl(gpu, "reduce", small)
    assert not kernels.pdl(gpu, "attention", small)
    assert kernels.pdl(gpu, "attention", big) and kernels.pdl(gpu, "attention")  # None: a mixed launch
    monkeypatch.setenv(kernels.PDL_OFF_ENV, "")  # every kernel with PDL, the rule too
    assert kernels.pdl(gpu, "attention", small)
    monkeypatch.setenv(kernels.PDL_OFF_ENV, " rms_norm, attention ")
    assert not kernels.pdl(gpu, "attention", big) and not kernels.pdl(gpu, "rms_norm")
    assert kernels.pdl(gpu, "skinny") and kernels.pdl(gpu)
    kernels.check_pdl_env()
    monkeypatch.setenv(kernels.PDL_OFF_ENV, "attention,gemm")
    with pytest.raises(ValueError, match="unknown kernel.*gemm.*known: skinny"):
        kernels.pdl(gpu, "attention")
    with pytest.raises(ValueError, match="PAGEDSERVE_PDL_OFF: unknown kernel"):
        kernels.check_pdl_env()  # what the executor checks at its start (executor_svc/server/main.py)
