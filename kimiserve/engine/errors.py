"""Which exceptions inside an engine step one request can be blamed for, and which end the engine.

A step that raises is not the end of the engine: the engine blames the request it can trace the
error to and fails that request alone (see `LLMEngine.step`). Some errors leave nothing to go on
with, whatever the request: the device is in an error state (a CUDA error is sticky: every later
kernel fails), the process is out of host memory, or it is being interrupted. Those are fatal:
they propagate out of `step()`, and a server exits so that its supervisor restarts it.
"""

from __future__ import annotations

import re

import torch

_STICKY_DEVICE_ERROR = re.compile(
    r"CUDA error|CUBLAS_STATUS|CUDNN_STATUS|cuDNN error|device-side assert|illegal memory access|"
    r"unspecified launch failure|NCCL error|misaligned address|an illegal instruction")
_ACCELERATOR_ERROR = getattr(torch, "AcceleratorError", None)


def is_fatal_error(exc: BaseException) -> bool:
    """True when `exc` leaves the engine unusable for every request, not only the one it came from."""
    if not isinstance(exc, Exception) or isinstance(exc, (MemoryError, EngineFatalError)):
        return True
    if _ACCELERATOR_ERROR is not None and isinstance(exc, _ACCELERATOR_ERROR):
        return True
    if isinstance(exc, torch.OutOfMemoryError):
        return False  # not sticky: the step is retried without the request that needed the memory
    return isinstance(exc, RuntimeError) and _STICKY_DEVICE_ERROR.search(str(exc)) is not None


class EngineFatalError(RuntimeError):
    """The engine cannot go on (raised from `LLMEngine.step`, the cause chained)."""


REQUEST_FAILED_MESSAGE = ("the request failed inside the engine (an internal error, logged by the server under "
                          "request id {request_id}); other requests are unaffected, so it may be retried")
"""What a failed request's client is told: no internal details."""
