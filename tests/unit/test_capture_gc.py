"""executor_svc/runner/cuda_graphs.no_cyclic_gc: what `_BucketGraphs.capture` runs its warm-up passes,
GEMM plan timings and captures under. Cyclic garbage is collected once before, and no automatic collection
(whose finalizers would run on the capturing thread, inside a capture) starts until the block ends."""

import gc

import pytest

from executor_svc.runner.cuda_graphs import no_cyclic_gc


class _Cycle:
    """An object in a reference cycle: only the cyclic collector frees it; its finalizer records it."""

    def __init__(self, tag, died: list):
        self.me, self.tag, self.died = self, tag, died

    def __del__(self):
        self.died.append(self.tag)


def test_collects_first_then_holds_off_until_the_end():
    died: list = []
    _Cycle("before", died)
    assert gc.isenabled()
    with no_cyclic_gc():
        assert died == ["before"]  # collected on entry
        assert not gc.isenabled()
        for i in range(20_000):  # far past every generation's threshold: no automatic collection
            _Cycle(i, died)
        assert died == ["before"]
    assert gc.isenabled()
    gc.collect()
    assert len(died) == 20_001  # nothing lost: collected after the block


def test_restores_the_collector_as_it_was_and_on_an_error():
    with pytest.raises(RuntimeError, match="capture failed"), no_cyclic_gc():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_cyclic_gc():
            assert not gc.isenabled()
        assert not gc.isenabled()  # it was off before: left off
    finally:
        gc.enable()
