"""Batch-invariant GEMM and row norms (kernels/triton_batch_invariant.py) on CPU under the Triton
interpreter, their CPU references, and the layers' deterministic switch (executor_svc/layers): a row's
output bits do not depend on how many rows share its batch, which they are, or where the row sits.

The interpreter rounds float32 to bf16 by truncation where the GPU rounds to nearest, so bf16 results
are compared to torch within two bf16 ulps; the bitwise checks compare the kernel with itself.
"""

import importlib
import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu/test_batch_invariant_gpu.py covers it", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import kernels  # noqa: E402
from executor_svc.layers import determinism, linear  # noqa: E402
from executor_svc.layers.moe import FusedMoE, ReplicatedLinear  # noqa: E402
from kernels import reference, triton_batch_invariant  # noqa: E402
from kernels.testing import relative_error  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

if type(triton_batch_invariant._matmul_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_batch_invariant = importlib.reload(triton_batch_invariant)

patch_interpreter_for_numpy()

TileConfig = triton_batch_invariant.TileConfig
# the default tile (one M tile for every batch here) and a small one: several M, N and K tiles, the
# last of each partial, so a row moves between tiles and places in a tile as the batch changes
CONFIGS = {"default": None, "small_tiles": TileConfig(block_m=16, block_n=16, block_k=16, group_m=2)}
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
N, K = 50, 72  # neither a multiple of 16 nor of 64
BATCH_SIZES = (1, 3, 17, 40)


@pytest.fixture(autouse=True)
def default_mode():
    determinism.set_deterministic(False)
    yield
    determinism.set_deterministic(False)


def test_kernels_are_interpreted():
    assert type(triton_batch_invariant._matmul_kernel).__name__ == "InterpretedFunction"


def _weights(dtype, seed=0, n=N, k=K):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, k, generator=g).to(dtype), torch.randn(n, generator=g).to(dtype)


def _batches_holding(probe: torch.Tensor, seed: int, sizes: tuple[int, ...] = BATCH_SIZES):
    """For each batch size: (batch [M, K] of random rows with `probe` at a random place, its index)."""
    g = torch.Generator().manual_seed(seed)
    for num_rows in sizes:
        batch = torch.randn(num_rows, probe.shape[0], generator=g).to(probe.dtype)
        index = int(torch.randint(num_rows, (1,), generator=g))
        batch[index] = probe
        yield batch, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("with_bias", [False, True])
def test_matmul_matches_torch(dtype, config, with_bias):
    weight, bias = _weights(dtype)
    x = torch.randn(40, K, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = triton_batch_invariant.matmul(x, weight, bias if with_bias else None, config=CONFIGS[config])
    want = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert out.dtype == dtype and out.shape == (40, N)
    assert relative_error(out, want) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_matmul_row_is_bitwise_the_same_in_every_batch(dtype, config):
    weight, bias = _weights(dtype)
    probe = torch.randn(K, generator=torch.Generator().manual_seed(2)).to(dtype)
    rows = [
        triton_batch_invariant.matmul(batch, weight, bias, config=CONFIGS[config])[index]
        for batch, index in _batches_holding(probe, seed=3)
    ]
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
    assert relative_error(rows[0], weight.double() @ probe.double() + bias.double()) < TOLERANCE[dtype]


def test_matmul_of_strided_views_equals_that_of_contiguous_rows():
    weight, _ = _weights(torch.float32)
    wide = torch.randn(17, K + 9, generator=torch.Generator().manual_seed(4))
    row_view = wide[:, 5 : 5 + K]  # row stride K + 9
    column_major = wide[:, :K].contiguous().T.contiguous().T  # stride (1, 17): copied by the kernel
    want = triton_batch_invariant.matmul(wide[:, 5 : 5 + K].contiguous(), weight)
    assert torch.equal(triton_batch_invariant.matmul(row_view, weight), want)
    assert torch.equal(
        triton_batch_invariant.matmul(column_major, weight),
        triton_batch_invariant.matmul(wide[:, :K].contiguous(), weight),
    )


def test_matmul_of_no_rows_and_mismatched_shapes():
    weight, _ = _weights(torch.float32)
    assert triton_batch_invariant.matmul(torch.empty(0, K), weight).shape == (0, N)
    with pytest.raises(ValueError, match="matmul"):
        triton_batch_invariant.matmul(torch.empty(2, K + 1), weight)
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(block_n=48)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_matmul_is_batch_invariant_and_matches_torch(dtype):
    """The CPU path of deterministic mode (kernels.batch_invariant_matmul on CPU tensors)."""
    weight, bias = _weights(dtype)
    probe = torch.randn(K, generator=torch.Generator().manual_seed(5)).to(dtype)
    rows = [kernels.batch_invariant_matmul(b, weight, bias)[i] for b, i in _batches_holding(probe, seed=6)]
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
    assert relative_error(rows[0], weight.double() @ probe.double() + bias.double()) < TOLERANCE[dtype] / 2


# ---- row norms ------------------------------------------------------------------------------------


def _norm_inputs(dtype, dim, seed=7):
    g = torch.Generator().manual_seed(seed)
    weight = (0.1 * torch.randn(dim, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(dim, generator=g)).to(dtype)
    return weight, bias


NORMS = {
    "gemma_rms_norm": lambda x, w, b: triton_batch_invariant.gemma_rms_norm(x, w, 1e-6),
    "layer_norm": lambda x, w, b: triton_batch_invariant.layer_norm(x, w, b, 1e-5),
    "layer_norm_no_affine": lambda x, w, b: triton_batch_invariant.layer_norm(x, None, None, 1e-5),
}
REFERENCE_NORMS = {
    "gemma_rms_norm": lambda x, w, b: reference.gemma_rms_norm(x, w, 1e-6),
    "layer_norm": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), w, b, 1e-5),
    "layer_norm_no_affine": lambda x, w, b: F.layer_norm(x, (x.shape[-1],), None, None, 1e-5),
}


@pytest.mark.parametrize("name", list(NORMS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 96])
def test_row_norms_match_torch_and_are_batch_invariant(name, dtype, dim):
    weight, bias = _norm_inputs(dtype, dim)
    probe = (3 + torch.randn(dim, generator=torch.Generator().manual_seed(8))).to(dtype)  # mean != 0
    rows = [NORMS[name](batch, weight, bias)[i] for batch, i in _batches_holding(probe, seed=9)]
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
    want = REFERENCE_NORMS[name](probe.float()[None], weight.float(), bias.float())[0]
    assert relative_error(rows[0], want) < TOLERANCE[dtype]


def test_row_norms_take_per_head_views_of_a_fused_qkv():
    """[T, H, D] views whose rows do not merge (Gemma 3's q / k norms): copied, then normed per head."""
    qkv = torch.randn(5, 3 * 4 * 16, generator=torch.Generator().manual_seed(10))
    q = qkv[:, : 4 * 16].view(5, 4, 16)
    weight, bias = _norm_inputs(torch.float32, 16)
    got = triton_batch_invariant.gemma_rms_norm(q, weight, 1e-6)
    assert got.shape == (5, 4, 16)
    assert relative_error(got, reference.gemma_rms_norm(q, weight, 1e-6)) < 1e-5
    got = triton_batch_invariant.layer_norm(q, weight, bias, 1e-5)
    assert relative_error(got, F.layer_norm(q, (16,), weight, bias, 1e-5)) < 1e-5


# ---- the layers' switch ---------------------------------------------------------------------------


class _Spy:
    def __init__(self, fn):
        self.fn, self.calls = fn, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.fn(*args, **kwargs)


def _layers(seed=11):
    """Each layer that multiplies by weights, with random weights, and how to call it."""
    torch.manual_seed(seed)
    column = linear.ColumnParallelLinear(K, N, bias=True)
    row = linear.RowParallelLinear(K, N, bias=True)
    qkv = linear.QKVParallelLinear(K, 8, 4, 2, bias=True)
    head = linear.ParallelLMHead(N, K)
    router = ReplicatedLinear(K, 4)
    for module in (column, row, qkv, head, router):
        for param in module.parameters():
            param.data.normal_()
    return {
        "column": (column, column.forward, column.bias),
        "row": (row, row.forward, None),  # its bias is added after the all-reduce
        "qkv": (qkv, qkv.forward, qkv.bias),
        "lm_head": (head, head.compute_logits, None),
        "router": (router, router.forward, None),
    }


@pytest.mark.parametrize("name", ["column", "row", "qkv", "lm_head", "router"])
def test_layers_use_the_batch_invariant_matmul_only_in_deterministic_mode(monkeypatch, name):
    module, call, bias = _layers()[name]
    x = torch.randn(6, K, generator=torch.Generator().manual_seed(12))
    matmul_spy, linear_spy = _Spy(kernels.batch_invariant_matmul), _Spy(F.linear)
    monkeypatch.setattr(kernels, "batch_invariant_matmul", matmul_spy)
    monkeypatch.setattr(F, "linear", linear_spy)

    default = call(x)
    assert (matmul_spy.calls, linear_spy.calls) == (0, 1)

    determinism.set_deterministic(True)
    out = call(x)
    assert (matmul_spy.calls, linear_spy.calls) == (1, 1)
    want = reference.batch_invariant_matmul(x, module.weight, bias)
    if name == "row":
        want = want + module.bias
    assert torch.equal(out, want)
    assert relative_error(out, default) < 1e-5


def test_deterministic_linear_runs_the_kernel_on_any_leading_shape_and_is_batch_invariant(monkeypatch):
    """With the dispatcher sent to the (interpreted) Triton kernel, a layer's output is the kernel's,
    and a row's output bits are the same in every batch."""
    monkeypatch.setattr(kernels, "batch_invariant_matmul", triton_batch_invariant.matmul)
    determinism.set_deterministic(True)
    module, _, _ = _layers()["column"]
    x = torch.randn(2, 3, K, generator=torch.Generator().manual_seed(13))  # [B, S, K]
    out = module(x)
    assert out.shape == (2, 3, N)
    want = triton_batch_invariant.matmul(x.view(6, K), module.weight, module.bias)
    assert torch.equal(out.view(6, N), want)
    probe = torch.randn(K, generator=torch.Generator().manual_seed(14))
    rows = [module(batch)[i] for batch, i in _batches_holding(probe, seed=15)]
    assert all(torch.equal(row, rows[0]) for row in rows[1:])


def _moe_weights(num_experts: int, inter: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(num_experts, 2 * inter, K, generator=g) * K**-0.5).to(dtype)  # [E, 2 I, H]
    w2 = (torch.randn(num_experts, K, inter, generator=g) * inter**-0.5).to(dtype)  # [E, H, I]
    return w13, w2


# 150 tokens x top 2 = 300 rows > 4 x E x 16: the default kernel switches to 64-row tiles there
MOE_BATCH_SIZES = (*BATCH_SIZES, 150)


def _moe_rows_in_batches(fused_moe, dtype, top_k: int = 2, num_experts: int = 4, inter: int = 24):
    """The output row of one probe token (its hidden row and router logits) in each of
    MOE_BATCH_SIZES batches of other random tokens, at a random place: [len(MOE_BATCH_SIZES), K]."""
    w13, w2 = _moe_weights(num_experts, inter, dtype, seed=21)
    g = torch.Generator().manual_seed(22)
    probe = torch.randn(K, generator=g).to(dtype)
    probe_logits = torch.randn(num_experts, generator=g)
    rows = []
    for batch, index in _batches_holding(probe, seed=23, sizes=MOE_BATCH_SIZES):
        logits = torch.randn(batch.shape[0], num_experts, generator=g)
        logits[index] = probe_logits
        rows.append(fused_moe(batch, w13, w2, logits, top_k, True)[index])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deterministic_moe_reference_is_batch_invariant_and_matches_the_default(dtype):
    from functools import partial

    rows = _moe_rows_in_batches(partial(reference.fused_moe, deterministic=True), dtype)
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
    default = _moe_rows_in_batches(reference.fused_moe, dtype)  # same math, BLAS blocking
    assert relative_error(rows, default) < TOLERANCE[dtype]


def test_deterministic_moe_kernel_is_batch_invariant(monkeypatch):
    """The Triton kernel (interpreted) with one row tile whatever the row count: the probe's row is
    the same bits whether it shares its experts' tiles with 0 or 149 other tokens' rows, and the
    launches use 16-row tiles at every batch size, where the default mode takes 64-row tiles for the
    150-token batch (the interpreter's numpy dots give the same bits for either tile; on the GPU the
    tile shape picks the MMA instructions: tests/gpu/test_moe_gpu.py). float32 only: the
    interpreter's bf16 tl.dot in this kernel returns garbage in either mode (tests/unit/
    test_moe_kernel.py is float32 too)."""
    dtype = torch.float32
    from functools import partial

    triton_moe = importlib.import_module("kernels.triton_moe")
    if type(triton_moe._gate_up_kernel).__name__ != "InterpretedFunction":
        triton_moe = importlib.reload(triton_moe)
    tiles: list[int] = []

    class Recording:  # kernel[grid](...) records the launch's BLOCK_M, then launches
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                tiles.append(kwargs["BLOCK_M"])
                return self.kernel[grid](*args, **kwargs)

            return launch

    for name in ("_gate_up_kernel", "_down_kernel"):
        monkeypatch.setattr(triton_moe, name, Recording(getattr(triton_moe, name)))
    rows = _moe_rows_in_batches(partial(triton_moe.fused_moe, deterministic=True), dtype)
    assert all(torch.equal(row, rows[0]) for row in rows[1:])
    assert set(tiles) == {16}
    tiles.clear()
    _moe_rows_in_batches(triton_moe.fused_moe, dtype)
    assert tiles[-2:] == [64, 64] and set(tiles[:-2]) == {16}  # the default: by the row count
    want = _moe_rows_in_batches(reference.fused_moe, dtype)
    assert relative_error(rows, want) < TOLERANCE[dtype] * 2


def test_moe_layer_passes_the_mode_to_the_kernel(monkeypatch):
    seen = []

    def spy(hidden, w13, w2, router_logits, top_k, renormalize, deterministic=False):
        seen.append(deterministic)
        return torch.zeros_like(hidden)

    monkeypatch.setattr(kernels, "fused_moe", spy)
    x, logits = torch.randn(3, K), torch.randn(3, 4)
    FusedMoE(4, K, 32, 2, True, 0, 1)(x, logits)  # builds and runs in the default mode
    determinism.set_deterministic(True)
    FusedMoE(4, K, 32, 2, True, 0, 1)(x, logits)  # and in deterministic mode (no longer refused)
    assert seen == [False, True]


# ---- tp_all_reduce in rank order (gloo) -----------------------------------------------------------


def _rank_tensor(rank: int) -> torch.Tensor:
    """Rank r's partial sums: bf16 of very different magnitudes, so the summation order shows."""
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(5, 7, generator=g) * 10.0 ** (3 * rank - 3)).to(torch.bfloat16)


def _all_reduce_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        determinism.set_deterministic(True)
        x = _rank_tensor(rank)
        out = linear.tp_all_reduce(x, world_size)
        assert out.data_ptr() == x.data_ptr()  # in place, as NCCL's
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world_size", [2, 3])
def test_deterministic_tp_all_reduce_sums_in_rank_order(tmp_path, world_size):
    mp.spawn(
        _all_reduce_worker, args=(world_size, str(tmp_path / "rendezvous"), str(tmp_path)),
        nprocs=world_size, join=True,
    )
    parts = [_rank_tensor(rank) for rank in range(world_size)]
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    want = total.to(torch.bfloat16)
    if world_size == 2:
        assert torch.equal(want, parts[0] + parts[1])
    for rank in range(world_size):
        assert torch.equal(torch.load(tmp_path / f"rank{rank}.pt"), want)
