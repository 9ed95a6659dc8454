"""The batch-invariant decode step's fewer kernels on their Triton forms, under Triton's CPU interpreter (no GPU
needed) and on CUDA: `glue.FEWER_KERNELS` (one invariant matmul over a group's row-stacked weights) with
the glue kernels, in the tiny engine (a sequence alone == in a chunked batch, the trainer == the engine); the
gated RMSNorm kernel reading the gate's heads in place from a column slice of a wider result; the KDA
recurrence's decode form (outputs and snapshots left unfilled) against its general form; the grouped matmul
without its zero fill; a KDA decode step straight from and back to the state pages against the gather,
window and scatter around the same kernels.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_fewer_kernels_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims
from triton_interpreter_shims import ordered_dots_when_interpreted  # noqa: F401 (an autouse fixture)

DEVICE = triton_interpreter_shims.device_or_skip_module()
INTERPRET = DEVICE == "cpu"

from kimiserve.ops.batch_invariant import glue  # noqa: E402
from kimiserve.ops.batch_invariant import reference as bi  # noqa: E402
from kimiserve.ops.batch_invariant import triton_kda, triton_norm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_norm_reads_a_column_slice_gate_in_place(dtype):
    """A gate [N, H, D] viewed from columns of a wider [N, W] result (row stride W, not H * D): the bits of the
    same gate made contiguous, rows alone == among others, close to the torch form."""
    g = torch.Generator().manual_seed(5)
    N, H, D, W = 7, 3, 40, 301
    x = (torch.randn(N, H, D, generator=g) * 2).to(dtype).to(DEVICE)
    w = torch.randn(D, generator=g).to(dtype).to(DEVICE)
    wide = torch.randn(N, W, generator=g).to(dtype).to(DEVICE)
    gate = wide[:, 17 : 17 + H * D].view(N, H, D)
    assert gate.stride() == (W, D, 1)
    got = triton_norm.rms_norm(x, w, 1e-5, gate)
    assert torch.equal(got, triton_norm.rms_norm(x, w, 1e-5, gate.contiguous()))
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), bi._gated_rms_norm_torch(x, gate, w, 1e-5).float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(4, 5), slice(2, 6)):
        assert torch.equal(triton_norm.rms_norm(x[rows], w, 1e-5, gate[rows]), got[rows])


def test_recurrence_decode_form_equals_the_general_form():
    """One-token segments of their own, no snapshot: `decode=True` (o and the snapshots unfilled) gives the o
    and final states of the general form, bit for bit."""
    g = torch.Generator().manual_seed(6)
    N, H, K = 5, 3, 16
    q, k = (torch.nn.functional.normalize(torch.randn(N, H, K, generator=g), dim=-1).to(DEVICE) for _ in range(2))
    v = torch.randn(N, H, K, generator=g).to(DEVICE)
    gate = (-torch.rand(N, H, K, generator=g)).to(DEVICE)
    beta = torch.rand(N, H, generator=g).to(DEVICE)
    state = torch.randn(N, H, K, K, generator=g).to(DEVICE)
    starts = torch.arange(N, device=DEVICE)
    ones = torch.ones(N, dtype=torch.int32, device=DEVICE)
    none = torch.full((N,), -1, dtype=torch.int32, device=DEVICE)
    o, final, snaps = triton_kda.recurrence(q, k, v, gate, beta, state, starts, ones, none, K ** -0.5)
    od, fd, _ = triton_kda.recurrence(q, k, v, gate, beta, state, starts, ones, none, K ** -0.5, decode=True)
    assert torch.equal(od, o) and torch.equal(fd, final) and not snaps.any()


@pytest.mark.parametrize("M,G", [(1, 4), (37, 5), (130, 3)])
def test_grouped_matmul_without_the_zero_fill_writes_every_row(M, G):
    """every_row (no negative group): the output is not zero-filled first, and every row gets the bits of the
    zero-filled form (the output first filled with NaN there to show no row is left unwritten)."""
    from kimiserve.ops.batch_invariant import triton as bi_triton

    g = torch.Generator().manual_seed(M + G)
    x = torch.randn(M, 48, generator=g).to(torch.bfloat16).to(DEVICE)
    w = torch.randn(G, 20, 48, generator=g).to(torch.bfloat16).to(DEVICE)
    plan = bi_triton.TilePlan.of(torch.randint(0, G, (M,), generator=g).to(DEVICE), G)
    want = bi_triton.grouped_matmul(x, w, plan)
    real_empty = torch.empty
    try:
        torch.empty = lambda *a, **k: real_empty(*a, **k).fill_(float("nan"))
        got = bi_triton.grouped_matmul(x, w, plan, every_row=True)
    finally:
        torch.empty = real_empty
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kda_decode_in_place_equals_the_gather_window_and_scatter(dtype):
    """`glue.kda_decode_in_place` (the conv state and the recurrent state read from and written back to their
    pages, strided pools and a column-slice input as the engine has them) == the decode path's gather of the
    pages, window, `kda_conv_norm`, `recurrence` and scatter: the same o and the same pages, bit for bit, the
    other pages untouched."""
    from kimiserve.ops.batch_invariant import triton_glue

    g = torch.Generator().manual_seed(8)
    N, H, K, W, num_pages = 5, 3, 16, 4, 9
    P = H * K
    page = torch.randn(num_pages, 3 * P * (W - 1) + H * K * K + 7, generator=g)  # pages with room past the states
    rec = page[:, : H * K * K].view(num_pages, H, K, K)
    conv_page = torch.randn(num_pages, 3 * P * (W - 1) + 5, generator=g).to(dtype)
    conv = conv_page[:, : 3 * P * (W - 1)].view(num_pages, 3, P, W - 1)
    rec, conv = rec.to(DEVICE), conv.to(DEVICE)
    wide = torch.randn(N, 3 * P + 11, generator=g).to(dtype).to(DEVICE)
    qkv = wide[:, 5 : 5 + 3 * P].view(N, 3, P)
    state_pages = torch.tensor([[7, 0], [2, 1], [4, 3], [0, 5], [8, 6]], device=DEVICE)  # [N, layers]: layer 0's column
    pages = state_pages[:, 0]
    weight = (torch.randn(3, P, W, generator=g) * 0.7).to(DEVICE)
    gate = (-torch.rand(N, H, K, generator=g)).to(DEVICE)
    beta = torch.rand(N, H, generator=g).to(DEVICE)
    # the gather / window / scatter path
    window = torch.cat([conv[pages].float().permute(0, 3, 1, 2), qkv.unsqueeze(1)], 1)
    qh, kh, vh = triton_glue.kda_conv_norm(window, W, weight, H, K).unbind(0)
    rows = torch.arange(N, device=DEVICE)
    o_ref, final, _ = triton_kda.recurrence(qh, kh, vh, gate, beta, rec[pages].float(), rows, torch.ones_like(rows),
                                            torch.full_like(rows, -1), K ** -0.5)
    conv_ref, rec_ref = conv.clone(), rec.clone()
    conv_ref[pages] = window[:, 1:].permute(0, 2, 3, 1).to(dtype)
    rec_ref[pages] = final
    pool = type("Pool", (), {"conv": conv, "recurrent": rec})()
    o = glue.kda_decode_in_place(qkv, gate, beta, pool, pages, weight, H, K)
    assert torch.equal(o, o_ref)
    assert torch.equal(conv, conv_ref) and torch.equal(rec, rec_ref)


SMALL_TILES = {"BM": 64, "BN": 32, "BK": 16, "num_warps": 4, "num_stages": 3}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmul_addend_is_one_rounding_of_the_sum_plus_the_addend(monkeypatch, dtype):
    """`triton.matmul(..., addend=)`: under the interpreter's ordered dots bit for bit the fp32 product plus the
    addend rounded once (on CUDA close to it), with split-K chunks spread over programs (the partials' kernel adds
    it) or in one program (the same bits), a row's bits alone == among others; `reference.linear`'s gradient
    reaches the addend."""
    from kimiserve.ops.batch_invariant import triton as bi_triton

    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 64)
    monkeypatch.setattr(bi_triton, "tile_config", lambda N, K: SMALL_TILES)
    g = torch.Generator().manual_seed(11)
    M, N, K = 37, 70, 200
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(N, K, generator=g) * K ** -0.5).to(dtype).to(DEVICE)
    a = torch.randn(M, N, generator=g).to(dtype).to(DEVICE)
    assert bi_triton.split_k(N, K, SMALL_TILES)[0] > 1
    ref = (bi_triton.matmul(x, w, out_dtype=torch.float32) + a.float()).to(dtype)
    spread = bi_triton.matmul(x, w, out_dtype=dtype, spread=True, addend=a)
    whole = bi_triton.matmul(x, w, out_dtype=dtype, spread=False, addend=a)
    assert torch.equal(spread, whole)
    if INTERPRET:
        assert torch.equal(spread, ref)
    else:
        torch.testing.assert_close(spread.float(), ref.float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    for rows in (slice(0, 1), slice(20, 21), slice(3, 30)):
        assert torch.equal(bi_triton.matmul(x[rows], w, out_dtype=dtype, addend=a[rows]), spread[rows])
    narrow = a[:, 5:9]  # a column slice: row stride N
    assert torch.equal(bi_triton.matmul(x, w[:4], out_dtype=dtype, addend=narrow),
                       bi_triton.matmul(x, w[:4], out_dtype=dtype, addend=narrow.contiguous()))
    with pytest.raises(ValueError, match="addend"):
        bi_triton.matmul(x, w, addend=a[:, :3])
    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    xl, al = x.float().requires_grad_(True), a.float().requires_grad_(True)
    c = torch.randn(M, N, generator=g).to(DEVICE)
    gx, ga = torch.autograd.grad((bi.linear(xl, w.float(), addend=al) * c).sum(), (xl, al))
    torch.testing.assert_close(ga, c)
    torch.testing.assert_close(gx, c @ w.float(), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_norm_and_gate_output_kernels_match_the_torch_forms(monkeypatch, dtype):
    """`glue.layer_norm` and `glue.gate_output` on their Triton forms (`FEWER_KERNELS`): close to the torch forms,
    a row's bits alone == among others, strided inputs as the engine has them, the torch forms' gradients."""
    from kimiserve.ops.batch_invariant import triton_glue

    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    g = torch.Generator().manual_seed(12)
    N, D = 13, 72
    wide = (torch.randn(N, D + 30, generator=g) * 3 + 1).to(dtype).to(DEVICE)
    x = wide[:, 10 : 10 + D]  # a column slice (the index keys of a stacked projection)
    w, b = torch.randn(D, generator=g).to(DEVICE), torch.randn(D, generator=g).to(DEVICE)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    got = glue.layer_norm(x, w, b, 1e-6)
    assert got.dtype == dtype and got.shape == (N, D)
    torch.testing.assert_close(got.float(), bi.layer_norm(x, w, b, 1e-6).float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(6, 7), slice(2, 11)):
        assert torch.equal(triton_glue.layer_norm(x[rows], w, b, 1e-6), got[rows])
    H, dv = 3, 20
    o = torch.randn(H, N, dv, generator=g).to(DEVICE).transpose(0, 1)  # [N, H, dv] fp32, as head_linear returns it
    gate = (torch.randn(N, H * dv + 7, generator=g) * 3).to(dtype).to(DEVICE)[:, 7:]
    out = glue.gate_output(o, gate, dtype)
    assert out.dtype == dtype and out.shape == (N, H * dv)
    torch.testing.assert_close(out.float(), glue._gate_output_torch(o, gate, dtype).float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(6, 7), slice(2, 11)):
        assert torch.equal(triton_glue.gate_output(o[rows], gate[rows], dtype), out[rows])
    xl, wl, bl = x.float().detach().requires_grad_(True), w.clone().requires_grad_(True), b.clone().requires_grad_(True)
    c = torch.randn(N, D, generator=g).to(DEVICE)
    mine = torch.autograd.grad((glue.layer_norm(xl, wl, bl, 1e-6) * c).sum(), (xl, wl, bl))
    theirs = torch.autograd.grad((bi.layer_norm(xl, wl, bl, 1e-6) * c).sum(), (xl, wl, bl))
    for m_, t_ in zip(mine, theirs):
        torch.testing.assert_close(m_, t_)
    ol, gl = o.detach().clone().requires_grad_(True), gate.float().detach().requires_grad_(True)
    c = torch.randn(N, H * dv, generator=g).to(DEVICE)
    mine = torch.autograd.grad((glue.gate_output(ol, gl, torch.float32) * c).sum(), (ol, gl))
    theirs = torch.autograd.grad((glue._gate_output_torch(ol, gl, torch.float32) * c).sum(), (ol, gl))
    for m_, t_ in zip(mine, theirs):
        torch.testing.assert_close(m_, t_)


def test_casts_folded_into_the_kernels_keep_the_bits(monkeypatch):
    """`FOLDED_CASTS`: the KDA output norm of the fp32 recurrence output (the kernel rounds it) == the norm of the
    separately rounded output; the router's product of bf16 rows with its fp32 weight, x cast inside the matmul
    (`linear(..., out_dtype=)`) == the product of the fp32 cast rows; bit for bit."""
    from kimiserve.ops.batch_invariant import triton_norm

    monkeypatch.setattr(glue, "FOLDED_CASTS", True)
    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    g = torch.Generator().manual_seed(13)
    N, H, K = 9, 3, 24
    o = (torch.randn(N, H, K, generator=g) * 2).to(DEVICE)
    gate = torch.randn(N, H * K + 5, generator=g).to(torch.bfloat16).to(DEVICE)[:, 5:].view(N, H, K)
    w = torch.randn(K, generator=g).to(torch.bfloat16).to(DEVICE)
    got = glue.gated_rms_norm(o, gate, w, 1e-5, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, triton_norm.rms_norm(o.to(torch.bfloat16), w, 1e-5, gate))
    x = torch.randn(N, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    rw = torch.randn(8, 64, generator=g).to(DEVICE)
    logits = bi.linear(x, rw, out_dtype=torch.float32)
    assert logits.dtype == torch.float32 and torch.equal(logits, bi.linear(x.float(), rw))


def test_invariant_engine_with_fewer_kernels_is_batch_invariant_and_equals_the_trainer(monkeypatch):
    """The interpret suite's engine == trainer check with `FEWER_KERNELS`, `RESIDUAL_EPILOGUE` and the glue
    kernels on (the stacked groups, the in-place KDA decode, the residual epilogues in prefill, chunked prefill,
    decode and the trainer), the stacked and in-place paths taken."""
    import test_batch_invariant_triton_interpret as base
    from kimiserve.rl import forward

    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    monkeypatch.setattr(glue, "RESIDUAL_EPILOGUE", True)
    monkeypatch.setattr(glue, "FOLDED_CASTS", True)
    monkeypatch.setattr(glue, "KDA_GLUE_KERNELS", True)
    monkeypatch.setattr(glue, "MOE_GLUE_KERNELS", True)
    monkeypatch.setattr(bi, "PLAN_KERNEL_MAX_ROWS", 2048)
    stacked = {"calls": 0}
    real = forward.stacked_weight

    def counted(modules):
        stacked["calls"] += 1
        return real(modules)
    monkeypatch.setattr(forward, "stacked_weight", counted)
    in_place = {"calls": 0}
    real_decode = glue.kda_decode_in_place

    def counted_decode(*a, **kw):
        in_place["calls"] += 1
        return real_decode(*a, **kw)
    monkeypatch.setattr(glue, "kda_decode_in_place", counted_decode)
    base.check_engine_alone_batched_and_trainer(monkeypatch, [21, 4, 13], seed=2, max_tokens=3)
    assert stacked["calls"] > 0 and in_place["calls"] > 0
