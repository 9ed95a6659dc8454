"""The batch-invariant forward's glue around the KDA recurrence and the router: each op's torch form (the
compositions of `reference` ops it replaces, bit for bit those) and, opt-in on CUDA, one Triton launch
(`triton_glue`, on by default) with a backward through the torch form. The Triton forms are elementwise or one program
per row whose configuration depends on the row's width only, and the same kernel serves prefill, decode
and the trainer, so a token's bits depend on its own inputs alone (other bits than the torch forms').
"""

from __future__ import annotations

import torch

from kimiserve.ops.batch_invariant import reference as bi

KDA_GLUE_KERNELS = True
"""On CUDA (Triton), the KDA layers' gates and short conv + L2 norms as one launch each
(`triton_glue.kda_gates`, `triton_glue.kda_conv_norm`, the same kernels for prefill, decode and the
trainer) instead of ~35 torch kernels per layer (other bits than the torch forms'; False: the torch forms).
On since session 7 (H200: tests/test_batch_invariant_glue_interpret.py on CUDA, engine == trainer)."""

MOE_GLUE_KERNELS = True
"""On CUDA (Triton), the MoE layers' `route` as one program per row (`triton_glue.route`) and the routed
experts' weighted sum over a token's slots as one launch (`triton_glue.combine_slots`) instead of ~25
torch kernels per MoE layer (False: the torch forms). On since session 7."""

FEWER_KERNELS = True
"""Fewer kernels per invariant step (tiny, batch 4, one decode step: benchmarks/batch_invariant_kernel_count.py
--fewer-kernels): the projections of one input as one invariant matmul over their weights stacked by rows
(`InvariantForward.projections`: a KDA layer's q, k, v, beta, gate and f_a; an MLA layer's q_a, kv_a, the
index keys, the output gate and the index head weights, then q_b with the index queries; the latent MoE's
down projection with the shared experts' gate and up; a dense MLP's gate and up; the gated RMSNorm reads its
gate's column slice in place), the short convs' weights a view of their stacked storage, and no zero fill
of outputs every row of which a kernel writes (the routed experts' grouped matmuls, the KDA decode
recurrence's output and snapshots). The stacked products give other bits than separate ones on CUDA (the
stacked shape picks the tiles; the engine and the trainer alike), the same bits on the CPU (a tree sum per
element). On since session 7 (H200: its kernels against their torch forms and the tiny engine == trainer on
CUDA; `small`'s invariant decode step 1.17x the default mode's, alone == in a batch; BENCHMARKS.md)."""

RESIDUAL_EPILOGUE = False
"""The residual adds as the invariant matmul's epilogue (`reference.linear(..., addend=)`): the attention's
output projection onto the residual stream, the MoE's routed up projection onto it and the shared experts'
down projection onto that (the dense MLP's down onto the stream): one rounding after the fp32 sum instead of a
rounded product and a separate add, ~2-3 kernels fewer per layer. Other bits than the separate adds (the
engine and the trainer alike): on CUDA the one rounding, everywhere the MoE's sum as (residual + routed) + shared
(on the CPU a product's add stays the separate add). Off: on the H200 (session 7) it made `small`'s invariant
decode step slower, 7.05 against 6.64 ms with `FEWER_KERNELS` alone."""

FOLDED_CASTS = False
"""Casts and small index ops folded into the kernels beside them, each with the bits of the separate op: the KDA
output norm rounds the fp32 recurrence output itself, the router's bf16 input is cast inside its fp32 matmul
(`reference.linear(..., out_dtype=)`), the rows' context lengths made once a step (int32) for every MLA layer:
~2 kernels per layer (tiny bf16 decode step: 219 -> 202 with FEWER_KERNELS and RESIDUAL_EPILOGUE). Off until the
GPU tests of GPU_REQUEST.md pass."""


def _kda_gates_torch(f, b, a_log, dt_bias, lower_bound, H: int, K: int):
    """The KDA decay gate g [N, H, K] and beta [N, H] (fp32) from the f_b projection f [N, H * K] and the
    b projection b [N, H]."""
    N = f.shape[0]
    decay = torch.exp(a_log.float()).view(H, 1)
    z = f.view(N, H, K).float() + dt_bias.float().view(H, K)
    if lower_bound is not None:
        g = lower_bound * bi.sigmoid(decay * z)
    else:
        g = -decay * bi.softplus(z)
    return g, bi.sigmoid(b.float())


class _KDAGates(torch.autograd.Function):
    """Forward: `triton_glue.kda_gates`; backward: autograd through the torch form."""

    @staticmethod
    def forward(ctx, f, b, a_log, dt_bias, lower_bound, H, K):
        ctx.save_for_backward(f, b, a_log, dt_bias)
        ctx.args = (lower_bound, H, K)
        return bi._triton_glue().kda_gates(f, b, a_log, dt_bias, lower_bound, H, K)

    @staticmethod
    def backward(ctx, gg, gbeta):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad)]
            outs = _kda_gates_torch(*leaves, *ctx.args)
            pairs = [(o, gr) for o, gr in zip(outs, (gg, gbeta)) if gr is not None]
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [gr for _, gr in pairs], allow_unused=True)
                         if wanted and pairs else ())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None)


def kda_gates(f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              lower_bound: float | None, H: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [N, H, K], beta [N, H]) fp32 (`_kda_gates_torch`); on CUDA with `KDA_GLUE_KERNELS` one Triton
    launch (elementwise: a row's bits are its own)."""
    if KDA_GLUE_KERNELS and bi.on_triton(f) and bi._triton_glue() is not None:
        return _KDAGates.apply(f, b, a_log, dt_bias, lower_bound, H, K)
    return _kda_gates_torch(f, b, a_log, dt_bias, lower_bound, H, K)


def _kda_conv_norm_torch(ext, taps, weight, H: int, K: int):
    """The rows' short conv (`causal_conv` of their W taps ext[tap0 + j], tap0 = taps[n], or n * taps for
    an int) and q/k `l2_normalize`d per head: ext [T, 3, P], weight [3, P, W] -> (q, k, v) [N, H, K] fp32."""
    W = weight.shape[-1]
    ext = ext.reshape(-1, 3, H * K)
    if not isinstance(taps, torch.Tensor):
        ext = ext.view(-1, W, 3, H * K)
        y = bi.causal_conv(list(ext.unbind(1)), weight)
    else:
        T = ext.shape[0] - W + 1  # the conv at every place of ext from its shifted slices, then the rows' places
        y = bi.causal_conv([ext[j : j + T] for j in range(W)], weight)[taps]
    N = y.shape[0]
    return bi.l2_normalize(y[:, 0].view(N, H, K)), bi.l2_normalize(y[:, 1].view(N, H, K)), y[:, 2].view(N, H, K)


class _KDAConvNorm(torch.autograd.Function):
    """Forward: `triton_glue.kda_conv_norm`; backward: autograd through the torch form."""

    @staticmethod
    def forward(ctx, ext, weight, taps, H, K):
        is_t = isinstance(taps, torch.Tensor)
        ctx.save_for_backward(ext, weight, *((taps,) if is_t else ()))
        ctx.args = (None if is_t else taps, H, K)
        return bi._triton_glue().kda_conv_norm(ext, taps, weight, H, K)

    @staticmethod
    def backward(ctx, grad):
        ext, weight, *taps = ctx.saved_tensors
        stride, H, K = ctx.args
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip((ext, weight), ctx.needs_input_grad)]
            out = torch.stack(_kda_conv_norm_torch(leaves[0], taps[0] if taps else stride, leaves[1], H, K))
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None, None, None)


def kda_conv_norm(ext: torch.Tensor, taps, weight: torch.Tensor, H: int, K: int):
    """(q, k, v) of `_kda_conv_norm_torch`; on CUDA with `KDA_GLUE_KERNELS` one Triton launch for every
    row (prefill, decode and the trainer alike: a row's bits are its W inputs')."""
    if KDA_GLUE_KERNELS and bi.on_triton(ext) and bi._triton_glue() is not None:
        return _KDAConvNorm.apply(ext, weight, taps, H, K).unbind(0)
    return _kda_conv_norm_torch(ext, taps, weight, H, K)


def kda_decode_in_place_applies(qkv: torch.Tensor, pool) -> bool:
    """Whether `kda_decode_in_place` serves a decode step: `FEWER_KERNELS` and `KDA_GLUE_KERNELS` on CUDA
    (Triton), no autograd (the engine's step), fp32 recurrent state pages."""
    return (FEWER_KERNELS and KDA_GLUE_KERNELS and bi.on_triton(qkv) and not torch.is_grad_enabled()
            and bi._triton_glue() is not None and bi._cuda_kda() is not None and pool.recurrent.dtype == torch.float32)


def kda_decode_in_place(qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, pool, pages: torch.Tensor,
                        conv_weight: torch.Tensor, H: int, K: int) -> torch.Tensor:
    """One decode token per row through a KDA layer's short conv + L2 norms and delta rule straight from and
    back to its state pages `pages` [N] of `pool` (two launches: `triton_glue.kda_conv_norm_paged`,
    `triton_kda.recurrence_paged`), the bits of `InvariantForward.kda_decode`'s gather, window, the same two
    kernels and scatter (seven launches): qkv [N, 3, P] -> o [N, H, V] fp32."""
    from kimiserve.ops.batch_invariant.triton_kda import recurrence_paged

    qh, kh, vh = bi._triton_glue().kda_conv_norm_paged(qkv, pool.conv, pages, conv_weight, H, K).unbind(0)
    return recurrence_paged(qh, kh, vh, g, beta, pool.recurrent, pages, K ** -0.5)


def _gate_output_torch(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return o.to(dtype).reshape(gate.shape) * bi.sigmoid(gate)


class _TorchBackward(torch.autograd.Function):
    """Forward: a Triton kernel (`fast`); backward: autograd through the torch form (`torch_form`) of the
    tensor arguments, the others passed as they are."""

    @staticmethod
    def forward(ctx, fast, torch_form, *args):
        ctx.fns, ctx.is_t = torch_form, [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [None if t else a for a, t in zip(args, ctx.is_t)]
        ctx.save_for_backward(*(a for a, t in zip(args, ctx.is_t) if t))
        return fast(*args)

    @staticmethod
    def backward(ctx, grad):
        saved = iter(ctx.saved_tensors)
        needs = ctx.needs_input_grad[2:]
        with torch.enable_grad():
            args = [next(saved).detach().requires_grad_(need) if t else a for a, t, need in zip(ctx.others, ctx.is_t, needs)]
            wanted = [a for a, t in zip(args, ctx.is_t) if t and a.requires_grad]
            out = ctx.fns(*args)
            grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True) if wanted else ())
        return (None, None, *(next(grads) if t and a.requires_grad else None for a, t in zip(args, ctx.is_t)))


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.layer_norm` (the index keys' LayerNorm); on CUDA with `FEWER_KERNELS` one Triton program per
    row (`triton_glue.layer_norm`: other bits, ~12 kernels fewer), backward through the torch form."""
    if FEWER_KERNELS and bi.on_triton(x) and bi._triton_glue() is not None:
        return _TorchBackward.apply(bi._triton_glue().layer_norm, bi.layer_norm, x, weight, bias, eps)
    return bi.layer_norm(x, weight, bias, eps)


def _gated_norm_fast(o, gate, weight, eps, dtype):
    from kimiserve.ops.batch_invariant.triton_norm import rms_norm

    return rms_norm(o, weight, eps, gate, out_dtype=dtype)


def _gated_norm_torch(o, gate, weight, eps, dtype):
    return bi._gated_rms_norm_torch(o.to(dtype), gate, weight, eps)


def gated_rms_norm(o: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float, dtype: torch.dtype) -> torch.Tensor:
    """`reference.gated_rms_norm(o.to(dtype), gate, weight, eps)` (KDA's output norm of the fp32 recurrence
    output); on CUDA with `FOLDED_CASTS` the norm kernel rounds o itself (the same bits, one launch fewer)."""
    if FOLDED_CASTS and bi.on_triton(o) and bi._cuda_norm() is not None and o.dtype != dtype:
        return _TorchBackward.apply(_gated_norm_fast, _gated_norm_torch, o, gate, weight, eps, dtype)
    return bi.gated_rms_norm(o.to(dtype), gate, weight, eps)


def gate_output(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MLA's output gate, `o.to(dtype) * reference.sigmoid(gate)` (o [N, H, D] the attention output in any float
    dtype, gate [N, H * D]) -> [N, H * D]; on CUDA with `FEWER_KERNELS` one Triton launch (`triton_glue.gate_output`:
    the product and the sigmoid in fp32, one rounding: other bits than the torch form's, ~6 kernels fewer),
    backward through the torch form."""
    if FEWER_KERNELS and bi.on_triton(o) and bi._triton_glue() is not None and o.dim() == 3:
        return _TorchBackward.apply(bi._triton_glue().gate_output, _gate_output_torch, o, gate, dtype)
    return _gate_output_torch(o, gate, dtype)


class _Route(torch.autograd.Function):
    """Forward: `triton_glue.route`; backward: autograd through the torch weights of the kernel's ids."""

    @staticmethod
    def forward(ctx, logits, bias, top_k, score_func, renormalize, scaling_factor):
        ids, weights = bi._triton_glue().route(logits, bias, top_k, score_func, renormalize, scaling_factor)
        ctx.save_for_backward(logits, ids)
        ctx.args = (score_func, renormalize, scaling_factor)
        ctx.mark_non_differentiable(ids)
        return ids, weights

    @staticmethod
    def backward(ctx, gids, gweights):
        logits, ids = ctx.saved_tensors
        score_func, renormalize, scaling_factor = ctx.args
        with torch.enable_grad():
            leaf = logits.detach().requires_grad_(True)
            w = bi._route_weights(bi._route_scores(leaf, score_func), ids, renormalize, scaling_factor)
            (grad,) = torch.autograd.grad(w, leaf, gweights)
        return grad, None, None, None, None, None


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, *, score_func: str,
          renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route`; on CUDA with `MOE_GLUE_KERNELS` one Triton program per row (`triton_glue.route`:
    its reductions fixed by the expert count and top_k, the ids the same choice; the weights' gradient
    through the torch form at those ids)."""
    if MOE_GLUE_KERNELS and bi.on_triton(router_logits) and router_logits.dim() == 2 and bi._triton_glue() is not None:
        if score_func not in ("sigmoid", "softmax"):
            raise ValueError(f"score_func must be 'sigmoid' or 'softmax', got {score_func!r}")
        return _Route.apply(router_logits.float(), correction_bias, top_k, score_func, renormalize, scaling_factor)
    return bi.route(router_logits, correction_bias, top_k, score_func=score_func, renormalize=renormalize,
                    scaling_factor=scaling_factor)


def _combine_slots_torch(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    N, k = weights.shape
    return bi.tree_sum(y.float().view(N, k, -1) * weights.float().unsqueeze(-1), 1).to(out_dtype)


class _CombineSlots(torch.autograd.Function):
    """Forward: `triton_glue.combine_slots`; backward: autograd through the torch form."""

    @staticmethod
    def forward(ctx, y, weights, out_dtype):
        ctx.save_for_backward(y, weights)
        ctx.out_dtype = out_dtype
        return bi._triton_glue().combine_slots(y, weights, out_dtype)

    @staticmethod
    def backward(ctx, grad):
        saved = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, ctx.needs_input_grad)]
            out = _combine_slots_torch(*leaves, ctx.out_dtype)
            wanted = [t for t in leaves if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad) if wanted else ())
        return (*(next(grads) if t.requires_grad else None for t in leaves), None)


def combine_slots(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """The routed experts' outputs y [N * k, D] (token n's slot j at row n k + j) summed over each token's
    slots with their weights [N, k], in fp32 (a `tree_sum` over the slots), rounded to out_dtype [N, D]; on
    CUDA with `MOE_GLUE_KERNELS` one launch (the slots added in order, each element on its own)."""
    if MOE_GLUE_KERNELS and bi.on_triton(y) and bi._triton_glue() is not None:
        return _CombineSlots.apply(y, weights, out_dtype)
    return _combine_slots_torch(y, weights, out_dtype)
