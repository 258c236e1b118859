"""Copies from the host to a GPU that do not make the host wait: through page-locked (pinned) staging memory, so a
copy is queued behind the GPU's work and the host goes on. (From ordinary memory CUDA copies through a bounce buffer,
which holds the host until the copy is done, and so until the work queued before it is.) torch's host allocator
keeps each staging block until its copy is done. Elsewhere (the CPU, Triton's interpreter) a plain copy."""
from __future__ import annotations

import torch


def _pinned(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_available()


def staged(tensor: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """`tensor` (on the host) on `device`."""
    device = torch.device(device)
    if not _pinned(device):
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def staged_together(device: torch.device | str, *tensors: torch.Tensor) -> list[torch.Tensor]:
    """Integer host tensors on `device` in one copy: side by side in one int64 staging buffer, sliced apart there
    (each keeps its shape; int64)."""
    device = torch.device(device)
    sizes = [t.numel() for t in tensors]
    staging = torch.empty(sum(sizes), dtype=torch.int64, pin_memory=_pinned(device))
    torch.cat([t.reshape(-1).to(torch.int64) for t in tensors], out=staging)
    moved = staging.to(device, non_blocking=_pinned(device))
    return [part.view(t.shape) for part, t in zip(moved.split(sizes), tensors)]
