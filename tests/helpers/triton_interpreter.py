"""The Triton interpreter made to work on numpy >= 2.4, for the CPU kernel tests."""

from triton.runtime import interpreter

_patch_lang_tensor = interpreter._patch_lang_tensor


def _patch_lang_tensor_for_numpy_2_4(tensor, scope):
    """The interpreter holds scalars as 1-element arrays and turns them into loop bounds with int(),
    which numpy >= 2.4 refuses for arrays with ndim > 0; .item() works on every numpy."""
    _patch_lang_tensor(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))


def patch_interpreter_for_numpy() -> None:
    """Idempotent: wraps the interpreter's tensor patch once."""
    if interpreter._patch_lang_tensor is not _patch_lang_tensor_for_numpy_2_4:
        interpreter._patch_lang_tensor = _patch_lang_tensor_for_numpy_2_4
