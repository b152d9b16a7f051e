"""Tensor-parallel linear layers and the vocabulary embedding / LM head.

Every parameter carries a `weight_loader(param, full_weight, shard_id=None)` that copies THIS rank's
shard out of the full checkpoint tensor, so the loader never needs to know how a layer is split.
`full_weight` is a torch.Tensor or the loader's lazy `CheckpointTensor`; the weight loaders touch it
only through `.shape` and `.narrow(dim, start, length)`, so a rank reads just its shard from disk:

    ColumnParallelLinear   W [out, in]  split along out (dim 0); output stays split
    RowParallelLinear      W [out, in]  split along in  (dim 1); partial outputs are all-reduced
    QKVParallelLinear      q, k, v heads split by rank, stored fused as [q | k | v] rows
    MergedColumnParallel   gate and up stored fused as [gate | up] rows
    VocabParallelEmbedding vocab rows split by rank; rows of other ranks give 0, then all-reduce

Every weight product goes through `linear` and every sum over ranks through `tp_all_reduce`, which
compute batch-invariantly in deterministic mode (executor_svc/layers/determinism.py). Inside
`graph_gemms()` (the CUDA graphs' warm-up and capture) a product runs the backend the GEMM plan
measured for it on this GPU (executor_svc/layers/gemm_plan.py): the skinny kernel
(kernels/triton_skinny.py, which reads the weights faster than cuBLAS at decode batch sizes) or its
split-K form, cuBLAS, cuBLASLt, or one of the algorithms cuBLASLt lists, run through
kernels/cublaslt.py; eagerly the skinny kernel's launch (two TMA descriptors) costs
the host more than cuBLAS's, so eager steps keep cuBLAS.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import kernels
from executor_svc.layers import determinism
from executor_svc.layers.gemm_plan import ALGOS, WIDE_ALGOS, GemmPlan

log = logging.getLogger(__name__)
_GRAPH_GEMMS = contextvars.ContextVar("pagedserve_graph_gemms", default=None)
_RULE = object()  # graph_gemms() without a plan: the fixed rule
_REFUSED: set[str] = set()  # cuBLASLt algorithms of a plan that did not fit their product (warned once)


@contextlib.contextmanager
def graph_gemms(plan: GemmPlan | None = None):
    """While this is open (what a CUDA graph records), CUDA projections take the backend `plan` gives
    them (executor_svc/layers/gemm_plan.py), or without one the fixed rule: the skinny kernel where
    kernels.skinny_usable takes the product, else cuBLAS."""
    token = _GRAPH_GEMMS.set(plan if plan is not None else _RULE)
    try:
        yield
    finally:
        _GRAPH_GEMMS.reset(token)


def _product(backend: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
             gated: bool, algo: str | None = None) -> torch.Tensor:
    """x [..., K] @ weight.T (+ bias) with `backend` (gemm_plan.BACKENDS); gated: silu_and_mul of it
    ([..., N/2]). "cublaslt_algo" runs cuBLASLt's algorithm `algo` (kernels.cublaslt_algos); one that
    does not fit this product (a plan file from elsewhere) falls back to cuBLASLt's own choice."""
    if backend in ("skinny", "skinny_split"):
        rows = x.reshape(-1, x.shape[-1])
        if gated:
            if backend == "skinny_split":
                raise ValueError("the skinny kernel's split-K form takes no gated product")
            return kernels.skinny_gate_up_silu(rows, weight).view(*x.shape[:-1], weight.shape[0] // 2)
        split = backend == "skinny_split"
        return kernels.skinny_linear(rows, weight, bias, split_k=split).view(*x.shape[:-1], weight.shape[0])
    out = None
    if backend == "cublaslt_algo":
        if algo is None:
            raise ValueError("the cublaslt_algo backend needs a cuBLASLt algorithm")
        try:
            out = kernels.cublaslt_linear(x.reshape(-1, x.shape[-1]), weight, bias, algo)
            out = out.view(*x.shape[:-1], weight.shape[0])
        except ValueError as exc:
            if algo not in _REFUSED:
                _REFUSED.add(algo)
                log.warning("the GEMM plan's cuBLASLt algorithm was refused (%s); cuBLASLt's own choice "
                            "instead", exc)
    if out is None:
        with kernels.blas_library("cublaslt" if backend.startswith("cublaslt") else None):
            out = F.linear(x, weight, bias)
    return kernels.silu_and_mul(out) if gated else out


def _graph_backend(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                   gated: bool) -> tuple[str, str | None] | None:
    """(backend, cuBLASLt algorithm or None) of this product inside graph_gemms() (on CUDA, not in
    deterministic mode), else None (F.linear as eagerly): eager calls pay one context lookup."""
    state = _GRAPH_GEMMS.get()
    if state is None or not x.is_cuda or determinism.deterministic():
        return None
    rows = x.reshape(-1, x.shape[-1])
    rule = "skinny" if kernels.skinny_usable(rows, weight, gated) else "cublas"
    if state is _RULE:
        return rule, None
    split = rule == "skinny" and not gated and kernels.skinny_usable(rows, weight, split_k=True)
    algos = None if state.lt_version is None else (  # None: no cuBLASLt binding in this process
        lambda: kernels.cublaslt_algos(rows, weight, None if gated else bias, ALGOS,
                                       WIDE_ALGOS if state.wide else 0))
    backend = state.backend(
        rows.shape[0], weight, gated, rule,
        lambda backend, w, algo=None: lambda: _product(backend, x, w, bias, gated, algo), split, algos)
    return backend, state.algo(rows.shape[0], weight, gated) if backend == "cublaslt_algo" else None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ weight[N, K].T + bias -> [..., N]. In deterministic mode a row's result does not
    depend on the other rows (`kernels.batch_invariant_matmul`; cuBLAS picks its kernel by M)."""
    if not determinism.deterministic():
        chosen = _graph_backend(x, weight, bias, gated=False)
        return F.linear(x, weight, bias) if chosen is None else _product(chosen[0], x, weight, bias, False,
                                                                          chosen[1])
    out = kernels.batch_invariant_matmul(x.reshape(-1, x.shape[-1]), weight, bias)  # [M, N]
    return out.view(*x.shape[:-1], weight.shape[0])


def tp_all_reduce(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    """Sum of x over the tensor-parallel ranks, in place. In deterministic mode the ranks' tensors are
    gathered and summed in rank order in float32 (NCCL's all-reduce picks its algorithm, hence its
    summation order, by the message size); every shape is x's, so it stays capturable in a CUDA graph."""
    if tp_size == 1:
        return x
    if not determinism.deterministic():
        dist.all_reduce(x)
        return x
    parts = torch.empty((tp_size, *x.shape), dtype=x.dtype, device=x.device)  # [tp, ...]
    if dist.get_backend() == "nccl":
        dist.all_gather_into_tensor(parts, x.contiguous())
    else:
        dist.all_gather(list(parts.unbind(0)), x.contiguous())
    total = parts[0].float()
    for rank in range(1, tp_size):
        total = total + parts[rank].float()
    return x.copy_(total)


def tp_all_gather_last_dim(x: torch.Tensor, tp_size: int) -> torch.Tensor:
    if tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size)]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=-1)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(
            f"{what}: checkpoint shard has shape {tuple(src.shape)}, expected {tuple(dst.shape)}"
        )
    dst.copy_(src)


def _check_full_shape(full, expected: tuple[int, ...], what: str) -> None:
    """The whole checkpoint tensor must have the unsharded shape (a shard of a wrong-shaped tensor
    could otherwise fit by accident)."""
    if tuple(full.shape) != tuple(expected):
        raise ValueError(
            f"{what}: checkpoint tensor has shape {tuple(full.shape)}, expected {tuple(expected)} "
            "(this rank's shard exceeds it or leaves part of it unread)"
        )


def _divide(n: int, tp_size: int, what: str) -> int:
    if n % tp_size:
        raise ValueError(f"{what} = {n} is not divisible by the tensor-parallel size {tp_size}")
    return n // tp_size


class _ParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)  # [out, in]
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)  # [out]
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)

    def weight_loader(
        self, param: nn.Parameter, full: torch.Tensor, shard_id: str | int | None = None
    ) -> None:
        raise NotImplementedError


class ColumnParallelLinear(_ParallelLinear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__(in_features, _divide(out_features, tp_size, "out_features"), bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        rows = param.shape[0]
        _check_full_shape(full, (rows * self.tp_size, *param.shape[1:]), "column-parallel")
        _copy_checked(param.data, full.narrow(0, self.tp_rank * rows, rows), "column-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs fused into one matmul (e.g. gate_proj and up_proj)."""

    def __init__(
        self, in_features: int, out_sizes: list[int], bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        self.out_sizes_per_rank = [_divide(n, tp_size, "out_features") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), bias, tp_rank, tp_size)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """kernels.silu_and_mul(self(x)) for a gate | up pair: [..., I/tp]. Inside graph_gemms(), one
        launch where the skinny kernel applies (its epilogue rounds as the two ops do)."""
        sizes = self.out_sizes_per_rank
        if self.bias is None and len(sizes) == 2 and sizes[0] == sizes[1]:
            chosen = _graph_backend(x, self.weight, None, gated=True)
            if chosen is not None:
                return _product(chosen[0], x, self.weight, None, True, chosen[1])
        return kernels.silu_and_mul(self(x))

    def weight_loader(self, param, full, shard_id=None):
        if shard_id is None:  # a checkpoint that fuses them too (Phi-3's gate_up_proj): each part
            totals = [n * self.tp_size for n in self.out_sizes_per_rank]
            _check_full_shape(full, (sum(totals), *param.shape[1:]), "fused merged")
            for i, total in enumerate(totals):
                self.weight_loader(param, full.narrow(0, sum(totals[:i]), total), i)
            return
        size = self.out_sizes_per_rank[shard_id]
        offset = sum(self.out_sizes_per_rank[:shard_id])
        _check_full_shape(full, (size * self.tp_size, *param.shape[1:]), f"merged shard {shard_id}")
        shard = full.narrow(0, self.tp_rank * size, size)
        _copy_checked(param.data.narrow(0, offset, size), shard, f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections fused; each rank holds its query heads and its KV heads.

    When there are fewer KV heads than ranks, KV heads are replicated (rank r holds head r * kv // tp).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        tp_rank: int = 0,
        tp_size: int = 1,
    ):
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "num_attention_heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "num_key_value_heads")
            self.kv_head_start = tp_rank * self.num_kv_heads
        else:
            self.num_kv_heads = 1
            self.kv_head_start = tp_rank * num_kv_heads // tp_size
        self.total_heads = {"q": num_heads, "k": num_kv_heads, "v": num_kv_heads}
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        _ParallelLinear.__init__(self, hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        if shard_id is None:  # a checkpoint's fused [q; k; v] (Phi-3's qkv_proj): each part
            rows = [self.total_heads[p] * self.head_dim for p in ("q", "k", "v")]
            _check_full_shape(full, (sum(rows), *param.shape[1:]), "fused qkv")
            for i, part in enumerate(("q", "k", "v")):
                self.weight_loader(param, full.narrow(0, sum(rows[:i]), rows[i]), part)
            return
        if shard_id not in self.total_heads:
            raise ValueError(f"QKV shard id must be q, k or v, got {shard_id!r}")
        expected = (self.total_heads[shard_id] * self.head_dim, *param.shape[1:])
        _check_full_shape(full, expected, f"qkv shard {shard_id}")
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q_rows), full.narrow(0, self.tp_rank * q_rows, q_rows)
        else:
            offset = q_rows + (kv_rows if shard_id == "v" else 0)
            dst = param.data.narrow(0, offset, kv_rows)
            src = full.narrow(0, self.kv_head_start * self.head_dim, kv_rows)
        _copy_checked(dst, src, f"qkv shard {shard_id}")

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return qkv.split([q_rows, kv_rows, kv_rows], dim=-1)


class RowParallelLinear(_ParallelLinear):
    def __init__(
        self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0, tp_size: int = 1
    ):
        super().__init__(_divide(in_features, tp_size, "in_features"), out_features, bias, tp_rank, tp_size)

    def weight_loader(self, param, full, shard_id=None):
        if param.dim() == 1:  # the bias is added once, after the all-reduce
            _copy_checked(param.data, full.narrow(0, 0, full.shape[0]), "row-parallel bias")
            return
        cols = param.shape[1]
        _check_full_shape(full, (param.shape[0], cols * self.tp_size), "row-parallel")
        _copy_checked(param.data, full.narrow(1, self.tp_rank * cols, cols), "row-parallel")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = tp_all_reduce(linear(x, self.weight), self.tp_size)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding whose vocabulary rows are split by rank (padded so every rank holds as many)."""

    def __init__(self, vocab_size: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1):
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.vocab_size = vocab_size
        self.num_rows = -(-vocab_size // tp_size)
        self.vocab_start = tp_rank * self.num_rows
        self.weight = nn.Parameter(torch.empty(self.num_rows, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param, full, shard_id=None):
        _check_full_shape(full, (self.vocab_size, param.shape[1]), "vocabulary table")
        rows = max(0, min(self.num_rows, full.shape[0] - self.vocab_start))
        param.data.zero_()
        _copy_checked(param.data.narrow(0, 0, rows), full.narrow(0, self.vocab_start, rows), "vocab shard")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, D]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return tp_all_reduce(out, self.tp_size)


class ParallelLMHead(VocabParallelEmbedding):
    """Vocabulary projection split by rank; logits are gathered to the full vocabulary."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = tp_all_gather_last_dim(linear(hidden, self.weight), self.tp_size)  # [S, V_padded]
        return logits[..., : self.vocab_size]


def projection_weights(model: nn.Module) -> list[torch.Tensor]:
    """The weights `linear` multiplies by: every parallel linear layer's and the LM head's."""
    return [m.weight for m in model.modules() if isinstance(m, (_ParallelLinear, ParallelLMHead))]
