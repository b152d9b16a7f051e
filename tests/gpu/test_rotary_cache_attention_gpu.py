"""rotary_cache_attention compiled on the GPU (skipped without CUDA): a decode step's rotary, K/V cache
write and paged attention in one launch must give the bits of the two launches it replaces,
rotary_and_cache then paged_attention, at llama3-8b's attention shapes (32 query / 8 KV heads,
head_dim 128, blocks of 16) and llama2-13b's (40 / 40, no GQA), q, k, v strided views of one QKV
output:

* 1 to 256 sequences of 1 to 3,000 positions (split and unsplit launches; the split count as a
  CUDA graph captures it, for the model's maximum length), bf16 and an FP8 cache;
* a CUDA graph's padding (tokens of no sequence, slot -1; sequences of no query token);
* inside a CUDA graph, replayed on new inputs in the captured tensors (a race between the program that
  writes the step's K/V and the loads that read it back would show here as differing bits).

Bit for bit: equal integer views of every sequence's output row and of both caches.

`python -m tests.gpu.test_rotary_cache_attention_gpu` prints the timing table instead: per sequence
count, 32 calls (a llama3-8b step's layers) in a CUDA graph, fused against the two launches, us per layer.
Both run the fused launch at every size (PAGEDSERVE_FUSED_ROTARY=all; the engine's rule stops at
kernels.FUSED_ROTARY_MAX_SEQS).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

E4M3 = torch.float8_e4m3fn
BLOCK_SIZE, MAX_POSITION = 16, 8192


@pytest.fixture(autouse=True)
def fused_at_every_size(monkeypatch):
    """The fused launch at every sequence count here (the default rule keeps two launches past
    kernels.FUSED_ROTARY_MAX_SEQS)."""
    monkeypatch.setenv("PAGEDSERVE_FUSED_ROTARY", "all")


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[x.element_size()])


def _assert_same_bits(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, what
    differ = int((_bits(got) != _bits(want)).sum())
    assert differ == 0, f"{what}: {differ} of {got.numel()} elements differ"


class DecodeStep:
    """One layer's inputs of a decode step of `num_seqs` sequences (plus padding as a graph pads),
    `refill` drawing new lengths within max_len and new values into the same tensors."""

    def __init__(self, num_seqs, num_heads, num_kv_heads, head_dim, cache_dtype, max_len,
                 num_padding=0, magnitude=1.0):
        from executor_svc.layers.rotary import RotaryEmbedding
        from executor_svc.models.config import RopeConfig

        self.num_seqs, self.max_len, self.magnitude = num_seqs, max_len, magnitude
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        rows, seqs = num_seqs + num_padding, num_seqs + num_padding
        self.blocks_per_seq = -(-max_len // BLOCK_SIZE)
        self.num_blocks = num_seqs * self.blocks_per_seq + 4
        cuda = dict(device="cuda")
        width = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = torch.empty(rows, width, dtype=torch.bfloat16, **cuda)  # [T, (H + 2 KV) * D]
        q, k, v = self.qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], -1)
        self.q = q.view(rows, num_heads, head_dim)
        self.k = k.view(rows, num_kv_heads, head_dim)
        self.v = v.view(rows, num_kv_heads, head_dim)
        self.positions = torch.zeros(rows, dtype=torch.int64, **cuda)
        self.slots = torch.full((rows,), -1, dtype=torch.int64, **cuda)
        self.block_tables = torch.zeros(seqs, self.blocks_per_seq, dtype=torch.int32, **cuda)
        self.seq_lens = torch.zeros(seqs, dtype=torch.int32, **cuda)
        starts = list(range(num_seqs + 1)) + [num_seqs] * num_padding
        self.query_start_loc = torch.tensor(starts, dtype=torch.int32, **cuda)
        shape = (self.num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
        self.caches = [torch.empty(shape, dtype=cache_dtype, **cuda) for _ in range(2)]
        self.initial = [torch.empty_like(c) for c in self.caches]
        self.rope = RotaryEmbedding(head_dim, MAX_POSITION, RopeConfig(theta=500000.0)).cuda()
        self.scale = head_dim**-0.5

    def refill(self, seed: int, all_at_max_len: bool = False) -> DecodeStep:
        gen = torch.Generator(device="cuda").manual_seed(seed)
        n = self.num_seqs
        self.qkv.copy_(torch.randn(self.qkv.shape, generator=gen, device="cuda") * self.magnitude)
        lens = torch.randint(1, self.max_len + 1, (n,), generator=gen, device="cuda")
        lens[0] = self.max_len  # the longest, so the maximum length is reached
        if all_at_max_len:
            lens.fill_(self.max_len)
        tables = torch.randperm(self.num_blocks, generator=gen, device="cuda")[: n * self.blocks_per_seq]
        self.block_tables[:n] = tables.view(n, self.blocks_per_seq).to(torch.int32)
        self.seq_lens[:n] = lens.to(torch.int32)
        last = lens - 1
        self.positions[:n] = last
        rows = torch.arange(n, device="cuda")
        self.slots[:n] = self.block_tables[rows, last // BLOCK_SIZE].long() * BLOCK_SIZE + last % BLOCK_SIZE
        for cache, initial in zip(self.caches, self.initial, strict=True):
            initial.copy_(torch.randn(cache.shape, generator=gen, device="cuda").clamp(-448, 448))
            cache.copy_(initial)
        return self

    def attend_args(self):
        return (self.block_tables, self.seq_lens, self.query_start_loc, 1, MAX_POSITION, self.scale)

    def fused(self, k_scale=1.0, v_scale=1.0) -> torch.Tensor:
        import kernels

        return kernels.rotary_cache_attention(
            self.positions, self.q, self.k, self.v, *self.caches, self.slots, self.rope.cos_cache,
            self.rope.sin_cache, *self.attend_args(), k_scale=k_scale, v_scale=v_scale,
        )

    def unfused(self, k_scale=1.0, v_scale=1.0, caches=None):
        import kernels

        caches = [c.clone() for c in self.initial] if caches is None else caches
        q = kernels.rotary_and_cache(
            self.positions, self.q, self.k, self.v, *caches, self.slots, self.rope.cos_cache,
            self.rope.sin_cache, k_scale, v_scale,
        )
        out = kernels.paged_attention(q, *caches, *self.attend_args(), k_scale=k_scale, v_scale=v_scale)
        return out, caches

    def check(self, out: torch.Tensor, k_scale=1.0, v_scale=1.0) -> None:
        want, caches_want = self.unfused(k_scale, v_scale)
        n = self.num_seqs
        _assert_same_bits(out[:n], want[:n], "attention output")
        for name, got, cache_want in zip(("key cache", "value cache"), self.caches, caches_want, strict=True):
            _assert_same_bits(got, cache_want, name)
        assert not torch.equal(_bits(self.caches[0]), _bits(self.initial[0]))  # the step's keys went in
        assert torch.isfinite(out[:n].float()).all()


LLAMA3, LLAMA2_13B = (32, 8, 128), (40, 40, 128)


@pytest.mark.parametrize("shape", [LLAMA3, LLAMA2_13B], ids=["gqa", "mha"])
@pytest.mark.parametrize(("num_seqs", "max_len"), [(1, 700), (16, 3000), (40, 500), (96, 1200), (256, 600)])
def test_bf16_bit_identical(shape, num_seqs, max_len):
    step = DecodeStep(num_seqs, *shape, torch.bfloat16, max_len).refill(num_seqs + max_len)
    step.check(step.fused())


@pytest.mark.parametrize("shape", [LLAMA3, LLAMA2_13B], ids=["gqa", "mha"])
@pytest.mark.parametrize(("num_seqs", "max_len"), [(8, 2000), (128, 900)])
@pytest.mark.parametrize(("k_scale", "v_scale"), [(1.0, 1.0), (2.0**-4, 0.3)])
def test_fp8_cache_bit_identical(shape, num_seqs, max_len, k_scale, v_scale):
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("the FP8 cache needs compute capability 8.9+")
    step = DecodeStep(num_seqs, *shape, E4M3, max_len, magnitude=20.0).refill(num_seqs)
    step.check(step.fused(k_scale, v_scale), k_scale, v_scale)


def test_graph_padding_bit_identical():
    step = DecodeStep(20, *LLAMA3, torch.bfloat16, 900, num_padding=12).refill(4)
    step.check(step.fused())


@pytest.mark.parametrize(("num_seqs", "max_len"), [(8, 3000), (64, 1000), (160, 400)])
def test_cuda_graph_replays_bit_identical(num_seqs, max_len):
    """Captured once, replayed on three new draws; each replay's output and caches against the two
    launches run eagerly on the same inputs."""
    step = DecodeStep(num_seqs, *LLAMA3, torch.bfloat16, max_len, num_padding=3).refill(0)
    step.fused()  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step.fused()
    for seed in (1, 2, 3):
        step.refill(seed)
        graph.replay()
        torch.cuda.synchronize()
        step.check(out)


def bench() -> None:
    """Per sequence count (context 500 and 1000): 32 calls in one CUDA graph, us per layer."""
    import os

    from kernels.bench import warm_up_gpu
    from kernels.bench_common import time_graph_ms

    os.environ["PAGEDSERVE_FUSED_ROTARY"] = "all"  # every size fused (the rule: FUSED_ROTARY_MAX_SEQS)
    warm_up_gpu()
    layers = 32
    print(f"{torch.cuda.get_device_name()}, bf16, llama3-8b heads; us per layer, "
          f"{layers} layers in one graph")
    print(f"{'seqs x len':>12}{'two launches':>14}{'fused':>10}{'ratio':>8}")
    for max_len in (500, 1000):
        for num_seqs in (8, 16, 32, 64, 128, 256):
            step = DecodeStep(num_seqs, *LLAMA3, torch.bfloat16, max_len).refill(0, all_at_max_len=True)
            times = [
                1000 * time_graph_ms(lambda call=call: [call() for _ in range(layers)]) / layers
                for call in (lambda step=step: step.unfused(caches=step.caches), step.fused)
            ]
            label = f"{num_seqs} x {max_len}"
            print(f"{label:>12}{times[0]:>14.2f}{times[1]:>10.2f}{times[1] / times[0]:>8.3f}", flush=True)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    bench()


if __name__ == "__main__":
    main()
