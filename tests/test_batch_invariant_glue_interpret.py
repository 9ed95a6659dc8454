"""The batch-invariant forward's glue kernels (`ops.batch_invariant.triton_glue`: KDA gates, KDA short conv +
L2 norms, the router, the slot combine, the one-launch expert plan) under Triton's CPU interpreter (no GPU needed), and on CUDA.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_glue_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims
from triton_interpreter_shims import ordered_dots_when_interpreted  # noqa: F401 (an autouse fixture)

DEVICE = triton_interpreter_shims.device_or_skip_module()
INTERPRET = DEVICE == "cpu"

from kimiserve.ops.batch_invariant import glue  # noqa: E402
from kimiserve.ops.batch_invariant import reference as bi  # noqa: E402
from kimiserve.ops.batch_invariant import triton as bi_triton  # noqa: E402
from kimiserve.ops.batch_invariant import triton_glue  # noqa: E402


@pytest.fixture
def glue_on(monkeypatch):
    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda x: True)
    monkeypatch.setattr(glue, "KDA_GLUE_KERNELS", True)
    monkeypatch.setattr(glue, "MOE_GLUE_KERNELS", True)


def _gate_inputs(N, H, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=g) * scale)  # noqa: E731
    f = (rnd(N, H * K, scale=6) ).to(dtype).to(DEVICE)
    f[0, :3] = torch.tensor([25.0, -40.0, 19.5])  # both sides of softplus's threshold
    b = rnd(N, H, scale=3).to(dtype).to(DEVICE)
    return f, b, rnd(H).to(DEVICE), rnd(H * K).to(DEVICE)


@pytest.mark.parametrize("lower_bound", [None, -5.0])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kda_gates_kernel_matches_the_torch_form_and_rows_do_not_depend_on_the_batch(glue_on, lower_bound, dtype):
    N, H, K = 13, 3, 24
    f, b, a_log, dt_bias = _gate_inputs(N, H, K, dtype, 1)
    g, beta = glue.kda_gates(f, b, a_log, dt_bias, lower_bound, H, K)
    g_ref, beta_ref = glue._kda_gates_torch(f, b, a_log, dt_bias, lower_bound, H, K)
    assert g.shape == (N, H, K) and beta.shape == (N, H) and g.dtype == beta.dtype == torch.float32
    torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(beta, beta_ref, rtol=1e-5, atol=1e-6)
    for rows in (slice(0, 1), slice(7, 8), slice(2, 11)):
        g_r, beta_r = glue.kda_gates(f[rows], b[rows], a_log, dt_bias, lower_bound, H, K)
        assert torch.equal(g_r, g[rows]) and torch.equal(beta_r, beta[rows])
    wide = torch.stack([f, f], 1)[:, 1]  # strided rows
    assert torch.equal(glue.kda_gates(wide, b, a_log, dt_bias, lower_bound, H, K)[0], g)


def _conv_inputs(N, H, K, W, seed):
    g = torch.Generator().manual_seed(seed)
    window = torch.randn(N, W, 3, H * K, generator=g).to(DEVICE)
    return window, (torch.randn(3, H * K, W, generator=g) * 0.7).to(DEVICE)


def test_kda_conv_norm_kernel_matches_the_torch_form_and_prefill_rows_equal_decode_rows(glue_on):
    """The decode form (each row's window) and the prefill form (rows' taps into a packed ext, as
    `InvariantForward.kda_recurrence` builds it) give a row the same bits, alone or among others."""
    N, H, K, W = 11, 3, 20, 4
    window, weight = _conv_inputs(N, H, K, W, 2)
    q, k, v = glue.kda_conv_norm(window, W, weight, H, K)
    for got, want in zip((q, k, v), glue._kda_conv_norm_torch(window, W, weight, H, K)):
        assert got.shape == (N, H, K) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(q.square().sum(-1), torch.ones(N, H, device=DEVICE), rtol=1e-4, atol=1e-4)
    # a prefill segment of rows 3..8: its ext is row 3's window then the later rows' own inputs
    seq = torch.cat([window[3], window[4:9, -1]])  # [W + 5, 3, P]; window[r] for r > 3 chained on it
    chained = torch.stack([seq[j : j + W] for j in range(6)])
    ext = torch.cat([window[0], seq])  # another segment's window first
    taps = torch.arange(W, W + 6, device=DEVICE)
    pq, pk, pv = glue.kda_conv_norm(ext, taps, weight, H, K)
    dq, dk, dv = glue.kda_conv_norm(chained, W, weight, H, K)
    assert torch.equal(pq, dq) and torch.equal(pk, dk) and torch.equal(pv, dv)
    assert torch.equal(dq[0], q[3]) and torch.equal(dv[0], v[3])
    for rows in (slice(0, 1), slice(5, 6), slice(1, 10)):
        assert torch.equal(glue.kda_conv_norm(window[rows], W, weight, H, K)[1], k[rows])


def test_kda_glue_backward_is_the_torch_gradient(glue_on):
    N, H, K, W = 5, 2, 12, 4
    f, b, a_log, dt_bias = (t.float().requires_grad_(True) for t in _gate_inputs(N, H, K, torch.float32, 3))
    for lb in (None, -5.0):
        leaves = (f, b, a_log, dt_bias)
        out, ref = glue.kda_gates(*leaves, lb, H, K), glue._kda_gates_torch(*leaves, lb, H, K)
        c = [torch.randn_like(o) for o in out]
        loss = lambda os: sum((o * ci).sum() for o, ci in zip(os, c))  # noqa: E731
        for x, y in zip(torch.autograd.grad(loss(out), leaves), torch.autograd.grad(loss(ref), leaves)):
            torch.testing.assert_close(x, y)
    window, weight = (t.requires_grad_(True) for t in _conv_inputs(N, H, K, W, 4))
    ext = window.reshape(-1, 3, H * K)
    taps = torch.tensor([0, 5, 9], device=DEVICE)
    for t in (W, taps):
        out, ref = glue.kda_conv_norm(ext, t, weight, H, K), glue._kda_conv_norm_torch(ext, t, weight, H, K)
        c = [torch.randn_like(o) for o in out]
        loss = lambda os: sum((o * ci).sum() for o, ci in zip(os, c))  # noqa: E731
        for x, y in zip(torch.autograd.grad(loss(out), (window, weight)), torch.autograd.grad(loss(ref), (window, weight))):
            torch.testing.assert_close(x, y)


@pytest.mark.parametrize("score_func,renormalize,bias", [("sigmoid", True, True), ("softmax", False, False),
                                                         ("softmax", True, True)])
def test_route_kernel_matches_the_torch_form_and_rows_do_not_depend_on_the_batch(glue_on, score_func, renormalize, bias):
    g = torch.Generator().manual_seed(13)
    N, E, k = 19, 37, 5
    logits = (torch.randn(N, E, generator=g) * 2).to(DEVICE)
    logits[3, 10:20] = 0.5  # exact ties: the smaller id first
    correction = (torch.randn(E, generator=g) * 0.1).to(DEVICE) if bias else None
    kw = dict(score_func=score_func, renormalize=renormalize, scaling_factor=2.5)
    ids, w = glue.route(logits, correction, k, **kw)
    ids_ref, w_ref = bi.route(logits, correction, k, **kw)
    assert ids.dtype == ids_ref.dtype and torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    for rows in (slice(0, 1), slice(3, 4), slice(2, 17)):
        ids_r, w_r = glue.route(logits[rows], correction, k, **kw)
        assert torch.equal(ids_r, ids[rows]) and torch.equal(w_r, w[rows])
    leaf, leaf_ref = logits.clone().requires_grad_(True), logits.clone().requires_grad_(True)
    c = torch.randn(N, k, generator=g).to(DEVICE)
    (glue.route(leaf, correction, k, **kw)[1] * c).sum().backward()
    (bi.route(leaf_ref, correction, k, **kw)[1] * c).sum().backward()
    torch.testing.assert_close(leaf.grad, leaf_ref.grad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_combine_slots_kernel_matches_the_torch_form_rows_alone_and_its_gradient(glue_on, dtype):
    g = torch.Generator().manual_seed(14)
    N, k, D = 9, 3, 1100  # D past one column block
    y = torch.randn(N * k, D, generator=g).to(dtype).to(DEVICE)
    w = torch.rand(N, k, generator=g).to(DEVICE)
    out = glue.combine_slots(y, w, dtype)
    assert out.dtype == dtype and out.shape == (N, D)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), glue._combine_slots_torch(y, w, dtype).float(), rtol=tol, atol=tol)
    for lo, hi in ((0, 1), (4, 5), (2, 8)):
        assert torch.equal(glue.combine_slots(y[lo * k : hi * k], w[lo:hi], dtype), out[lo:hi])
    yl, wl = y.float().requires_grad_(True), w.clone().requires_grad_(True)
    c = torch.randn(N, D, generator=g).to(DEVICE)
    a = torch.autograd.grad((glue.combine_slots(yl, wl, torch.float32) * c).sum(), (yl, wl))
    b = torch.autograd.grad((glue._combine_slots_torch(yl, wl, torch.float32) * c).sum(), (yl, wl))
    for x, z in zip(a, b):
        torch.testing.assert_close(x, z)


@pytest.mark.parametrize("M,G", [(1, 16), (16, 16), (150, 4), (130, 1), (7, 3), (200, 37)])
def test_tile_plan_kernel_is_the_torch_plan(M, G):
    g = torch.Generator().manual_seed(M * 7 + G)
    for groups in (torch.randint(-1, G, (M,), generator=g), torch.full((M,), G - 1), torch.full((M,), -1)):
        groups = groups.to(DEVICE)
        got, want = triton_glue.tile_plan(groups, G), bi_triton.TilePlan.of(groups, G)
        for name in ("order", "tile_group", "tile_start", "tile_end"):
            a, b = getattr(got, name), getattr(want, name)
            assert a.dtype == b.dtype and torch.equal(a, b), (name, groups.tolist())


def test_invariant_engine_on_the_glue_kernels_is_batch_invariant_and_equals_the_trainer(monkeypatch, glue_on):
    """The interpret suite's engine == trainer test with the glue kernels on (the KDA gates and conv + norms,
    the router and the slot combine in prefill, chunked prefill, decode and the trainer; the one-launch
    expert plan), each of them run."""
    import test_batch_invariant_triton_interpret as base

    monkeypatch.setattr(bi, "PLAN_KERNEL_MAX_ROWS", 2048)
    calls = {"gates": 0, "conv": 0, "plan": 0, "route": 0, "combine": 0}
    for name, key in (("kda_gates", "gates"), ("kda_conv_norm", "conv"), ("tile_plan", "plan"), ("route", "route"),
                      ("combine_slots", "combine")):
        fn = getattr(triton_glue, name)

        def counted(*a, _fn=fn, _key=key, **kw):
            calls[_key] += 1
            return _fn(*a, **kw)
        monkeypatch.setattr(triton_glue, name, counted)
    base.test_invariant_engine_on_the_kernels_is_batch_invariant_and_equals_the_trainer(monkeypatch)
    assert all(calls.values()), calls
