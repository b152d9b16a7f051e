"""cuBLASLt's matmul with an algorithm of our choosing, called through ctypes.

torch.matmul asks cuBLAS(Lt)'s heuristic for one algorithm per shape and runs it. For decode batches
of 96-512 rows that one choice streams llama3-8b's weights at 0.52-0.88 of their bound on an H200
(docs/benchmarks.md round 20). The same heuristic also lists the algorithms it ranks below its first
(other tiles, split-K counts, stages, cluster shapes); `LtMatmul.algos` returns them and
`LtMatmul.run` runs any one, so the GEMM plan can time them on this GPU and keep the fastest
(executor_svc/layers/gemm_plan.py, backend "cublaslt_algo"). An algorithm is cuBLASLt's
`cublasLtMatmulAlgo_t`: 64 bytes that NVIDIA documents as serializable for one library version, kept
here as `Algo.data`; `cublasLtMatmulAlgoCheck` says whether saved bytes still fit a product.

The product is the layers' `x [M, K] @ w [N, K].T (+ bias [N])` in bf16 or fp16 with float32
accumulation, computed column-major as D [N, M] = op_T(w) @ x (the "TN" layout), bias through
cuBLASLt's epilogue. One 32 MiB workspace per device serves every call of a stream in order (a CUDA
graph records its address, so it is never freed).

How we know it works: tests/gpu/test_cublaslt_gpu.py (every listed algorithm against an fp32
reference, with and without bias, eager and in a CUDA graph, the same bits twice; saved bytes
checked and refused for another shape). Only CUDA processes import this module (it opens the
libcublasLt that torch loaded); tests/unit/test_gemm_plan.py covers the plan's use of it on the CPU.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

# cuBLAS / CUDA enum values (cublasLt.h, library_types.h; checked on the device's CUDA 13 headers)
_CUDA_R_32F, _CUDA_R_16F, _CUDA_R_16BF = 0, 2, 14
_COMPUTE_32F = 68
_OP_N, _OP_T = 0, 1
_DESC_TRANSA, _DESC_TRANSB, _DESC_EPILOGUE, _DESC_BIAS_POINTER = 3, 4, 7, 8
_EPILOGUE_DEFAULT, _EPILOGUE_BIAS = 1, 4
_PREF_MAX_WORKSPACE_BYTES = 1
# cublasLtMatmulAlgoConfigAttributes_t, in order: what `Algo.describe` names
_CONFIG_NAMES = ("id", "tile", "split_k", "reduction", "swizzle", "custom", "stages", "inner", "cluster")
_CONFIG_SIZES = (4, 4, 4, 4, 4, 4, 4, 2, 2)

WORKSPACE_BYTES = 32 * 1024 * 1024
MAX_ALGOS = 16  # heuristic candidates asked for per product

_DTYPES = {torch.bfloat16: _CUDA_R_16BF, torch.float16: _CUDA_R_16F}


class _AlgoStruct(ctypes.Structure):
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", _AlgoStruct), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


assert ctypes.sizeof(_AlgoStruct) == 64 and ctypes.sizeof(_HeuristicResult) == 96


@dataclass(frozen=True, slots=True)
class Algo:
    """One cuBLASLt algorithm: its 64 serialized bytes (every call gets the whole WORKSPACE_BYTES)."""

    data: bytes

    def struct(self) -> _AlgoStruct:
        algo = _AlgoStruct()
        ctypes.memmove(ctypes.byref(algo), self.data, 64)
        return algo

    def hex(self) -> str:
        return self.data.hex()

    @classmethod
    def from_hex(cls, text: str) -> Algo:
        """ValueError unless `text` is 64 bytes of hex."""
        data = bytes.fromhex(text)
        if len(data) != 64:
            raise ValueError(f"a cuBLASLt algorithm is 64 bytes, got {len(data)}")
        return cls(data)

    def describe(self) -> str:
        """Its configuration (algorithm id, tile id, split-K count, ...), for logs and benchmarks."""
        lib, algo, parts = _lib(), self.struct(), []
        for attr, (name, size) in enumerate(zip(_CONFIG_NAMES, _CONFIG_SIZES, strict=True)):
            value, written = ctypes.c_uint64(0), ctypes.c_size_t(0)
            if lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value),
                                                         size, ctypes.byref(written)) == 0:
                parts.append(f"{name}={value.value}")
        return " ".join(parts)


_LIB = None
_LOCK = threading.Lock()
_HANDLES: dict[int, ctypes.c_void_p] = {}
_WORKSPACES: dict[int, torch.Tensor] = {}


def _lib():
    """The libcublasLt torch loaded (one library, one version, in the process)."""
    global _LIB
    if _LIB is None:
        if not torch.cuda.is_available():
            raise RuntimeError("cuBLASLt needs a CUDA build of torch and a GPU")
        torch.cuda.current_blas_handle()  # cuBLAS (and with it cuBLASLt) loaded and initialised
        path = None
        with open("/proc/self/maps") as maps:
            for line in maps:
                if "libcublasLt.so" in line:
                    path = line.split()[-1]
                    break
        lib = ctypes.CDLL(path or "libcublasLt.so")
        c_void_p, c_int, c_size_t = ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
        pointer = ctypes.POINTER
        signatures = {
            "cublasLtCreate": [pointer(c_void_p)],
            "cublasLtMatmulDescCreate": [pointer(c_void_p), c_int, c_int],
            "cublasLtMatmulDescSetAttribute": [c_void_p, c_int, c_void_p, c_size_t],
            "cublasLtMatmulDescDestroy": [c_void_p],
            "cublasLtMatrixLayoutCreate": [pointer(c_void_p), c_int, ctypes.c_uint64, ctypes.c_uint64,
                                           ctypes.c_int64],
            "cublasLtMatrixLayoutDestroy": [c_void_p],
            "cublasLtMatmulPreferenceCreate": [pointer(c_void_p)],
            "cublasLtMatmulPreferenceSetAttribute": [c_void_p, c_int, c_void_p, c_size_t],
            "cublasLtMatmulPreferenceDestroy": [c_void_p],
            "cublasLtMatmulAlgoGetHeuristic": [c_void_p] * 7 + [c_int, pointer(_HeuristicResult),
                                                                pointer(c_int)],
            "cublasLtMatmulAlgoCheck": [c_void_p] * 6 + [pointer(_AlgoStruct), pointer(_HeuristicResult)],
            "cublasLtMatmulAlgoConfigGetAttribute": [pointer(_AlgoStruct), c_int, c_void_p, c_size_t,
                                                     pointer(c_size_t)],
            "cublasLtMatmulAlgoConfigSetAttribute": [pointer(_AlgoStruct), c_int, c_void_p, c_size_t],
            "cublasLtMatmulAlgoCapGetAttribute": [pointer(_AlgoStruct), c_int, c_void_p, c_size_t,
                                                  pointer(c_size_t)],
            "cublasLtMatmul": [c_void_p] * 12 + [pointer(_AlgoStruct), c_void_p, c_size_t, c_void_p],
        }
        for name, argtypes in signatures.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, c_int
        lib.cublasLtGetVersion.argtypes, lib.cublasLtGetVersion.restype = [], c_size_t
        _LIB = lib
    return _LIB


def version() -> int:
    """cuBLASLt's version (a saved algorithm is valid for this version only)."""
    return int(_lib().cublasLtGetVersion())


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RuntimeError(f"cuBLASLt {what} failed with status {status}")


def _handle(device: torch.device) -> ctypes.c_void_p:
    index = device.index if device.index is not None else torch.cuda.current_device()
    with _LOCK:
        if index not in _HANDLES:
            handle = ctypes.c_void_p()
            with torch.cuda.device(index):
                _check(_lib().cublasLtCreate(ctypes.byref(handle)), "create")
            _HANDLES[index] = handle
            _WORKSPACES[index] = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=f"cuda:{index}")
        return _HANDLES[index]


class LtMatmul:
    """One product shape (rows, n, k, dtype, with or without bias) on one device: its descriptors made
    once; `algos()` lists the heuristic's candidates, `run(x, w, bias, algo, out)` computes it."""

    def __init__(self, rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device):
        if dtype not in _DTYPES:
            raise ValueError(f"cuBLASLt products here take bf16 or fp16, not {dtype}")
        if min(rows, n, k) < 1:
            raise ValueError(f"a product of rows {rows}, n {n}, k {k} is empty")
        self.rows, self.n, self.k, self.dtype, self.bias = rows, n, k, dtype, bias
        self.device = torch.device(device)
        lib, kind = _lib(), _DTYPES[dtype]
        self._handle = _handle(self.device)
        self._workspace = _WORKSPACES[self.device.index if self.device.index is not None
                                      else torch.cuda.current_device()]
        self._desc = ctypes.c_void_p()
        _check(lib.cublasLtMatmulDescCreate(ctypes.byref(self._desc), _COMPUTE_32F, _CUDA_R_32F), "desc")
        for attr, value in ((_DESC_TRANSA, _OP_T), (_DESC_TRANSB, _OP_N),
                            (_DESC_EPILOGUE, _EPILOGUE_BIAS if bias else _EPILOGUE_DEFAULT)):
            v = ctypes.c_int32(value)
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, attr, ctypes.byref(v), 4), "desc attr")
        self._layouts = []
        for r, c, ld in ((k, n, k), (k, rows, k), (n, rows, n)):  # w^T stored [K, N]; x [K, M]; D [N, M]
            layout = ctypes.c_void_p()
            _check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(layout), kind, r, c, ld), "layout")
            self._layouts.append(layout)
        self._alpha, self._beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._checked: dict[str, Algo] = {}

    def __del__(self):
        lib = _LIB
        if lib is None:
            return
        for layout in getattr(self, "_layouts", ()):
            lib.cublasLtMatrixLayoutDestroy(layout)
        if getattr(self, "_desc", None):
            lib.cublasLtMatmulDescDestroy(self._desc)

    def _operands(self):
        a, b, d = self._layouts
        return self._handle, self._desc, a, b, d, d

    def algos(self, count: int = MAX_ALGOS) -> list[Algo]:
        """The heuristic's candidates for this product, best-ranked first, each fitting the workspace."""
        lib = _lib()
        pref = ctypes.c_void_p()
        _check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        try:
            limit = ctypes.c_uint64(WORKSPACE_BYTES)
            _check(lib.cublasLtMatmulPreferenceSetAttribute(pref, _PREF_MAX_WORKSPACE_BYTES,
                                                            ctypes.byref(limit), 8), "preference attr")
            results, found = (_HeuristicResult * count)(), ctypes.c_int(0)
            _check(lib.cublasLtMatmulAlgoGetHeuristic(*self._operands(), pref, count, results,
                                                      ctypes.byref(found)), "heuristic")
        finally:
            lib.cublasLtMatmulPreferenceDestroy(pref)
        return [Algo(ctypes.string_at(ctypes.byref(r.algo), 64))
                for r in results[: found.value] if r.state == 0]

    def check(self, algo: Algo) -> Algo:
        """`algo`, if it computes this product within the workspace; ValueError if it cannot (saved
        bytes of another product or library version)."""
        result = _HeuristicResult()
        status = _lib().cublasLtMatmulAlgoCheck(*self._operands(), ctypes.byref(algo.struct()),
                                                 ctypes.byref(result))
        if status != 0 or result.workspace_size > WORKSPACE_BYTES:
            raise ValueError(f"cuBLASLt algorithm {algo.describe()} does not fit a {self.rows} x {self.k} "
                             f"@ {self.n} x {self.k} product here (status {status})")
        return algo

    def run(self, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, algo: Algo,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """x [rows, k] @ w [n, k].T (+ bias [n]) -> out [rows, n] with `algo` (from `algos` or `check`)
        on the current stream."""
        if x.shape != (self.rows, self.k) or w.shape != (self.n, self.k) or x.dtype != self.dtype \
                or w.dtype != self.dtype or (bias is not None) != self.bias:
            raise ValueError(f"this product takes x {(self.rows, self.k)} and w {(self.n, self.k)} "
                             f"{self.dtype}{' and a bias' if self.bias else ''}; got x {tuple(x.shape)} "
                             f"{x.dtype}, w {tuple(w.shape)} {w.dtype}, bias {bias is not None}")
        if not (x.is_contiguous() and w.is_contiguous()):
            raise ValueError("cuBLASLt products here take contiguous x and w")
        if out is None:
            out = torch.empty(self.rows, self.n, dtype=self.dtype, device=x.device)
        lib = _lib()
        if self.bias:
            pointer = ctypes.c_void_p(bias.data_ptr())
            _check(lib.cublasLtMatmulDescSetAttribute(self._desc, _DESC_BIAS_POINTER, ctypes.byref(pointer),
                                                      8), "bias pointer")
        handle, desc, a, b, c, d = self._operands()
        stream = ctypes.c_void_p(torch.cuda.current_stream(x.device).cuda_stream)
        status = lib.cublasLtMatmul(handle, desc, ctypes.byref(self._alpha), ctypes.c_void_p(w.data_ptr()), a,
                                    ctypes.c_void_p(x.data_ptr()), b, ctypes.byref(self._beta),
                                    ctypes.c_void_p(out.data_ptr()), c, ctypes.c_void_p(out.data_ptr()), d,
                                    ctypes.byref(algo.struct()), ctypes.c_void_p(self._workspace.data_ptr()),
                                    WORKSPACE_BYTES, stream)
        _check(status, "matmul")
        return out


    def variants(self, listed: list[Algo], limit: int = 400) -> list[Algo]:
        """Algorithms one configuration attribute away from each listed one (another tile, cluster
        shape, custom option, or split-K count), that cuBLASLt accepts for this product: a wider
        search than the heuristic's list, for kernels.bench (not the engine's plan). At most `limit`."""
        lib, seen, found = _lib(), {a.data for a in listed}, []

        def cap_list(algo, attr) -> list[int]:
            need = ctypes.c_size_t(0)
            if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, None, 0, ctypes.byref(need)):
                return []
            values = (ctypes.c_uint32 * max(1, need.value // 4))()
            if lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, values, need.value,
                                                     ctypes.byref(need)):
                return []
            return list(values[: need.value // 4])

        def cap_int(algo, attr) -> int:
            value, written = ctypes.c_int32(0), ctypes.c_size_t(0)
            lib.cublasLtMatmulAlgoCapGetAttribute(ctypes.byref(algo), attr, ctypes.byref(value), 4,
                                                  ctypes.byref(written))
            return value.value

        for base in listed:
            algo = base.struct()
            changes = [(1, 4, t) for t in cap_list(algo, 6)]  # tile ids
            changes += [(8, 2, c) for c in range(0, 24)]  # cluster shapes (the check refuses the rest)
            changes += [(5, 4, c) for c in range(cap_int(algo, 7) + 1)]  # custom options
            if cap_int(algo, 0):  # split-K: with the output-type reduction
                changes += [(2, 4, k) for k in (1, 2, 3, 4, 6, 8)]
            for attr, size, value in changes:
                variant = base.struct()
                v, config = ctypes.c_uint32(value), lib.cublasLtMatmulAlgoConfigSetAttribute
                if config(ctypes.byref(variant), attr, ctypes.byref(v), size):
                    continue
                if attr == 2 and value > 1:
                    scheme = ctypes.c_uint32(4)  # CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE
                    config(ctypes.byref(variant), 3, ctypes.byref(scheme), 4)
                data = ctypes.string_at(ctypes.byref(variant), 64)
                if data in seen:
                    continue
                seen.add(data)
                try:
                    found.append(self.check(Algo(data)))
                except ValueError:
                    continue
                if len(found) >= limit:
                    return found
        return found

    def checked(self, algo_hex: str) -> Algo:
        """The algorithm of these hex bytes, checked against this product once (ValueError if it does
        not fit: `check`)."""
        found = self._checked.get(algo_hex)
        if found is None:
            found = self._checked[algo_hex] = self.check(Algo.from_hex(algo_hex))
        return found


_PRODUCTS: dict[tuple, LtMatmul] = {}


def product(rows: int, n: int, k: int, dtype: torch.dtype, bias: bool, device: torch.device) -> LtMatmul:
    """The process's one LtMatmul of a shape (descriptors are made once and kept)."""
    device = torch.device(device)
    key = (rows, n, k, dtype, bias, device.index)
    with _LOCK:
        found = _PRODUCTS.get(key)
    if found is None:
        found = LtMatmul(rows, n, k, dtype, bias, device)
        with _LOCK:
            found = _PRODUCTS.setdefault(key, found)
    return found


def _of(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> LtMatmul:
    return product(x.shape[0], weight.shape[0], weight.shape[1], weight.dtype, bias is not None, x.device)


def listed(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           count: int | None = None, wide: int = 0) -> list[str]:
    """cuBLASLt's listed algorithms (hex) for x [M, K] @ weight [N, K].T (+ bias), best-ranked first,
    then up to `wide` of their variants (`LtMatmul.variants`)."""
    lt = _of(x, weight, bias)
    algos = lt.algos(count or MAX_ALGOS)
    return [a.hex() for a in algos + (lt.variants(algos, wide) if wide > 0 else [])]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, algo_hex: str) -> torch.Tensor:
    """x [M, K] @ weight [N, K].T (+ bias) -> [M, N] with the algorithm of these hex bytes (`listed`);
    ValueError if it does not fit this product."""
    lt = _of(x, weight, bias)
    return lt.run(x.contiguous(), weight, bias, lt.checked(algo_hex))
