"""Host arrays onto a torch device without waiting for it, and `is_torch`.

A plain ``torch.from_numpy(a).to(cuda)`` is a blocking copy: torch waits
for the device's stream to finish all the work queued before it (it cannot
tell when the pageable host buffer may be reused). A pass that uploads an
index for each chunk would then wait for each chunk's kernels. Copied
first into page-locked memory (torch's caching host allocator, which keeps
the block until the copy is done), the upload is queued on the stream like
a kernel and the host goes on.
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch


def to_device(a: Any, device: torch.device) -> torch.Tensor:
    """The numpy array a as a tensor on device (a copy; for a CUDA device,
    queued on the current stream without waiting for it)."""
    import torch

    host = torch.from_numpy(np.ascontiguousarray(a))
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def is_torch(x: Any) -> bool:
    """True for a torch.Tensor, without importing torch."""
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)
