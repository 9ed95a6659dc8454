"""Pointwise functions whose every element gets the same bits wherever it sits in a tensor.

On the CPU `torch.sigmoid`, `F.silu` and `F.softplus` run a tensor's vectorised body and its scalar tail
(the last `n % (2 * vector width)` elements) through different code, so an element's bits depend on how
many elements the tensor has and where the element falls: a decode step of 2 sequences and one of 4 give the
same sequence different gates (measured on AVX2 and AVX-512), and a speculative verify's replay of the KDA
state then differs from the decode steps it stands for. Two remedies, each a function of the element alone:

- `sigmoid`, `silu`, `softplus`: written with `exp`, `log1p` and `+ - * /`, whose vector and scalar paths
  agree. The batch-invariant ops use them (their Triton kernels compute the same expressions).
- `vector_sigmoid`, `vector_silu`, `vector_softplus`: torch's own function with every element on its
  vectorised path (a CPU tensor is flattened, zero-padded to a whole number of vector blocks and run in
  slices too short for torch to split over threads), so each element gets the bits the vectorised body gives
  it anyway: the serving path's KDA gate, beta, short conv and gated output norm, whose bits otherwise stay
  torch's. Other devices run the plain function (no tail path there).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = 1.0 / (1.0 + torch.exp(-x))
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return grad * y * (1.0 - y)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), its gradient y (1 - y) (no inf / inf where exp(-x) overflows)."""
    return _Sigmoid.apply(x)


def silu(x: torch.Tensor) -> torch.Tensor:
    return x * sigmoid(x)


def softplus(x: torch.Tensor) -> torch.Tensor:
    """log(1 + exp(x)), x itself above 20 (torch's threshold)."""
    return torch.where(x > 20, x, torch.log1p(torch.exp(x.clamp(max=20))))


VECTOR_BLOCK = 64
"""Elements padded to a multiple of this: two vectors of every CPU capability torch builds for (AVX-512:
2 x 16 fp32), so no element of the padded tensor falls in a scalar tail."""
SERIAL_SLICE = 1 << 14
"""Elements per call: under torch's parallel grain size (32768), so no call is split over threads at an
arbitrary element (a split inside a vector block would make a tail there)."""


def on_vector_path(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn, each element computed by fn's vectorised body on the CPU."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    pad = -n % VECTOR_BLOCK
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    if flat.numel() <= SERIAL_SLICE:
        out = fn(flat)
    else:
        out = torch.cat([fn(part) for part in flat.split(SERIAL_SLICE)])
    return out[:n].view(x.shape)


def vector_sigmoid(x: torch.Tensor) -> torch.Tensor:
    return on_vector_path(torch.sigmoid, x)


def vector_silu(x: torch.Tensor) -> torch.Tensor:
    return on_vector_path(F.silu, x)


def vector_softplus(x: torch.Tensor) -> torch.Tensor:
    return on_vector_path(F.softplus, x)
