"""The fused MoE Triton kernel against its torch reference on CPU under the Triton interpreter (tiny
shapes: the interpreter is slow), the expert alignment's invariants, and the routing's normalization
against Hugging Face's routers. tests/gpu/test_moe_gpu.py covers the compiled kernel."""

import importlib
import os

import pytest
import torch

if torch.cuda.is_available():
    pytest.skip("CUDA present: tests/gpu runs the compiled kernel", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

from kernels import reference, triton_moe  # noqa: E402
from tests.helpers.triton_interpreter import patch_interpreter_for_numpy  # noqa: E402

patch_interpreter_for_numpy()
if type(triton_moe._gate_up_kernel).__name__ != "InterpretedFunction":  # imported earlier
    triton_moe = importlib.reload(triton_moe)


def _case(num_tokens, hidden, inter, num_experts, seed, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, generator=gen) / hidden**0.5).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, generator=gen) / inter**0.5).to(dtype)
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(dtype)
    return x, w13, w2, logits


@pytest.mark.parametrize(
    ("num_tokens", "hidden", "inter", "num_experts", "top_k", "renormalize"),
    [
        (1, 32, 16, 4, 2, True),  # one decode token: most blocks idle
        (7, 64, 48, 8, 2, True),  # inter not a multiple of the block
        (13, 48, 32, 6, 3, False),  # hidden not a multiple of BLOCK_K; Qwen2-MoE's no renorm
        (40, 32, 16, 4, 4, True),  # top_k = E: every expert runs every token
    ],
)
def test_fused_moe_matches_reference(num_tokens, hidden, inter, num_experts, top_k, renormalize):
    x, w13, w2, logits = _case(num_tokens, hidden, inter, num_experts, seed=num_tokens)
    ref = reference.fused_moe(x, w13, w2, logits, top_k, renormalize)
    got = triton_moe.fused_moe(x, w13, w2, logits, top_k, renormalize)
    assert got.shape == ref.shape and got.dtype == ref.dtype
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_strided_hidden_and_no_tokens():
    x, w13, w2, logits = _case(6, 64, 32, 4, seed=3)
    wide = torch.cat([x, x], dim=1)[:, :64]  # row stride 128
    torch.testing.assert_close(
        triton_moe.fused_moe(wide, w13, w2, logits, 2, True), reference.fused_moe(x, w13, w2, logits, 2, True)
    )
    assert triton_moe.fused_moe(x[:0], w13, w2, logits[:0], 2, True).shape == (0, 64)


def test_rows_are_grouped_by_expert_in_padded_runs():
    ids = torch.tensor([[2, 0], [2, 3], [0, 2], [3, 2], [2, 1]])  # expert 2 five times, 1 once
    rows, experts = triton_moe.align_rows_by_expert(ids, num_experts=5, block_m=4)
    num_rows, flat = ids.numel(), ids.flatten()
    assert rows.numel() == 4 * experts.numel() == (num_rows + 5 * 3 + 3) // 4 * 4
    real = rows[rows < num_rows]
    assert sorted(real.tolist()) == list(range(num_rows))  # every row once
    for block, expert in enumerate(experts.tolist()):
        block_rows = rows[4 * block : 4 * block + 4]
        block_rows = block_rows[block_rows < num_rows]
        if expert < 0:
            assert block_rows.numel() == 0
        else:
            assert (flat[block_rows.long()] == expert).all() and block_rows.numel() > 0
    assert experts.tolist()[:5] == [0, 1, 2, 2, 3] and all(e == -1 for e in experts.tolist()[5:])
    assert rows[8:12].tolist() == [0, 2, 5, 7]  # stable: expert 2's rows in order


def test_routing_follows_each_hf_router():
    from transformers import MixtralConfig, Qwen2MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(9, 16)
    for router, renormalize in (
        (MixtralTopKRouter(MixtralConfig(hidden_size=16, num_local_experts=6, num_experts_per_tok=2)), True),
        (Qwen2MoeTopKRouter(Qwen2MoeConfig(hidden_size=16, num_experts=6, num_experts_per_tok=3)), False),
    ):
        torch.nn.init.normal_(router.weight)
        hf_logits, hf_weights, hf_ids = router(x)
        weights, ids = reference.moe_routing(hf_logits, router.top_k, renormalize)
        assert torch.equal(ids, hf_ids)
        torch.testing.assert_close(weights, hf_weights.float())
