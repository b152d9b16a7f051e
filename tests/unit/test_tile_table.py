"""The batch-invariant GEMM's tile table (kernels/triton_batch_invariant.py): within an N class every
M bucket keeps BLOCK_M and BLOCK_K, so pasting new bucket configs cannot change a row's bits with the
batch size; tile_config looks n and m up as documented. Plain Python: no kernel runs."""

import pytest
import torch

from kernels import triton_batch_invariant
from kernels.triton_batch_invariant import TILE_TABLE, TileConfig, check_tile_table, tile_config

CUDA = torch.device("cuda")  # tile_config reads the device type only; no GPU is touched


def test_every_m_bucket_of_an_n_class_keeps_block_m_and_block_k():
    assert len(TILE_TABLE) >= 1
    for max_n, buckets in TILE_TABLE:
        configs = [config for _, config in buckets]
        assert all(isinstance(config, TileConfig) for config in configs), max_n
        assert len({config.block_m for config in configs}) == 1, f"n <= {max_n}: BLOCK_M differs by M bucket"
        assert len({config.block_k for config in configs}) == 1, f"n <= {max_n}: BLOCK_K differs by M bucket"


def test_tile_config_keeps_block_m_and_block_k_at_every_m_of_a_weight():
    """The same invariant through the lookup, for weights at and around each class bound."""
    bounds = [max_n for max_n, _ in TILE_TABLE if max_n is not None]
    for n in sorted({1, 4096, 6144, 28672, 128256} | {b + d for b in bounds for d in (0, 1)}):
        shapes = {(c.block_m, c.block_k) for c in (tile_config(n, m, CUDA) for m in range(1, 9000, 7))}
        assert len(shapes) == 1, f"n = {n}: {shapes}"


def test_the_table_is_checked_at_import():
    check_tile_table(TILE_TABLE)  # what the module ran when imported
    assert triton_batch_invariant.TILE_TABLE is TILE_TABLE


def _config(**changes) -> TileConfig:
    return TileConfig(**{**dict(block_m=64, block_n=64, block_k=128, num_warps=4, num_stages=4), **changes})


TABLE = (
    (4096, ((64, _config(block_n=32)), (512, _config(block_n=64)), (None, _config(block_n=128)))),
    (None, ((None, _config(block_m=128, block_k=64)),)),
)


@pytest.mark.parametrize(
    "n, m, block_n, block_m",
    [(1, 1, 32, 64), (4096, 64, 32, 64), (4096, 65, 64, 64), (100, 512, 64, 64), (4096, 513, 128, 64),
     (4097, 1, 64, 128), (128256, 100000, 64, 128)],
)
def test_tile_config_takes_the_first_class_and_bucket_that_hold_n_and_m(n, m, block_n, block_m):
    config = tile_config(n, m, CUDA, table=TABLE)
    assert (config.block_n, config.block_m) == (block_n, block_m)


def test_tile_config_off_cuda_is_the_interpreter_default():
    assert tile_config(4096, 1, torch.device("cpu"), table=TABLE) == TileConfig()


@pytest.mark.parametrize(
    "table, match",
    [
        (((None, ((64, _config()), (None, _config(block_k=64)))),), "must share BLOCK_K"),
        (((None, ((64, _config()), (None, _config(block_m=128)))),), "must share BLOCK_M"),
        # classes may differ from each other
        (((4096, ((None, _config()),)), (None, ((None, _config(block_k=64)),))), None),
        (((None, ((64, _config()), (64, _config()), (None, _config()))),), "ascending"),
        (((None, ((128, _config()), (64, _config()), (None, _config()))),), "ascending"),
        (((None, ((0, _config()), (None, _config()))),), "ascending positive"),
        (((None, ((64.0, _config()), (None, _config()))),), "ascending positive ints"),
        (((None, ((None, _config()), (64, _config()))),), "last max_m"),
        (((None, ((64, _config()),)),), "last max_m"),
        (((4096, ((None, _config()),)),), "last max_n"),
        (((None, ((None, _config()),)), (4096, ((None, _config()),))), "last max_n"),
        ((), "last max_n"),
        (((None, ((None, "bm64"),)),), "needs a TileConfig"),
    ],
)
def test_check_tile_table_refuses_tables_that_could_change_bits_or_miss_rows(table, match):
    if match is None:
        check_tile_table(table)
        return
    with pytest.raises(ValueError, match=match):
        check_tile_table(table)
