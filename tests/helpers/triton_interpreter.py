"""The Triton interpreter made to work on numpy >= 2.4, and its tl.dot made row-invariant, for the CPU
kernel tests."""

import numpy as np
from triton.runtime import interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor
_create_dot = interpreter.InterpreterBuilder.create_dot


def _patch_lang_tensor_for_numpy_2_4(tensor, scope):
    """The interpreter holds scalars as 1-element arrays and turns them into loop bounds with int(),
    which numpy >= 2.4 refuses for arrays with ndim > 0; .item() works on every numpy."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


def _row_invariant_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
    """tl.dot as the interpreter computes it (np.matmul) gives a row bits that depend on where the row
    sits in the tile on some CPUs: numpy's OpenBLAS picks its kernel by CPU, and on the AVX-512
    development machine of 2026-11-27 its sgemm did (numpy 2.3.5 to 2.4.6 alike; earlier CI machines
    passed the same tests), which breaks the batch-invariance tests of kernels that are batch-invariant
    on the GPU. Here each output element is the sum over k of a[i, k] * b[k, j] in order k = 0, 1, ...,
    in the accumulator's dtype: the same for a row wherever it sits. 8-bit operands and batched (3-D)
    dots keep the interpreter's own path."""
    if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or a.data.ndim != 2:
        return _create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
    acc_dtype = d.data.dtype
    a_data, b_data = a.data.astype(acc_dtype), b.data.astype(acc_dtype)
    out = np.zeros((a_data.shape[0], b_data.shape[1]), dtype=acc_dtype)
    for k in range(a_data.shape[1]):  # [M, 1] * [1, N]: one rounding per product and per sum
        out += a_data[:, k : k + 1] * b_data[k : k + 1, :]
    return interpreter.TensorHandle(out + d.data, d.dtype.scalar)


def patch_interpreter_for_numpy() -> None:
    """Idempotent: wraps the interpreter's tensor patch and replaces its dot once."""
    if interpreter._patch_lang_tensor is not _patch_lang_tensor_for_numpy_2_4:
        interpreter._patch_lang_tensor = _patch_lang_tensor_for_numpy_2_4
    if interpreter.InterpreterBuilder.create_dot is not _row_invariant_dot:
        interpreter.InterpreterBuilder.create_dot = _row_invariant_dot
