"""Shared check of the prefill short-conv kernel against its reference (interpreter and GPU tests)."""

import torch

from conftest import rel_rms
from kimiserve.ops.kda.paged import KDADecodeWeights, short_conv as reference_short_conv


def check_short_conv(T: int, heads: int, head_dim: int, dtype: torch.dtype, device: str, state: bool = True,
                     batch: int = 1, width: int = 4) -> None:
    """q, k, v [batch, T, heads * head_dim] as column slices of one wider packed tensor, from a random bf16
    conv state (or none): the kernel's q, k, v within rounding of the reference's, the new state equal."""
    from kimiserve.ops.conv.triton import short_conv

    g = torch.Generator(device=device).manual_seed(T * 31 + heads)
    randn = lambda *s: torch.randn(*s, generator=g, device=device)  # noqa: E731
    C = heads * head_dim
    packed = randn(batch, T + 5, 3 * C).to(dtype)
    q, k, v = packed[:, 2 : 2 + T, :C], packed[:, 2 : 2 + T, C : 2 * C], packed[:, 2 : 2 + T, 2 * C :]
    weights = KDADecodeWeights(randn(C, width) * 0.5, randn(C, width) * 0.5, randn(C, width) * 0.5,
                               None, None, None, None, 1e-5)
    conv = randn(batch, 3, C, width - 1).to(torch.bfloat16) if state else None
    want = reference_short_conv(q, k, v, weights, heads, conv)
    got = short_conv(q, k, v, weights, heads, conv)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for a, b in zip(got[:3], want[:3]):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.isfinite(a).all()
        err = rel_rms(a.float(), b.float())
        assert err < tol, f"rel RMS {err:.3g}"
    assert got[3].dtype == want[3].dtype and torch.equal(got[3], want[3]), "new conv state"
