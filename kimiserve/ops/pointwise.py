"""Pointwise functions whose every element gets the same bits wherever it sits in a tensor.

On the CPU `torch.sigmoid`, `F.silu` and `F.softplus` run a tensor's vectorised body and its scalar tail
(the last `n % (2 * vector width)` elements) through different code, so an element's bits depend on how
many elements the tensor has and where the element falls: a decode step of 2 sequences and one of 4 give the
same sequence different gates (measured here on AVX2 and AVX-512). `exp`, `log1p` and `+ - * /` do not, so
the forms below, built from those, are functions of the element alone: a batch's composition cannot change
a row's result. The KDA gate and beta, the gated output norm and the batch-invariant ops use them.
"""

from __future__ import annotations

import torch


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
