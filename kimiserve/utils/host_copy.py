"""Copies between the host and the device, queued without making the host wait."""

from __future__ import annotations

import torch


def queue_host_copy(tensor: torch.Tensor) -> tuple[torch.Tensor, "torch.cuda.Event | None"]:
    """(host tensor, event recorded after its copy). On CUDA the copy goes to pinned memory, non-blocking,
    behind the work queued so far; wait on the event before reading it. Off CUDA: the tensor itself, no event."""
    if tensor.device.type != "cuda":
        return tensor, None
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return host, copied


def queue_device_copy(tensor: torch.Tensor, device) -> torch.Tensor:
    """`tensor` on `device`. A host tensor goes to a CUDA device through pinned memory, non-blocking (the host
    does not wait); a tensor already on a device (or any copy off CUDA) is a plain `.to`."""
    if torch.device(device).type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)
