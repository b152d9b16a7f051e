"""rotary_and_cache compiled on the GPU (skipped without CUDA): one launch per layer for rotary of q
and k and the K/V cache write must give the bits of the two ops it replaces, rotary_embedding then
reshape_and_cache (the Triton kernels the CUDA dispatch ran before), at llama3-8b's attention shapes
(32 query / 8 KV heads, head_dim 128, blocks of 16), with q, k, v strided views of one QKV output:

* bf16 at 1, 7, 256 and 4096 tokens; fp16 and fp32 at 256;
* an FP8 (e4m3) cache (compute capability 8.9+), scales of 1, powers of two and others, with values
  that clamp at +-448;
* inside a CUDA graph: captured once, replayed on new inputs copied into the captured tensors;
* a tiny llama's layers (bf16, compiled kernels) fused and as the models called them before: logits
  and the whole cache.

Bit for bit means equal integer views (torch.equal calls -0.0 and 0.0 equal).

`python -m tests.gpu.test_rotary_and_cache_gpu` prints the timing table instead: per token count,
32 calls (one per layer of llama3-8b) in a CUDA graph, fused against rotary_embedding +
reshape_and_cache, microseconds per layer.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4M3 = torch.float8_e4m3fn
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16
MAX_POSITION = 8192


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    differ = int((_bits(got) != _bits(want)).sum())
    assert differ == 0, f"{what}: {differ} of {got.numel()} elements differ"


def _rope():
    from executor_svc.layers.rotary import RotaryEmbedding
    from executor_svc.models.config import RopeConfig

    return RotaryEmbedding(HEAD_DIM, MAX_POSITION, RopeConfig(theta=500000.0)).cuda()


class Case:
    """The inputs of one layer's call; `refill` draws new values into the same tensors (for graphs)."""

    def __init__(
        self, num_tokens: int, dtype: torch.dtype, cache_dtype: torch.dtype, magnitude: float = 1.0
    ):
        self.num_tokens, self.dtype, self.magnitude = num_tokens, dtype, magnitude
        width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
        self.qkv = torch.empty(num_tokens, width, dtype=dtype, device="cuda")  # [T, (H + 2 KV) * D]
        kv_width = NUM_KV_HEADS * HEAD_DIM
        q, k, v = self.qkv.split([NUM_HEADS * HEAD_DIM, kv_width, kv_width], dim=-1)
        self.q = q.view(num_tokens, NUM_HEADS, HEAD_DIM)  # views of the projection's output, no copies
        self.k = k.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        self.v = v.view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
        self.positions = torch.empty(num_tokens, dtype=torch.int64, device="cuda")
        self.slots = torch.empty(num_tokens, dtype=torch.int64, device="cuda")
        self.num_blocks = -(-num_tokens // BLOCK_SIZE) + 4
        shape = (self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        self.caches = [torch.empty(shape, dtype=cache_dtype, device="cuda") for _ in range(2)]
        self.initial_caches = [torch.empty_like(c) for c in self.caches]
        self.rope = _rope()

    def refill(self, seed: int) -> Case:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.qkv.copy_(torch.randn(self.qkv.shape, generator=gen, device="cuda") * self.magnitude)
        self.positions.random_(0, MAX_POSITION, generator=gen)
        slots = torch.randperm(self.num_blocks * BLOCK_SIZE, generator=gen, device="cuda")[: self.num_tokens]
        slots[1::5] = -1  # padding rows (never the first: one token still writes)
        self.slots.copy_(slots)
        for cache, initial in zip(self.caches, self.initial_caches, strict=True):
            initial.copy_(torch.randn(cache.shape, generator=gen, device="cuda").clamp(-448, 448))
            cache.copy_(initial)
        return self

    def fused(self, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        import kernels

        return kernels.rotary_and_cache(
            self.positions, self.q, self.k, self.v, *self.caches, self.slots,
            self.rope.cos_cache, self.rope.sin_cache, k_scale, v_scale,
        )

    def unfused(self, k_scale=1.0, v_scale=1.0, caches=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """rotary_embedding then reshape_and_cache, into `caches` (default: copies of the caches as they
        were at refill)."""
        import kernels

        caches = [c.clone() for c in self.initial_caches] if caches is None else caches
        q_out, k_out = kernels.rotary_embedding(
            self.positions, self.q, self.k, self.rope.cos_cache, self.rope.sin_cache
        )
        kernels.reshape_and_cache(k_out, self.v, *caches, self.slots, k_scale, v_scale)
        return q_out, caches

    def check(self, q_out: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
        q_want, caches_want = self.unfused(k_scale, v_scale)
        _assert_same_bits(q_out, q_want, "query")
        for name, got, want in zip(("key cache", "value cache"), self.caches, caches_want, strict=True):
            _assert_same_bits(got, want, name)
        written = self.slots[self.slots >= 0]
        assert not torch.equal(_bits(self.caches[0]), _bits(self.initial_caches[0])) or written.numel() == 0


def _needs_fp8() -> None:
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 cache needs compute capability 8.9+")


@pytest.mark.parametrize("num_tokens", [1, 7, 256, 4096])
def test_bf16_bit_identical(num_tokens):
    case = Case(num_tokens, torch.bfloat16, torch.bfloat16).refill(num_tokens)
    case.check(case.fused())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [7, 4096])
def test_bits_of_torchs_ops_as_hugging_face_computes_them(dtype, num_tokens):
    """x * cos + rotate_half(x) * sin in torch ops of the model's dtype (Hugging Face's
    apply_rotary_pos_emb, cos and sin cast to that dtype): each product and the sum rounded. Compiled
    for sm_90 without libdevice's round-to-nearest operations, the kernel fused products into bf16
    FMAs and differed by one unit in up to ~40 % of a head's second half (docs/benchmarks.md round 9)."""
    case = Case(num_tokens, dtype, dtype).refill(num_tokens + 3)
    q_out = case.fused()
    cos = case.rope.cos_cache[case.positions].to(dtype)  # [T, D / 2]
    sin = case.rope.sin_cache[case.positions].to(dtype)
    cos, sin = torch.cat((cos, cos), dim=-1)[:, None, :], torch.cat((sin, sin), dim=-1)[:, None, :]
    for name, x, got in (("query", case.q, q_out), ("key", case.k, None)):
        want = x * cos + _rotate_half(x) * sin  # [T, heads, D]
        if got is None:  # the rotated keys exist only in the cache, at the tokens' slots
            real = case.slots >= 0
            got = case.caches[0].flatten(0, 1)[case.slots[real]]
            want = want[real]
        _assert_same_bits(got, want, name)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_other_dtypes_bit_identical(dtype):
    case = Case(256, dtype, dtype).refill(1)
    case.check(case.fused())


@pytest.mark.parametrize("num_tokens", [1, 7, 4096])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (2.0**-4, 2.0**-6), (0.3, 0.07)])
def test_fp8_cache_bit_identical(num_tokens, k_scale, v_scale):
    """|K|, |V| up to ~5 * 20: at k_scale 2^-4 some K clamp at +-448, most values round."""
    _needs_fp8()
    case = Case(num_tokens, torch.bfloat16, E4M3, magnitude=20.0).refill(num_tokens + 100)
    case.check(case.fused(k_scale, v_scale), k_scale, v_scale)
    if k_scale == 2.0**-4 and num_tokens == 4096:
        assert case.caches[0].float().abs().max() == 448.0  # the clamp was exercised


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, E4M3])
def test_cuda_graph_replays_bit_identical(cache_dtype):
    """Captured at a decode step's shape (32 tokens), replayed twice on new inputs in the same tensors."""
    if cache_dtype == E4M3:
        _needs_fp8()
    scales = (2.0**-3, 0.25) if cache_dtype == E4M3 else (1.0, 1.0)
    case = Case(32, torch.bfloat16, cache_dtype, magnitude=4.0).refill(0)
    case.fused(*scales)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_out = case.fused(*scales)
    for seed in (1, 2):
        case.refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        case.check(q_out, *scales)


def test_tiny_llama_logits_and_cache_bit_identical(tiny_llama_dir, monkeypatch):
    """The model's layers on the GPU (bf16), fused and as the models called them before
    (RotaryEmbedding, then attention with rotated q and k): a prefill of two sequences, then a decode
    step with a padding row."""
    from executor_svc.layers.attention import AttentionMetadata, PagedAttention
    from executor_svc.models.config import ModelConfig
    from executor_svc.models.loader import load_model

    config = ModelConfig.from_dir(tiny_llama_dir)
    model = load_model(tiny_llama_dir, config, torch.bfloat16, torch.device("cuda"))
    i32 = dict(dtype=torch.int32, device="cuda")
    i64 = dict(dtype=torch.int64, device="cuda")
    tables = torch.tensor([[2, 0], [5, 1]], **i32)
    steps = [
        (
            torch.arange(3, 11, **i64), torch.tensor([0, 1, 2, 3, 4, 0, 1, 2], **i64),
            AttentionMetadata(torch.tensor([8, 9, 10, 11, 0, 20, 21, 22], **i64), tables,
                              torch.tensor([5, 3], **i32), torch.tensor([0, 5, 8], **i32), 5, 5),
            torch.tensor([4, 7], **i64),
        ),
        (
            torch.tensor([40, 41, 0], **i64), torch.tensor([5, 3, 0], **i64),
            AttentionMetadata(torch.tensor([1, 23, -1], **i64), tables,
                              torch.tensor([6, 4], **i32), torch.tensor([0, 1, 2], **i32), 1, 6),
            torch.tensor([0, 1], **i64),
        ),
    ]

    def run():
        kv_cache = torch.zeros(config.num_layers, 2, 8, 4, config.num_kv_heads, config.head_dim,
                               dtype=torch.bfloat16, device="cuda")
        with torch.inference_mode():
            logits = [
                model.compute_logits(model(ids, pos, kv_cache, meta)[rows]) for ids, pos, meta, rows in steps
            ]
        return logits, kv_cache

    fused_logits, fused_cache = run()
    fused_forward = PagedAttention.forward

    def unfused_forward(self, q, k, v, kv_cache, meta, rotary=None, positions=None):
        if rotary is not None:
            q, k = rotary(positions, q, k)
        return fused_forward(self, q, k, v, kv_cache, meta)

    monkeypatch.setattr(PagedAttention, "forward", unfused_forward)
    unfused_logits, unfused_cache = run()
    for i, (got, want) in enumerate(zip(fused_logits, unfused_logits, strict=True)):
        _assert_same_bits(got, want, f"logits of step {i}")
    _assert_same_bits(fused_cache, unfused_cache, "kv cache")


def bench() -> None:
    """Per token count: 32 calls in one CUDA graph (a step's layers), fused and unfused, us per layer."""
    from kernels.bench import time_ms, warm_up_gpu

    warm_up_gpu()
    layers = 32
    print(f"{torch.cuda.get_device_name()}, bf16, H {NUM_HEADS} KV {NUM_KV_HEADS} D {HEAD_DIM}; "
          f"us per layer, {layers} layers in one CUDA graph")
    print(f"{'tokens':>7}{'unfused':>10}{'fused':>10}{'ratio':>8}")
    for num_tokens in (1, 8, 32, 64, 256, 1024, 4096):
        case = Case(num_tokens, torch.bfloat16, torch.bfloat16).refill(0)
        times = []
        for call in (lambda case=case: case.unfused(caches=case.caches), case.fused):
            call()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(layers):
                    call()
            times.append(1000 * time_ms(graph.replay) / layers)
        print(f"{num_tokens:>7}{times[0]:>10.2f}{times[1]:>10.2f}{times[1] / times[0]:>8.2f}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    bench()


if __name__ == "__main__":
    main()
