"""Batch-invariant ops in pure torch: every output element is computed by a fixed sequence of IEEE
operations on its own row's inputs, whatever the batch, its size, the row's place in it, the tensor's
strides or the thread count (the thinking-machines "defeating nondeterminism" argument, on the CPU).

Why this is needed here, measured on this project's CPUs (torch 2.13, AVX-512; tests/test_batch_invariant.py
keeps checking it): `F.linear` gives a row different bits alone (M = 1: a GEMV) than among other rows
(M >= 2: a GEMM with another blocking), and `torch.sigmoid` / `F.silu` / `F.softplus` give an element
different bits in a tensor's vectorised body than in its scalar tail or in a strided tensor. `exp`,
`log`, `tanh`, `sqrt`, `rsqrt`, `+ - * /` and comparisons give the same bits wherever the element is.

So the ops below use only those, and every reduction is `tree_sum`: pad the reduced dim with zeros to
a power of two, then add its two halves until one value is left. Each addition is one elementwise IEEE
add, so the result is a function of the row's values alone; and because extra zero padding up to any
larger power of two only adds exact zeros in the first levels, a row's sum is the same whatever length
it was padded to (a batch's longest context, a top-k list or a chunk), up to the sign of an exact zero,
which the final `+ 0.0` makes positive. Matmuls are products then a `tree_sum` over the contracted dim
(rows in chunks: the products tensor is bounded), with a custom backward that uses ordinary matmuls
(gradients need not be bit-exact, only the forward is compared).

Slower than BLAS (several elementwise passes over a [rows, out, in] products tensor per linear), and
the price is measured by benchmarks/batch_invariant.py. The fp32 compute dtype throughout; outputs
come back in the input's dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kimiserve.ops.pointwise import sigmoid, silu, softplus  # noqa: F401  (bi.sigmoid etc.)
from kimiserve.ops.quant.reference import dequantize_mxfp4

LINEAR_CHUNK_ELEMENTS = {"cpu": 1 << 22, "cuda": 1 << 28}
"""Rows of a linear run in chunks whose [rows, out, in] products tensor has at most this many elements
(per device type; others use the CPU's)."""


class _RowSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dim, keepdim):
        from kimiserve.ops.batch_invariant.triton_norm import row_sum

        ctx.shape, ctx.dim, ctx.keepdim = x.shape, dim, keepdim
        out = row_sum(x.movedim(dim, -1))
        return out.unsqueeze(dim) if keepdim else out

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.keepdim else grad.unsqueeze(ctx.dim)
        return g.expand(ctx.shape), None, None


def tree_sum(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """Sum over `dim` in the fixed pairwise order described in the module doc (on CUDA with Triton:
    `triton_norm.row_sum`, a fixed chunked order per row in fp32, one launch instead of log2(n); there
    the bits depend on n, which the GPU path only reduces over where n does not depend on the batch)."""
    dim = dim % x.dim()
    n = x.shape[dim]
    if n == 0:
        return x.sum(dim, keepdim=keepdim)
    if on_triton(x) and _cuda_norm() is not None:
        return _RowSum.apply(x, dim, keepdim)
    width = 1 << (n - 1).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim)
    while x.shape[dim] > 1:
        half = x.shape[dim] // 2
        x = x.narrow(dim, 0, half) + x.narrow(dim, half, half)
    out = x + 0.0
    return out if keepdim else out.squeeze(dim)


def tree_mean(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    return tree_sum(x, dim, keepdim) / x.shape[dim]


def _linear_rows(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [N, K] (fp32) times w [O, K] (fp32), or per-row weights w [N, O, K]: [N, O]."""
    N, K = x2.shape
    O = w.shape[-2]
    budget = LINEAR_CHUNK_ELEMENTS.get(x2.device.type, LINEAR_CHUNK_ELEMENTS["cpu"])
    rows = max(1, budget // max(1, O * K))
    parts = []
    for i in range(0, N, rows):
        wi = w if w.dim() == 2 else w[i : i + rows]
        parts.append(tree_sum(x2[i : i + rows, None, :] * wi, -1))
    return torch.cat(parts) if parts else x2.new_zeros(0, O)


def on_triton(x: torch.Tensor) -> bool:
    """Whether the ops take their Triton forms for x: CUDA tensors (the interpreter tests also route
    CPU tensors there)."""
    return x.is_cuda


def _cuda_matmul():
    """`ops.batch_invariant.triton.matmul` when Triton imports (CUDA), else None (the tree form runs)."""
    try:
        from kimiserve.ops.batch_invariant.triton import matmul
    except ImportError:
        return None
    return matmul


class _InvariantLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor, addend: torch.Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        ctx.addend_dtype = None if addend is None else addend.dtype
        K, O = w.shape[-1], w.shape[-2]
        fast = _cuda_matmul() if on_triton(x) and w.dim() == 2 else None
        if fast is not None:  # one fixed tiling: batch-invariant too, other bits than the tree
            extra = {} if addend is None else {"addend": addend.reshape(-1, O)}
            return fast(x.reshape(-1, K), w, out_dtype=out_dtype or x.dtype, **extra).view(*x.shape[:-1], O)
        y = _linear_rows(x.reshape(-1, K).float(), w.reshape(-1, O, K).float() if w.dim() == 3 else w.float())
        y = y.view(*x.shape[:-1], O).to(out_dtype or x.dtype)
        return y if addend is None else addend + y  # the tree form: the separate add's bits

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        K, O = w.shape[-1], w.shape[-2]
        g2, x2 = grad.reshape(-1, O).float(), x.reshape(-1, K).float()
        gx = gw = None
        if w.dim() == 2:
            if ctx.needs_input_grad[0]:
                gx = (g2 @ w.float()).view(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                gw = (g2.T @ x2).to(w.dtype)
        else:
            w3 = w.reshape(-1, O, K).float()
            if ctx.needs_input_grad[0]:
                gx = torch.bmm(g2.unsqueeze(1), w3)[:, 0].view(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                gw = (g2.unsqueeze(-1) * x2.unsqueeze(1)).view(w.shape).to(w.dtype)
        ga = grad.to(ctx.addend_dtype) if ctx.addend_dtype is not None and ctx.needs_input_grad[2] else None
        return (gx, gw, ga, None)[: len(ctx.needs_input_grad)]


@dataclass(frozen=True)
class MXFP4Weight:
    """An MXFP4 weight [O, K] as stored (packed codes [O, K/2], ue8m0 scales [O, K/32]) and the dtype it
    dequantises to (`ops.quant.reference.dequantize_mxfp4`)."""

    packed: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return dequantize_mxfp4(self.packed, self.scales, self.dtype).to(dtype or self.dtype)


class _MXFP4Linear(torch.autograd.Function):
    """Forward: `triton.matmul_mxfp4` (dequantised in the kernel); backward: x's gradient only (the
    codes do not train)."""

    @staticmethod
    def forward(ctx, x, packed, scales, dtype):
        ctx.save_for_backward(packed, scales)
        ctx.dtype, ctx.x_dtype = dtype, x.dtype
        from kimiserve.ops.batch_invariant.triton import matmul_mxfp4

        K = x.shape[-1]
        return matmul_mxfp4(x.reshape(-1, K), packed, scales, out_dtype=x.dtype).view(*x.shape[:-1], packed.shape[0])

    @staticmethod
    def backward(ctx, grad):
        packed, scales = ctx.saved_tensors
        w = dequantize_mxfp4(packed, scales, torch.float32)
        return (grad.float() @ w).to(ctx.x_dtype), None, None, None


def linear(x: torch.Tensor, weight, addend: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [..., K] @ weight [O, K]^T -> [..., O] in x's dtype, products and a `tree_sum` in fp32 (on CUDA
    with Triton, one weight matrix: the fixed-tiling kernel `ops.batch_invariant.triton.matmul`).
    weight may also be one matrix per row, [N, O, K] for x [N, K] (experts, LoRA: grouped matmuls), or
    an `MXFP4Weight` (on CUDA dequantised inside the kernel, elsewhere first, to x's dtype). addend (one
    weight matrix, x's shape but O, x's dtype): added to the product, on CUDA inside the kernel onto the fp32
    sum before its one rounding (`triton.matmul`'s epilogue), elsewhere as `addend + linear(x, weight)`.
    out_dtype (one weight matrix of another dtype than x's, no addend): the result's dtype, the bits of
    `linear(x.to(weight.dtype), weight)` when weight is fp32 (the product runs in fp32 either way: x is cast in
    the kernel instead of by a launch of its own)."""
    if out_dtype is not None and addend is None and not isinstance(weight, MXFP4Weight) and weight.dim() == 2:
        return _InvariantLinear.apply(x, weight, None, out_dtype)
    if addend is not None and (isinstance(weight, MXFP4Weight) or weight.dim() != 2 or addend.dtype != x.dtype
                               or addend.shape != (*x.shape[:-1], weight.shape[0])):
        return addend + linear(x, weight)
    if addend is not None:
        return _InvariantLinear.apply(x, weight, addend)
    if isinstance(weight, MXFP4Weight):
        if on_triton(x) and x.dtype in (torch.bfloat16, torch.float16) and _cuda_matmul() is not None:
            return _MXFP4Linear.apply(x, weight.packed, weight.scales, weight.dtype)
        return _InvariantLinear.apply(x, weight.dequantize(x.dtype))
    if weight.dim() == 3 and (x.dim() != 2 or weight.shape[0] != x.shape[0]):
        raise ValueError(f"per-row weights {tuple(weight.shape)} need x [N, K] with the same N, got {tuple(x.shape)}")
    return _InvariantLinear.apply(x, weight)


@dataclass(frozen=True)
class RowGroups:
    """Rows sorted by group (stable), the groups present and their row counts: computed once (one host
    sync) and shared by the matmuls of one grouping (an expert's w1, w3 and w2; a LoRA's A and B)."""

    order: torch.Tensor
    inverse: torch.Tensor
    present: list[int]
    counts: list[int]

    @classmethod
    def of(cls, groups: torch.Tensor) -> "RowGroups":
        order = torch.argsort(groups, stable=True)
        present, counts = torch.unique_consecutive(groups[order], return_counts=True)
        return cls(order, torch.argsort(order), present.tolist(), counts.tolist())


def grouped_linear(x: torch.Tensor, groups, weight_of, out_features: int) -> torch.Tensor:
    """Row i of x [N, K] times group groups[i]'s weight `weight_of(g)` [out_features, K] -> [N, out]
    in x's dtype; rows of a negative group get zeros. One `linear` per group present (experts, LoRA
    adapters): a row's bits are those of `linear` on that row alone (the CPU's tree sum gives the same
    bits for a shared as for a per-row weight), with no [N, out, K] gathered weights. `groups`: int
    [N], or their `RowGroups` (the host sync done once for several matmuls)."""
    plan = groups if isinstance(groups, RowGroups) else None
    if plan is None:
        if groups.shape != x.shape[:1]:
            raise ValueError(f"groups must be [N] for x {tuple(x.shape)}, got {tuple(groups.shape)}")
        plan = RowGroups.of(groups)
    parts, start = [], 0
    for g, n in zip(plan.present, plan.counts):
        rows = plan.order[start : start + n]
        start += n
        parts.append(x.new_zeros(n, out_features) if g < 0 else linear(x[rows], weight_of(g)))
    if not parts:
        return x.new_zeros(0, out_features)
    return torch.cat(parts)[plan.inverse]


class _GroupedMatmul(torch.autograd.Function):
    """Forward: `triton.grouped_matmul` (one launch for every group); backward: per group, plain matmuls."""

    @staticmethod
    def forward(ctx, x, weights, scales, plan, mxfp4_dtype, every_row):
        from kimiserve.ops.batch_invariant.triton import grouped_matmul

        ctx.save_for_backward(x, weights, scales)
        ctx.plan, ctx.mxfp4 = plan, scales is not None
        w = (weights, scales) if scales is not None else weights
        return grouped_matmul(x, w, plan, out_dtype=x.dtype, every_row=every_row)

    @staticmethod
    def backward(ctx, grad):
        x, weights, scales = ctx.saved_tensors
        gx = torch.zeros(x.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[0] else None
        gw = torch.zeros(weights.shape, dtype=torch.float32, device=x.device) if ctx.needs_input_grad[1] else None
        for g, rows in ctx.plan.host_groups():
            w = dequantize_mxfp4(weights[g], scales[g], torch.float32) if ctx.mxfp4 else weights[g].float()
            gr = grad[rows].float()
            if gx is not None:
                gx[rows] = gr @ w
            if gw is not None:
                gw[g] = gr.T @ x[rows].float()
        return (None if gx is None else gx.to(x.dtype), None if gw is None else gw.to(weights.dtype), None, None, None, None)


PLAN_KERNEL_MAX_ROWS = 2048
"""On CUDA (Triton), `group_rows` builds the expert plan of at most this many (token, slot) rows in one
launch (`triton_glue.tile_plan`: element for element `TilePlan.of`, ~15 kernels); 0: always `TilePlan.of`.
2048 since session 7 (its GPU tests passed on the H200)."""


def _triton_glue():
    try:
        from kimiserve.ops.batch_invariant import triton_glue
    except ImportError:
        return None
    return triton_glue


def group_rows(x: torch.Tensor, groups: torch.Tensor, num_groups: int):
    """The plan of rows grouped by `groups` (int [N] in [0, num_groups), negative: none) for
    `stacked_linear` on x's device: on CUDA (Triton) a `triton.TilePlan`, made on the device (no host
    sync: capturable in a CUDA graph); elsewhere `RowGroups` (one host sync)."""
    if on_triton(x) and _cuda_matmul() is not None:
        from kimiserve.ops.batch_invariant.triton import TilePlan

        if 0 < groups.shape[0] <= PLAN_KERNEL_MAX_ROWS and num_groups > 0 and _triton_glue() is not None:
            return _triton_glue().tile_plan(groups, num_groups)
        return TilePlan.of(groups, num_groups)
    return RowGroups.of(groups)


def stacked_linear(x: torch.Tensor, plan, weights: torch.Tensor, scales: torch.Tensor | None = None,
                   dtype: torch.dtype | None = None, every_row: bool = False) -> torch.Tensor:
    """Rows of x [N, K] through their group's weight (`plan` from `group_rows`): weights [G, O, K], or
    MXFP4 codes [G, O, K/2] with scales [G, O, K/32] dequantising to `dtype` -> [N, O] in x's dtype (zero
    rows for negative groups). On CUDA one `triton.grouped_matmul` launch (a row gets the bits of
    `linear(row, weights[g])`); elsewhere `grouped_linear`. every_row: the caller's promise that no group is
    negative (the kernel then writes every row: no zero fill first)."""
    if isinstance(plan, RowGroups):
        if scales is not None:
            return grouped_linear(x, plan, lambda e: MXFP4Weight(weights[e], scales[e], dtype), weights.shape[1])
        return grouped_linear(x, plan, lambda e: weights[e], weights.shape[1])
    if scales is not None and x.dtype not in (torch.bfloat16, torch.float16):  # as `linear` does: dequantised first
        weights, scales = dequantize_mxfp4(weights, scales, dtype).to(x.dtype), None
    return _GroupedMatmul.apply(x, weights, scales, plan, dtype, every_row)


def expert_linear(x: torch.Tensor, plan, weights: torch.Tensor, scales: torch.Tensor | None = None,
                  dtype: torch.dtype | None = None, every_row: bool = False) -> torch.Tensor:
    """Rows of x [N, K] grouped by expert (`plan` from `group_rows`) through their experts' weights:
    [E, O, K] (cast to x's dtype), or MXFP4 codes [E, O, K/2] with scales [E, O, K/32] dequantising to
    `dtype` (`stacked_linear`; every_row: every row has an expert, no zero fill of the output on CUDA)."""
    return stacked_linear(x, plan, weights if scales is not None else weights.to(x.dtype), scales, dtype, every_row)


class _HeadLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        fast = _cuda_matmul() if on_triton(x) else None
        if fast is not None:
            return fast(x.transpose(0, 1), w).transpose(0, 1)
        N, H, K = x.shape
        budget = LINEAR_CHUNK_ELEMENTS.get(x.device.type, LINEAR_CHUNK_ELEMENTS["cpu"])
        rows = max(1, budget // max(1, H * w.shape[1] * K))
        wf = w.float()
        parts = [tree_sum(x[i : i + rows].float().unsqueeze(-2) * wf, -1) for i in range(0, N, rows)]
        return torch.cat(parts) if parts else x.new_zeros(0, H, w.shape[1], dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, w = ctx.saved_tensors
        g = grad.float()
        gx = torch.einsum("nho,hok->nhk", g, w.float()).to(x.dtype) if ctx.needs_input_grad[0] else None
        gw = torch.einsum("nho,nhk->hok", g, x.float()).to(w.dtype) if ctx.needs_input_grad[1] else None
        return gx, gw


def head_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per-head products in fp32: x [N, H, K] and weight [H, O, K] -> [N, H, O], out[n, h, o] =
    sum_k x[n, h, k] weight[h, o, k] (the absorbed MLA's key and value matrices): the tree sum, on CUDA
    the fixed-tiling matmul batched over heads."""
    if x.dim() != 3 or weight.dim() != 3 or x.shape[1] != weight.shape[0] or x.shape[2] != weight.shape[2]:
        raise ValueError(f"head_linear needs x [N, H, K] and weight [H, O, K], got {tuple(x.shape)} and "
                         f"{tuple(weight.shape)}")
    return _HeadLinear.apply(x, weight)


def _situ_and_mul_torch(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    g, u = gate.float(), up.float()
    act = beta * torch.tanh(g / beta) * sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (act * u).to(gate.dtype)


def _glue_kernels():
    """(`ops.activation.triton`, `ops.attn_res.triton`): the serving path's row kernels, which the GPU
    form of the invariant forward shares (elementwise, or one program per row whose configuration depends
    on the row width only: a row's bits never depend on the batch); None without Triton."""
    try:
        from kimiserve.ops.activation import triton as activation_tt
        from kimiserve.ops.attn_res import triton as attn_res_tt
    except ImportError:
        return None
    return activation_tt, attn_res_tt


class _SiTUAndMul(torch.autograd.Function):
    """Forward: the Triton SiTU kernel (fp32 inside, one rounding); backward: autograd through the torch form."""

    @staticmethod
    def forward(ctx, gate, up, beta, linear_beta):
        ctx.save_for_backward(gate, up)
        ctx.beta, ctx.linear_beta = beta, linear_beta
        return _glue_kernels()[0].situ_and_mul(gate, up, beta, linear_beta)

    @staticmethod
    def backward(ctx, grad):
        gate, up = ctx.saved_tensors
        with torch.enable_grad():
            g, u = gate.detach().requires_grad_(), up.detach().requires_grad_()
            dg, du = torch.autograd.grad(_situ_and_mul_torch(g, u, ctx.beta, ctx.linear_beta), (g, u), grad)
        return dg, du, None, None


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """SiTU(gate) * (linear_beta tanh(up / linear_beta)) in fp32, rounded once (elementwise: batch-invariant
    as it is); on CUDA the serving path's one Triton kernel instead of ~16 torch kernels."""
    if on_triton(gate) and _glue_kernels() is not None and gate.shape == up.shape:
        return _SiTUAndMul.apply(gate, up, beta, linear_beta)
    return _situ_and_mul_torch(gate, up, beta, linear_beta)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return silu(gate) * up


def softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """exp(x - max) / tree_sum(...); -inf entries get exactly 0 (a row needs one finite entry)."""
    m = x.amax(dim, keepdim=True).detach()
    e = torch.exp(x - m)
    return e / tree_sum(e, dim, keepdim=True)


def log_softmax(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    m = x.amax(dim, keepdim=True).detach()
    shifted = x - m
    return shifted - torch.log(tree_sum(torch.exp(shifted), dim, keepdim=True))


def _rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(tree_mean(xf * xf, -1, keepdim=True) + eps)
    return weight * normed.to(x.dtype) if weight.dtype == x.dtype else (weight.float() * normed).to(x.dtype)


def _gated_rms_norm_torch(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    normed = xf * torch.rsqrt(tree_mean(xf * xf, -1, keepdim=True) + eps)
    return (normed * weight.float() * sigmoid(gate.float())).to(x.dtype)


def _cuda_norm():
    try:
        from kimiserve.ops.batch_invariant.triton_norm import rms_norm as fast
    except ImportError:
        return None
    return fast


class _Norm(torch.autograd.Function):
    """Forward: the Triton row kernel; backward: autograd through the torch form (same math)."""

    @staticmethod
    def forward(ctx, x, weight, gate, eps):
        ctx.save_for_backward(x, weight, gate)
        ctx.eps = eps
        return _cuda_norm()(x, weight, eps, gate)

    @staticmethod
    def backward(ctx, grad):
        x, weight, gate = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(t.is_floating_point()) if t is not None else None for t in (x, weight, gate)]
            xl, wl, gl = leaves
            out = _rms_norm_torch(xl, wl, ctx.eps) if gl is None else _gated_rms_norm_torch(xl, gl, wl, ctx.eps)
            live = [t for t in leaves if t is not None]
            grads = iter(torch.autograd.grad(out, live, grad, allow_unused=True))
        return (*(next(grads) if t is not None else None for t in leaves), None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.norm.reference.rms_norm` (normalise in fp32, cast, then scale) with a tree mean (on CUDA the
    row kernel of `ops.batch_invariant.triton_norm`)."""
    if on_triton(x) and _cuda_norm() is not None:
        return _Norm.apply(x, weight, None, eps)
    return _rms_norm_torch(x, weight, eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if on_triton(x) and _cuda_norm() is not None:
        return _Norm.apply(x, weight, gate, eps)
    return _gated_rms_norm_torch(x, gate, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    centred = xf - tree_mean(xf, -1, keepdim=True)
    var = tree_mean(centred * centred, -1, keepdim=True)
    return (centred * torch.rsqrt(var + eps) * weight.float() + bias.float()).to(x.dtype)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(tree_sum(xf * xf, -1, keepdim=True) + eps)).to(x.dtype)


def attn_res_read(running: torch.Tensor, blocks: list[torch.Tensor], norm_weight: torch.Tensor,
                  proj_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`ops.attn_res.reference.attn_res_read` with tree reductions."""
    v = torch.stack([*blocks, running], dim=-2).float()  # [..., n, d]
    query = norm_weight.float().reshape(-1) * proj_weight.float().reshape(-1)
    scores = tree_sum(v * query, -1) * torch.rsqrt(tree_mean(v * v, -1) + eps)
    probs = softmax(scores, -1)
    return tree_sum(probs.unsqueeze(-1) * v, -2).to(running.dtype)


def _read_norm_torch(running, blocks, read_norm_weight, read_proj_weight, norm_weight, eps):
    x = attn_res_read(running, list(blocks), read_norm_weight, read_proj_weight, eps) if blocks else running
    return _rms_norm_torch(x, norm_weight, eps)


class _ReadNorm(torch.autograd.Function):
    """Forward: the serving path's `attn_res.triton.add_read_norm` (one program per row); backward:
    autograd through the torch form (`attn_res_read` then `rms_norm`)."""

    @staticmethod
    def forward(ctx, eps, running, read_norm_weight, read_proj_weight, norm_weight, *blocks):
        ctx.eps = eps
        ctx.save_for_backward(running, read_norm_weight, read_proj_weight, norm_weight, *blocks)
        return _glue_kernels()[1].add_read_norm(running, None, list(blocks), read_norm_weight, read_proj_weight,
                                                 norm_weight, eps)[0]

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) if t is not None else None
                      for t, need in zip(saved, ctx.needs_input_grad[1:])]
            running, rn, rp, nw, *blocks = leaves
            out = _read_norm_torch(running, blocks, rn, rp, nw, ctx.eps)
            wanted = [t for t in leaves if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, *(next(grads) if t is not None and t.requires_grad else None for t in leaves))


def read_norm(running: torch.Tensor, blocks: list[torch.Tensor], read_norm_weight: torch.Tensor | None,
              read_proj_weight: torch.Tensor | None, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """A sublayer's normed input: the attention-residual read of `blocks` (`attn_res_read`; none: `running`
    itself), then `rms_norm` with the same eps. On CUDA one Triton program per row (the serving path's
    `add_read_norm`, its reductions fixed by the row width) instead of ~26 torch kernels."""
    fused = on_triton(running) and _glue_kernels() is not None and _glue_kernels()[1].supported(running, norm_weight)
    if fused and blocks and not (read_norm_weight.is_contiguous() and read_proj_weight.is_contiguous()):
        fused = False
    if fused:
        return _ReadNorm.apply(eps, running, read_norm_weight if blocks else None,
                               read_proj_weight if blocks else None, norm_weight, *blocks)
    return _read_norm_torch(running, blocks, read_norm_weight, read_proj_weight, norm_weight, eps)


def tree_add(terms: list[torch.Tensor]) -> torch.Tensor:
    """The `tree_sum` of a short list of same-shape tensors (the reduced dim given as a list: no
    [..., n] tensor made), with its bits: halves added pairwise, the zero padding left out (it only
    turns -0.0 into +0.0, as the final + 0.0 does)."""
    width = 1 << (len(terms) - 1).bit_length()
    terms = list(terms) + [None] * (width - len(terms))
    while len(terms) > 1:
        half = len(terms) // 2
        terms = [a if b is None else b if a is None else a + b for a, b in zip(terms[:half], terms[half:])]
    return terms[0] + 0.0


def causal_conv(taps: list[torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """The short conv of rows from their W taps (the W-1 earlier inputs, then the row's own), each
    [..., C], weight [C, W] (C may be several dims): SiLU(sum_j weight[c, j] taps[j][c]) in fp32, the
    sum `tree_add`ed (elementwise ops only: the same on every device and for every row count)."""
    w = weight.float()
    return silu(tree_add([t.float() * w[..., j] for j, t in enumerate(taps)]))


def causal_conv_step(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token of the short conv: window [..., C, W] (the W-1 earlier inputs, then this one),
    weight [C, W] -> SiLU(sum_j weight[c, j] window[c, j]) [..., C] (`causal_conv` of its taps)."""
    return causal_conv([window[..., j] for j in range(window.shape[-1])], weight).to(window.dtype)


def kda_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
             state: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the KDA delta rule (`ops.kda.reference.recurrent_kda`'s step) for rows of
    q, k, g [A, H, K], v [A, H, V], beta [A, H] from state [A, H, K, V] (fp32). Returns (o [A, H, V], state)."""
    S = state * torch.exp(g.float()).unsqueeze(-1)
    kf = k.float()
    residual = v.float() - tree_sum(S * kf.unsqueeze(-1), -2)
    S = S + (beta.float()[..., None, None] * kf.unsqueeze(-1)) * residual.unsqueeze(-2)
    o = tree_sum(S * (q.float() * scale).unsqueeze(-1), -2)
    return o, S


def _kda_recurrence_steps(q, k, v, g, beta, state, starts, lengths, snap_t, scale):
    """`kda_recurrence` in torch: every segment's token t at once, t = 0, 1, ... (autograd-friendly)."""
    B = state.shape[0]
    snaps = torch.zeros_like(state)
    rows_seen, outs = [], []
    for t in range(int(lengths.max()) if B else 0):
        snap_now = torch.nonzero(snap_t == t)[:, 0]
        if len(snap_now):
            snaps = snaps.index_copy(0, snap_now, state[snap_now])
        active = torch.nonzero(lengths > t)[:, 0]
        rows = starts[active] + t
        every = len(active) == B
        o_t, new_state = kda_step(q[rows], k[rows], v[rows], g[rows], beta[rows], state if every else state[active], scale)
        state = new_state if every else state.index_copy(0, active, new_state)  # out of place: autograd
        rows_seen.append(rows)
        outs.append(o_t)
    if not outs:
        return q.new_zeros(0, *v.shape[1:], dtype=torch.float32), state, snaps
    return torch.cat(outs)[torch.argsort(torch.cat(rows_seen))], state, snaps


def _cuda_kda():
    try:
        from kimiserve.ops.batch_invariant.triton_kda import recurrence
    except ImportError:
        return None
    return recurrence


class _KDARecurrence(torch.autograd.Function):
    """Forward: the Triton kernel; backward: autograd through the torch steps (other bits, same math)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, starts, lengths, snap_t, scale, decode=False):
        ctx.save_for_backward(q, k, v, g, beta, state, starts, lengths, snap_t)
        ctx.scale = scale
        return _cuda_kda()(q, k, v, g, beta, state, starts, lengths, snap_t, scale, decode)

    @staticmethod
    def backward(ctx, go, gfinal, gsnaps):
        *inputs, starts, lengths, snap_t = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(True) for t in inputs]
            outs = _kda_recurrence_steps(*leaves, starts, lengths, snap_t, ctx.scale)
            pairs = [(o, gr) for o, gr in zip(outs, (go, gfinal, gsnaps)) if gr is not None]
            grads = torch.autograd.grad([o for o, _ in pairs], leaves, [gr for _, gr in pairs], allow_unused=True)
        return (*grads, None, None, None, None, None)[: len(ctx.needs_input_grad)]


def kda_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                   state: torch.Tensor, starts: torch.Tensor, lengths: torch.Tensor, snap_t: torch.Tensor,
                   scale: float, decode: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The KDA delta rule over packed segments, token by token (`kda_step`): q, k, g [N, H, K],
    v [N, H, V], beta [N, H], segment b's rows starts[b] .. starts[b] + lengths[b] - 1 from state[b]
    ([B, H, K, V] fp32). Returns (o [N, H, V] fp32, final states, snapshots: segment b's state before
    its token snap_t[b], zeros where snap_t[b] is -1). On CUDA the Triton kernel
    (`ops.batch_invariant.triton_kda`: one pass per segment, other bits), backward through the steps.
    decode: every row a one-token segment of its own, no snapshot (the kernel's snapshots are then left
    unfilled: not zeros)."""
    if on_triton(q) and _cuda_kda() is not None:
        return _KDARecurrence.apply(q, k, v, g, beta, state, starts, lengths, snap_t, scale, decode)
    return _kda_recurrence_steps(q, k, v, g, beta, state, starts, lengths, snap_t, scale)


def indexer_topk(iq: torch.Tensor, iw: torch.Tensor, keys: torch.Tensor, lens: torch.Tensor, topk: int) -> torch.Tensor:
    """Rows' selected context positions: score(s) = sum_h iw[h] ReLU(iq[h] . keys[s]) over s < lens,
    the topk best (ties: the earlier token), listed in ascending position order; entries past a row's
    count are S (= keys.shape[1], "none"). iq [G, Hi, D], iw [G, Hi], keys [G, S, D], lens [G]."""
    S = keys.shape[1]
    dots = tree_sum(iq.float()[:, None] * keys.float()[:, :, None], -1)  # [G, S, Hi]
    scores = tree_sum(dots.relu() * iw.float()[:, None], -1)  # [G, S]
    visible = torch.arange(S, device=keys.device) < lens.unsqueeze(1)
    scores = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, : min(topk, S)]
    order = torch.where(torch.gather(visible, 1, order), order, S)
    return torch.sort(order, dim=-1).values


def sparse_latent_attention(q_abs: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor, positions: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Absorbed MLA over listed context tokens: q_abs [G, H, L], q_pe [G, H, R], latents [G, S, L + R]
    (as the cache returns them), positions [G, n] into them (S = none). Returns [G, H, L] fp32."""
    S, L = latents.shape[1], q_abs.shape[-1]
    valid = positions < S
    picked = torch.gather(latents.float(), 1, positions.clamp(max=S - 1).unsqueeze(-1).expand(-1, -1, latents.shape[-1]))
    picked = torch.where(valid.unsqueeze(-1), picked, 0.0)  # unlisted slots (maybe never written): exact zeros
    q = torch.cat([q_abs.float(), q_pe.float()], dim=-1)  # [G, H, L + R]
    logits = tree_sum(q[:, :, None] * picked[:, None], -1) * scale  # [G, H, n]
    probs = softmax(logits.masked_fill(~valid[:, None], float("-inf")), -1)
    return tree_sum(probs.unsqueeze(-1) * picked[:, None, :, :L], -2)


def _route_scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sigmoid":
        return sigmoid(logits)
    if score_func == "softmax":
        return softmax(logits, -1)
    raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")


def _route_weights(scores: torch.Tensor, ids: torch.Tensor, renormalize: bool, scaling_factor: float) -> torch.Tensor:
    weights = scores.gather(1, ids)
    if renormalize and ids.shape[-1] > 1:
        weights = weights / (tree_sum(weights, -1, keepdim=True) + 1e-20)
    return weights * scaling_factor


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *, score_func: str,
          renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`ops.moe.reference.route` without expert groups: ties between experts go to the smaller id,
    the renormalising sum is a tree sum."""
    logits = router_logits.float()
    scores = _route_scores(logits, score_func)
    choice = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.sort(choice.detach(), dim=-1, descending=True, stable=True).indices[:, :top_k]
    return ids, _route_weights(scores, ids, renormalize, scaling_factor)
