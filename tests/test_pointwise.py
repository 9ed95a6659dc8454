"""kimiserve.ops.pointwise: each element's bits do not depend on the tensor around it (its length, where
the element falls, strides, a thread split), and the vector-path forms keep torch's own bits wherever torch
runs an element through its vectorised body."""

import pytest
import torch
import torch.nn.functional as F

from kimiserve.ops import pointwise

VECTOR_FORMS = [(pointwise.vector_sigmoid, torch.sigmoid), (pointwise.vector_silu, F.silu),
                (pointwise.vector_softplus, F.softplus)]
EXP_FORMS = [pointwise.sigmoid, pointwise.silu, pointwise.softplus]


def assert_position_invariant(fn, x: torch.Tensor):
    whole = fn(x)
    for n in (1, 3, 17, 31, 33, 63, 65, 100):
        assert torch.equal(fn(x[:n]), whole[:n]), n
        assert torch.equal(fn(x[5:5 + n]), whole[5:5 + n]), n
    assert torch.equal(fn(torch.stack([x, x], 1)[:, 0]), whole)  # strided
    assert torch.equal(torch.cat([fn(x[i:i + 1]) for i in range(0, x.numel(), 37)]), whole[::37])  # alone


@pytest.mark.parametrize("fn", [torch.exp, torch.log, torch.tanh, torch.rsqrt, torch.sqrt, torch.log1p])
def test_the_functions_the_exp_forms_build_on_do_not_depend_on_position(fn):
    """What the exp forms and the batch-invariant ops rely on (torch.sigmoid / F.silu / F.softplus do not
    hold this: see the module's doc)."""
    assert_position_invariant(fn, torch.randn(5000, generator=torch.Generator().manual_seed(6)).abs() * 3 + 1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fn", [f for f, _ in VECTOR_FORMS] + EXP_FORMS)
def test_an_element_gets_the_same_bits_anywhere(fn, dtype):
    x = (torch.randn(5003, generator=torch.Generator().manual_seed(0)) * 6).to(dtype)
    assert_position_invariant(fn, x)
    # past one serial slice: the slices stay whole vector blocks
    big = (torch.randn(3 * pointwise.SERIAL_SLICE + 77, generator=torch.Generator().manual_seed(1)) * 6).to(dtype)
    assert torch.equal(fn(big)[-500:], fn(big[-500:]))


@pytest.mark.parametrize("fn,torch_fn", VECTOR_FORMS)
def test_vector_forms_keep_torchs_vector_body_bits(fn, torch_fn):
    """On a tensor of whole vector blocks torch runs no scalar tail: the same bits as torch; any shape
    comes back as it went in, with values within rounding of torch's everywhere."""
    x = torch.randn(4 * pointwise.VECTOR_BLOCK, generator=torch.Generator().manual_seed(2)) * 6
    assert torch.equal(fn(x), torch_fn(x))
    y = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(3)) * 6
    out = fn(y.transpose(0, 2))
    assert out.shape == (7, 5, 3)
    # torch's own result puts the last elements through its scalar tail: up to a few fp32 ulps apart
    # (the vector bodies use their own exp approximations: Sleef u10 / u20 by function and capability)
    torch.testing.assert_close(out, torch_fn(y.transpose(0, 2)), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn,torch_fn", [(pointwise.sigmoid, torch.sigmoid), (pointwise.silu, F.silu),
                                         (pointwise.softplus, F.softplus)])
def test_exp_forms_are_the_functions(fn, torch_fn):
    x = torch.randn(1000, generator=torch.Generator().manual_seed(4)) * 30
    torch.testing.assert_close(fn(x), torch_fn(x))
    xg = x[:100].clone().requires_grad_()
    xr = x[:100].clone().requires_grad_()
    (g,) = torch.autograd.grad(fn(xg).sum(), xg)
    (r,) = torch.autograd.grad(torch_fn(xr).sum(), xr)
    torch.testing.assert_close(g, r)


def test_vector_forms_differentiate():
    x = torch.randn(77, generator=torch.Generator().manual_seed(5), requires_grad=True)
    (g,) = torch.autograd.grad(pointwise.vector_sigmoid(x).sum(), x)
    s = torch.sigmoid(x.detach())
    torch.testing.assert_close(g, s * (1 - s))
