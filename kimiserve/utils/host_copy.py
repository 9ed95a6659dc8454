"""A device tensor's copy to the host, queued without waiting."""

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
