"""Host-to-device copies that do not wait for the GPU.

`tensor.to("cuda")` from ordinary (pageable) host memory blocks the calling thread until the copy is
done, and the copy is queued behind everything already on the stream: preparing step i+1 while the
GPU runs step i would wait for step i to end. Copying from pinned memory with `non_blocking=True`
returns at once; torch's caching host allocator keeps the pinned buffer alive until the copy ran.
"""

from __future__ import annotations

import torch


def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, without waiting for work already queued on the GPU."""
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)
