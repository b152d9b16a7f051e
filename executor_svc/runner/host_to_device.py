"""Host-to-device copies that do not wait for the GPU.

`tensor.to("cuda")` from ordinary (pageable) host memory blocks the calling thread until the copy is
done, and the copy is queued behind everything already on the stream: preparing step i+1 while the
GPU runs step i would wait for step i to end. Copying from pinned memory with `non_blocking=True`
returns at once; torch's caching host allocator keeps the pinned buffer alive until the copy ran.

A step moves ~16 small tensors (its token and attention columns, the sampling parameters).
`pack_to_device` moves them as one: one pinned host buffer, one copy launch, and on the device one
view of that buffer per tensor, instead of a pinned allocation, a staging copy and a copy launch
per tensor (`to_device`). Layout: each tensor's bytes from an offset that is a multiple of
ALIGNMENT, in the order given; the padding up to the next offset is never read (t3: 0 bytes):

    0                   32                 48                     112                       144
    | t0: int64 [3] pad | t1: bool [3] pad | t2: int32 [3, 5] pad | t3, t4: float32 [7] pad |

Why it is safe not to wait: the buffer is allocated pinned (`torch.empty(pin_memory=True)`) by the
same caching host allocator `pin_memory()` uses, and a non-blocking copy from pinned memory records
an event for that allocation on the copy's stream; when the buffer's last reference dies (at once:
the caller keeps only the device views) the allocator hands the block out again only after that
event passed. The host buffer is written before the copy is queued and never after.
"""

from __future__ import annotations

import torch

# A multiple of every element size (each tensor starts at a whole element of its dtype) and the
# pointer alignment Triton specializes kernels on.
ALIGNMENT = 16

# A tensor's place in the buffer: dtype, shape, contiguous strides, offset in elements of its dtype.
_Slot = tuple[torch.dtype, torch.Size, tuple[int, ...], int]


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without waiting for work already queued on the GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def pack_to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """Each host tensor of `tensors` on `device`, moved in one copy (module docstring): contiguous
    tensors of the same dtypes, shapes and values, views of one device buffer. Pinned on CUDA; on
    other devices the same packing without pinning (so CPU tests exercise it)."""
    layout: list[_Slot] = []
    num_bytes = 0
    for name, tensor in tensors.items():
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{name}: expected a tensor, got {type(tensor).__name__}")
        if tensor.device.type != "cpu":
            raise ValueError(f"{name}: expected a host tensor, got one on {tensor.device}")
        itemsize = tensor.element_size()
        if ALIGNMENT % itemsize:
            raise ValueError(f"{name}: {tensor.dtype} elements do not align to {ALIGNMENT} bytes")
        shape = tensor.shape
        layout.append((tensor.dtype, shape, _contiguous_strides(shape), num_bytes // itemsize))
        num_bytes += -(-tensor.numel() * itemsize // ALIGNMENT) * ALIGNMENT
    host = torch.empty(max(num_bytes, ALIGNMENT), dtype=torch.uint8, pin_memory=device.type == "cuda")
    for tensor, view in zip(tensors.values(), _views(host, layout), strict=True):
        view.copy_(tensor)
    packed = host.to(device, non_blocking=True)
    return dict(zip(tensors, _views(packed, layout), strict=True))


def _views(buffer: torch.Tensor, layout: list[_Slot]) -> list[torch.Tensor]:
    """The tensors of `layout` as views of `buffer` (uint8). One `view(dtype)` of the whole buffer
    per dtype, then `as_strided` per tensor: half the host time of slicing and viewing each one."""
    typed: dict[torch.dtype, torch.Tensor] = {}
    views = []
    for dtype, shape, strides, offset in layout:
        whole = typed.get(dtype)
        if whole is None:
            whole = typed[dtype] = buffer.view(dtype)
        views.append(whole.as_strided(shape, strides, offset))
    return views


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape` (as torch computes them: a 0-size dim counts as 1)."""
    strides = [1] * len(shape)
    for dim in range(len(shape) - 1, 0, -1):
        strides[dim - 1] = strides[dim] * max(shape[dim], 1)
    return tuple(strides)
