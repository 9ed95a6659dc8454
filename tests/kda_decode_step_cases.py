"""Shared check of the fused KDA decode step (`ops/kda/triton_decode.py`) against the reference
composition (`ops/kda/paged.kda_decode_step`), run on CUDA (test_kda_decode_step.py) and in
Triton's CPU interpreter (test_kda_decode_step_interpret.py)."""

import torch

from conftest import rel_rms
from kimiserve.ops.kda import paged

# (rows, heads, head_dim, conv taps, gate lower bound): head dims that are and are not powers of two
CASES = [(1, 1, 16, 4, -5.0), (3, 5, 24, 4, -5.0), (7, 3, 128, 4, None), (2, 2, 64, 3, -5.0), (5, 4, 40, 2, None)]

# the split form (block_v): (rows, heads, head_dim, conv taps, gate lower bound, V block); V a multiple
# of the block and not (24 = 16 + 8, 40 = 32 + 8), one block and several, a block over V
SPLIT_CASES = [(1, 2, 24, 4, -5.0, 16), (3, 5, 40, 4, None, 32), (7, 3, 128, 4, -5.0, 32), (3, 2, 64, 3, None, 64),
               (7, 4, 40, 2, -5.0, 16), (1, 3, 16, 4, None, 32)]

# the one-launch split form (block_v with counters): the same kinds of sizes; 40 in one 64-column block
# (its only program is the last to arrive), 128 in four
ONE_LAUNCH_CASES = [(1, 2, 24, 4, -5.0, 16), (3, 2, 40, 3, None, 16), (1, 2, 128, 4, None, 32),
                    (7, 1, 16, 2, -5.0, 8), (3, 1, 40, 4, -5.0, 64)]


def page_view(pages: int, shape: tuple[int, ...], dtype, device, gen, scale=1.0, pad=37):
    """Pages of `shape` with a page stride `pad` elements past the page's size (the packed pool's is a multiple of
    16 floats: pad=48 keeps that alignment; the default 37 breaks it)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.randn(pages, n + pad, generator=gen).mul_(scale).to(dtype=dtype, device=device)
    return buf[:, :n].view(pages, *shape)


def nan_filled_empty(monkeypatch):
    """Make torch.empty return NaN-filled float tensors for the rest of the test (outputs and scratch
    the kernel allocates then hold NaN wherever it does not write)."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned)


def check_decode_step(kernel, device, dtype, rows, H, K, W, lower_bound, seed=0, same_as=None, steps=1, exact=False,
                      states_close=1e-6):
    """`kernel` against the reference on random pages, for `steps` decode steps in a row on the same pages
    (each step's fresh inputs); with `same_as` (another kernel, run on its own copy of the pages), their
    outputs and state pages also agree to fp32 rounding (exact: bit for bit)."""
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device)  # noqa: E731
    P = H * K
    inputs = lambda: [*(rnd(rows, P).to(dtype) for _ in range(5)), rnd(rows, H).to(dtype)]  # noqa: E731
    first = inputs()
    weights = paged.KDADecodeWeights(rnd(P, W, scale=0.5), rnd(P, W, scale=0.5), rnd(P, W, scale=0.5),
                                     rnd(H, scale=0.5), rnd(P), lower_bound, 1 + rnd(K, scale=0.1), 1e-5)
    num_pages = rows + 4
    conv = page_view(num_pages, (3, P, W - 1), dtype, device, gen)
    states = page_view(num_pages, (H, K, K), torch.float32, device, gen, scale=0.1)
    page_ids = torch.randperm(num_pages, generator=gen)[:rows].to(device)
    others = torch.ones(num_pages, dtype=torch.bool)
    others[page_ids.cpu()] = False
    others = others.to(device)

    conv_ref, states_ref = conv.clone(), states.clone()
    conv_out, states_out = conv.clone(), states.clone()
    conv_other, states_other = conv.clone(), states.clone()
    bound = 1e-5 if dtype == torch.float32 else 2e-2
    for step in range(steps):
        q, k, v, f, gate, b = first if step == 0 else inputs()
        want = paged.kda_decode_step(q, k, v, f, b, gate, weights, conv_ref, states_ref, page_ids)
        got = kernel(q, k, v, f, b, gate, weights, conv_out, states_out, page_ids)

        assert got.shape == want.shape == (rows, H, K) and got.dtype == dtype
        assert torch.isfinite(got).all(), f"step {step}: non-finite output"
        err = rel_rms(got, want)
        assert err < bound, f"step {step}: output rel RMS {err:.2e} over {bound:.0e}"
        assert torch.equal(conv_out, conv_ref), f"step {step}: conv state pages differ (they hold copies of inputs)"
        err = rel_rms(states_out[page_ids], states_ref[page_ids])
        assert err < bound, f"step {step}: state rel RMS {err:.2e} over {bound:.0e}"
        assert torch.equal(states_out[others], states[others]), "pages of other sequences changed"
        if same_as is not None:
            other = same_as(q, k, v, f, b, gate, weights, conv_other, states_other, page_ids)
            assert torch.isfinite(other).all()
            assert torch.equal(conv_other, conv_out)
            if exact:
                assert torch.equal(states_other, states_out), f"step {step}: state pages not bit-equal"
                assert torch.equal(got, other), f"step {step}: outputs not bit-equal"
            else:
                err = rel_rms(states_other, states_out)
                assert err < states_close, f"step {step}: state pages rel RMS {err:.2e} against the other form"
                assert rel_rms(got, other) < (1e-6 if dtype == torch.float32 else 1e-2)
