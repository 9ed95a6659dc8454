"""Shared checks of the decode step's glue kernels (`DecodeOps.rms_norm`, `add_read_norm`, `route`,
`situ_and_mul`: ops/norm/triton.py, ops/attn_res/triton.py, ops/moe/route_triton.py,
ops/activation/triton.py) against their references, run on CUDA (test_glue_ops.py) and in Triton's
CPU interpreter (test_glue_ops_interpret.py). Every output the kernels allocate starts as NaN (-1 for
integers), so an element a kernel fails to write shows up."""

from __future__ import annotations

import contextlib

import torch

from conftest import rel_rms
from kimiserve.ops.activation import reference as activation_ref
from kimiserve.ops.attn_res import reference as attn_res_ref
from kimiserve.ops.mla import reference as mla_ref
from kimiserve.ops.moe import reference as moe_ref
from kimiserve.ops.norm import reference as norm_ref

DTYPES = [torch.float32, torch.bfloat16]
# relative RMS error allowed: fp32 rounding of other summation orders; bf16: an ulp (2^-8) here and there
BOUND = {torch.float32: 1e-5, torch.bfloat16: 8e-3}

RMS_CASES = [(1, 200), (17, 200), (3, 7168), (5, 33)]  # (rows, hidden): hidden sizes that are not powers of two
ARN_CASES = [  # (rows, hidden, blocks, with the residual add, blocks in one buffer)
    (1, 200, 0, False, True), (17, 200, 0, True, True), (1, 200, 1, True, True), (17, 200, 4, False, True),
    (17, 72, 9, True, True), (5, 200, 3, True, False), (1, 7168, 8, True, True),
]
ROUTE_CASES = [  # (rows, experts, top_k, groups, top groups, score function, bias, renormalise, scale)
    (1, 16, 4, 1, 1, "sigmoid", True, True, 1.0), (17, 37, 5, 1, 1, "sigmoid", True, True, 2.5),
    (17, 24, 6, 4, 2, "sigmoid", True, True, 1.0), (5, 40, 1, 1, 1, "sigmoid", True, True, 1.0),
    (17, 30, 3, 1, 1, "softmax", False, False, 1.0), (3, 896, 16, 1, 1, "sigmoid", True, True, 1.0),
    (9, 64, 8, 8, 3, "softmax", True, True, 1.7), (2, 24, 2, 24, 4, "sigmoid", True, True, 1.0),
]
HEAD_MATMUL_CASES = [(1, 3, 24, 40), (17, 5, 16, 72), (2, 4, 128, 512)]  # (rows, heads, head dim, latent)
GATED_NORM_CASES = [(1, 3, 128), (17, 5, 24), (70, 4, 33)]  # (tokens, heads, head dim)
SITU_CASES = [(1, 300, 25.0), (17, 300, None), (4, 3072, 25.0)]  # (rows, width, linear beta)
GATE_OUTPUT_CASES = [  # (rows, width, gated, o in fp32, gate a strided view)
    (1, 200, True, True, True), (17, 333, True, True, False), (5, 1100, False, True, False), (3, 77, True, False, True),
]


@contextlib.contextmanager
def poisoned_outputs():
    """torch.empty returns NaN-filled floats and -1-filled integers while the kernels run."""
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -1)

    torch.empty = poisoned
    try:
        yield
    finally:
        torch.empty = empty


def _gen(seed: int):
    gen = torch.Generator().manual_seed(seed)
    return lambda *shape, scale=1.0: torch.randn(*shape, generator=gen) * scale


def _check(got: torch.Tensor, want: torch.Tensor, dtype, what: str) -> None:
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    assert torch.isfinite(got).all(), f"{what}: non-finite values (an element was not written?)"
    err = rel_rms(got.cpu(), want.cpu())
    assert err < BOUND[dtype], f"{what}: rel RMS {err:.2e} over {BOUND[dtype]:.0e}"


def check_rms_norm(kernel, device, dtype, rows, hidden, weight_dtype=None, seed=0):
    rnd = _gen(seed)
    x = (rnd(rows, hidden) * 3).to(dtype).to(device)
    w = (1 + rnd(hidden, scale=0.1)).to(weight_dtype or dtype).to(device)
    with poisoned_outputs():
        got = kernel(x, w, 1e-5)
    _check(got, norm_ref.rms_norm(x, w, 1e-5), dtype, "rms_norm")
    view = x[:, : hidden - 1]  # a strided view: rows one element shorter than their stride
    with poisoned_outputs():
        got = kernel(view, w[: hidden - 1], 1e-6)
    _check(got, norm_ref.rms_norm(view, w[: hidden - 1], 1e-6), dtype, "rms_norm of a view")


def check_layer_norm(kernel, device, dtype, rows, hidden, seed=0):
    rnd = _gen(seed)
    x = (rnd(rows, hidden) * 3 + 0.5).to(dtype).to(device)  # a mean far from 0
    w, b = (1 + rnd(hidden, scale=0.1)).to(dtype).to(device), rnd(hidden, scale=0.1).to(dtype).to(device)
    with poisoned_outputs():
        got = kernel(x, w, b, 1e-6)
    _check(got, norm_ref.layer_norm(x, w, b, 1e-6), dtype, "layer_norm")


def check_gated_rms_norm(kernel, device, dtype, tokens, heads, dim, seed=0):
    """KDA's output norm: x [T, H, d] (fla's output), gate [T, H, d] a view of a wider projection's columns,
    fp32 weight [d]."""
    rnd = _gen(seed)
    x = (rnd(tokens, heads, dim) * 2).to(dtype).to(device)
    gate = (rnd(tokens, heads * dim + 7) * 2).to(dtype).to(device)[:, 3 : 3 + heads * dim].view(tokens, heads, dim)
    w = (1 + rnd(dim, scale=0.1)).to(device)
    with poisoned_outputs():
        got = kernel(x, gate, w, 1e-5)
    _check(got, norm_ref.gated_rms_norm(x, gate, w, 1e-5), dtype, "gated_rms_norm")


def check_add_read_norm(kernel, device, dtype, rows, hidden, n_blocks, add, one_buffer, seed=0):
    rnd = _gen(seed)
    running = rnd(1, rows, hidden).to(dtype).to(device)
    addend = rnd(1, rows, hidden).to(dtype).to(device) if add else None
    if one_buffer:  # as the serving forward seals them (`model.attn_res.seal` into a `block_store`)
        store = (rnd(n_blocks + 1, 1, rows, hidden) * 2).to(dtype).to(device)
        blocks = [store[i] for i in range(n_blocks)]
    else:
        blocks = [(rnd(1, rows, hidden) * 2).to(dtype).to(device) for _ in range(n_blocks)]
    read_norm = (1 + rnd(hidden, scale=0.1)).to(dtype).to(device)
    read_proj = rnd(1, hidden, scale=hidden ** -0.5 * 4).to(dtype).to(device)  # peaked and flat softmaxes
    norm = (1 + rnd(hidden, scale=0.1)).to(dtype).to(device)
    want_x, want_live = attn_res_ref.add_read_norm(running, addend, blocks, read_norm, read_proj, norm, 1e-5)
    with poisoned_outputs():
        got_x, got_live = kernel(running, addend, blocks, read_norm, read_proj, norm, 1e-5)
    _check(got_x, want_x, dtype, "add_read_norm input")
    assert torch.equal(got_live, want_live), "the live sum differs (one rounding of running + addend)"


def check_route(kernel, device, rows, experts, top_k, groups, top_groups, score_func, bias, renormalize, scale, seed=0):
    rnd = _gen(seed)
    logits = (rnd(rows, experts) * 2).to(device)
    correction = rnd(experts, scale=0.05).to(device) if bias else None
    kw = dict(score_func=score_func, num_expert_group=groups, topk_group=top_groups, renormalize=renormalize,
              scaling_factor=scale)
    want_ids, want_w = moe_ref.route(logits, correction, top_k, **kw)
    with poisoned_outputs():
        got_ids, got_w = kernel(logits, correction, top_k, **kw)
    assert got_ids.dtype == torch.int64 and got_ids.shape == want_ids.shape == (rows, top_k)
    assert torch.equal(got_ids.cpu(), want_ids.cpu()), (got_ids, want_ids)
    _check(got_w, want_w, torch.float32, "route weights")


def check_situ(kernel, device, dtype, rows, width, linear_beta, seed=0):
    rnd = _gen(seed)
    gate, up = ((rnd(rows, width) * 4).to(dtype).to(device) for _ in range(2))
    with poisoned_outputs():
        got = kernel(gate, up, 4.0, linear_beta)
    _check(got, activation_ref.situ_and_mul(gate, up, 4.0, linear_beta), dtype, "situ_and_mul")


def check_gate_output(kernel, device, dtype, rows, width, gated, o_fp32, strided_gate, seed=0):
    """MLA's output gate as the decode rows run it: o as the attention ops return it (fp32 or the model dtype),
    the gate a row view of a wider projection output (`ops.linear.merged`) or its own tensor."""
    rnd = _gen(seed)
    o = (rnd(rows, width) * 2).to(torch.float32 if o_fp32 else dtype).to(device)
    gate = None
    if gated:
        wide = (rnd(rows, width + 5) * 3).to(dtype).to(device)
        gate = wide[:, 3 : 3 + width] if strided_gate else wide[:, :width].contiguous()
    with poisoned_outputs():
        got = kernel(o, gate, dtype)
    _check(got, activation_ref.gate_output(o, gate, dtype), dtype, "gate_output")


def check_head_matmul(kernel, device, dtype, rows, heads, head_dim, latent, seed=0):
    """Both uses: the query's absorption (x @ w_kc) and the output's projection (x @ w_vc^T), the weights
    views of one kv_b weight as `split_kv_b` makes them, the output's input in fp32 as the MLA ops return it."""
    from kimiserve.ops.mla.reference import split_kv_b

    rnd = _gen(seed)
    kv_b = rnd(heads * 2 * head_dim, latent, scale=latent ** -0.5).to(dtype).to(device)
    w_kc, w_vc = split_kv_b(kv_b, heads, head_dim)
    q = rnd(rows, heads, head_dim).to(dtype).to(device)
    o = rnd(rows, heads, latent).to(device)
    for x, w, what in ((q, w_kc, "absorb"), (o, w_vc.transpose(1, 2), "output")):
        with poisoned_outputs():
            got = kernel(x, w)
        _check(got, mla_ref.head_matmul(x, w), torch.float32, f"head_matmul ({what})")
