"""Triton forms of the batch-invariant forward's glue around the KDA recurrence and the routed experts
(the GPU forms of `reference._kda_gates_torch`, `reference._kda_conv_norm_torch` and
`triton.TilePlan.of`), each one launch where the torch compositions launch ~10-30 kernels.

- `kda_gates`: one program per (row, head): the decay gate (exp(A_log), dt_bias, the lower-bound
  sigmoid or the softplus) and the beta sigmoid. Elementwise: a row's bits are its own inputs'.
- `kda_conv_norm`: one program per (row, q/k/v, head): the 4-tap short conv from the row's W inputs
  (the conv state then the row's own: the same values in prefill, decode and the trainer), SiLU, and
  for q and k the L2 norm over the head with one fixed-shape `tl.sum` (shape fixed by the head dim).
  The same kernel and arithmetic for every row of every kind of step, so a token's bits do not depend
  on whether it was prefilled (chunked or not) or decoded.
- `tile_plan`: the device-side expert plan in one program (rows up to a size): the stable order by
  group from one `tl.sort`, the group histogram, and each used tile written by its group; equal
  element for element to `TilePlan.of` (the interpreter tests check it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kimiserve.ops.batch_invariant.triton import CONFIG, TilePlan


@triton.jit
def _kda_gates_kernel(f_ptr, b_ptr, a_log_ptr, dt_bias_ptr, g_ptr, beta_ptr, H, sf, sb, lower_bound,
                      K: tl.constexpr, BK: tl.constexpr, LOWER_BOUND: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    kk = tl.arange(0, BK)
    m = kk < K
    f = tl.load(f_ptr + n * sf + h * K + kk, mask=m, other=0.0).to(tl.float32)
    z = f + tl.load(dt_bias_ptr + h * K + kk, mask=m, other=0.0).to(tl.float32)
    decay = tl.exp(tl.load(a_log_ptr + h).to(tl.float32))
    if LOWER_BOUND:
        g = lower_bound * (1.0 / (1.0 + tl.exp(-(decay * z))))
    else:
        g = -decay * tl.where(z > 20.0, z, tl.log(1.0 + tl.exp(tl.minimum(z, 20.0))))
    tl.store(g_ptr + (n * H + h) * K + kk, g, mask=m)
    b = tl.load(b_ptr + n * sb + h).to(tl.float32)
    tl.store(beta_ptr + n * H + h, 1.0 / (1.0 + tl.exp(-b)))


def kda_gates(f: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              lower_bound: float | None, H: int, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """f [N, H * K] (the f_b projection), b [N, H] (the b projection), A_log [H], dt_bias [H * K] ->
    (g [N, H, K], beta [N, H]) fp32."""
    N = f.shape[0]
    f2, b2 = f.reshape(N, H * K), b.reshape(N, H)
    if N and f2.stride(-1) != 1:
        f2 = f2.contiguous()
    if N and b2.stride(-1) != 1:
        b2 = b2.contiguous()
    g = torch.empty(N, H, K, dtype=torch.float32, device=f.device)
    beta = torch.empty(N, H, dtype=torch.float32, device=f.device)
    if N and H:
        _kda_gates_kernel[(N, H)](f2, b2, a_log.reshape(-1).contiguous(), dt_bias.reshape(-1).contiguous(), g, beta,
                                  H, f2.stride(0), b2.stride(0), 0.0 if lower_bound is None else float(lower_bound),
                                  K=K, BK=triton.next_power_of_2(K), LOWER_BOUND=lower_bound is not None,
                                  num_warps=1 if K <= 256 else 4)
    return g, beta


@triton.jit
def _kda_conv_norm_kernel(ext_ptr, taps_ptr, w_ptr, out_ptr, N, H, tap_stride, eps, conv_ptr, sx, sp, spage,
                          K: tl.constexpr, BK: tl.constexpr, W: tl.constexpr, HAS_TAPS: tl.constexpr,
                          PAGED: tl.constexpr):
    """PAGED (one decode token per row): row n's first W - 1 taps are its conv state page taps_ptr[n * sp] of
    conv_ptr ([pages, 3, P, W - 1], page stride spage), its last its own input ext_ptr[n * sx + col]; the
    conv state then moves on by one tap in place (the same products and sums as the window form)."""
    n = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    h = tl.program_id(2)
    P = H * K
    kk = tl.arange(0, BK)
    m = kk < K
    if PAGED:
        tap0 = tl.load(taps_ptr + n * sp).to(tl.int64)  # the state page
    elif HAS_TAPS:
        tap0 = tl.load(taps_ptr + n).to(tl.int64)
    else:
        tap0 = n * tap_stride
    col = c * P + h * K + kk  # the channel in [3, P]
    acc = tl.zeros((BK,), tl.float32)
    for j in tl.static_range(W):
        if PAGED:
            if j < W - 1:
                x = tl.load(conv_ptr + tap0 * spage + col * (W - 1) + j, mask=m, other=0.0).to(tl.float32)
            else:
                x = tl.load(ext_ptr + n * sx + col, mask=m, other=0.0).to(tl.float32)
        else:
            x = tl.load(ext_ptr + (tap0 + j) * 3 * P + col, mask=m, other=0.0).to(tl.float32)
        acc += x * tl.load(w_ptr + col * W + j, mask=m, other=0.0).to(tl.float32)
    y = acc * (1.0 / (1.0 + tl.exp(-acc)))
    if c < 2:
        y = y * tl.rsqrt(tl.sum(y * y, axis=0) + eps)
    tl.store(out_ptr + ((c * N + n) * H + h) * K + kk, y, mask=m)
    if PAGED:  # the state's taps 1 .. W - 2 then this input become taps 0 .. W - 2 (each read before it is overwritten)
        state = conv_ptr + tap0 * spage + col * (W - 1)
        for j in tl.static_range(W - 1):
            tl.debug_barrier()
            if j < W - 2:
                x = tl.load(state + j + 1, mask=m, other=0.0)
            else:
                x = tl.load(ext_ptr + n * sx + col, mask=m, other=0.0)
            tl.debug_barrier()
            tl.store(state + j, x.to(conv_ptr.dtype.element_ty), mask=m)


def kda_conv_norm(ext: torch.Tensor, taps, weight: torch.Tensor, H: int, K: int, eps: float = 1e-6):
    """Rows' short conv and q/k L2 norms: ext [T, 3, P] (P = H * K) the inputs, row n's W taps at
    ext[tap0 + j], j < W, tap0 = taps[n] (int [N]) or n * taps (an int stride); weight [3, P, W] ->
    out [3, N, H, K] fp32 (q, k L2-normed per head; v)."""
    W = weight.shape[-1]
    P = H * K
    ext = ext.reshape(-1, 3, P)
    if not ext.is_contiguous():
        ext = ext.contiguous()
    has_taps = isinstance(taps, torch.Tensor)
    N = taps.shape[0] if has_taps else ext.shape[0] // W
    out = torch.empty(3, N, H, K, dtype=torch.float32, device=ext.device)
    if N and H:
        tap_t = taps.contiguous() if has_taps else ext
        _kda_conv_norm_kernel[(N, 3, H)](ext, tap_t, weight.float().contiguous(), out, N, H, 0 if has_taps else int(taps),
                                         eps, ext, 0, 0, 0, K=K, BK=triton.next_power_of_2(K), W=W, HAS_TAPS=has_taps,
                                         PAGED=False, num_warps=1 if K <= 256 else 4)
    return out


def kda_conv_norm_paged(x: torch.Tensor, conv_state: torch.Tensor, pages: torch.Tensor, weight: torch.Tensor,
                        H: int, K: int, eps: float = 1e-6) -> torch.Tensor:
    """`kda_conv_norm` of decode rows (one token each) straight from the state pages: x [N, 3, P] the rows'
    inputs (any row stride), conv_state [pages, 3, P, W - 1] (the pool's, any page stride), pages [N] (any
    stride) row n's state page, weight [3, P, W] -> out [3, N, H, K] fp32, the bits of `kda_conv_norm` of the
    window (the page's taps then x[n]) as `InvariantForward.kda_decode` builds it; the pages' conv states
    then hold their last W - 1 inputs (written in place: rows must have pages of their own)."""
    N, W, P = x.shape[0], weight.shape[-1], H * K
    if x.shape[1:] != (3, P) or conv_state.shape[1:] != (3, P, W - 1) or pages.shape != (N,):
        raise ValueError(f"kda_conv_norm_paged: x {tuple(x.shape)}, conv_state {tuple(conv_state.shape)}, pages "
                         f"{tuple(pages.shape)} for H={H}, K={K}, W={W}")
    if x.stride(2) != 1 or x.stride(1) != P:
        x = x.contiguous()
    if conv_state[0].stride() != (P * (W - 1), W - 1, 1):
        raise ValueError("kda_conv_norm_paged: each conv state page must be contiguous [3, P, W - 1]")
    out = torch.empty(3, N, H, K, dtype=torch.float32, device=x.device)
    if N and H:
        _kda_conv_norm_kernel[(N, 3, H)](x, pages, weight.float().contiguous(), out, N, H, 0, eps, conv_state,
                                         x.stride(0), pages.stride(0), conv_state.stride(0), K=K,
                                         BK=triton.next_power_of_2(K), W=W, HAS_TAPS=False, PAGED=True,
                                         num_warps=1 if K <= 256 else 4)
    return out


@triton.jit
def _tile_plan_kernel(groups_ptr, order_ptr, tile_group_ptr, tile_start_ptr, tile_end_ptr, M, G, T,
                      BM: tl.constexpr, MB: tl.constexpr, GB: tl.constexpr, TB: tl.constexpr,
                      MAX_TILES: tl.constexpr):
    offs = tl.arange(0, MB)
    ok = offs < M
    grp = tl.load(groups_ptr + offs, mask=ok, other=0).to(tl.int32)
    key = tl.where(ok, tl.where(grp < 0, G, grp), G + 1)  # no group: after every group; padding last
    bins = tl.arange(0, GB)
    counts = tl.where(bins < G, tl.histogram(key, GB), 0)
    keys = tl.sort(key * MB + offs)  # by group, then row: the stable order
    tl.store(order_ptr + offs, (keys % MB).to(tl.int64), mask=ok)
    tiles = (counts + BM - 1) // BM
    tile_end = tl.cumsum(tiles, 0)
    row_end = tl.cumsum(counts, 0)
    # every tile first as an unused one (the last group, no rows), then each group's own overwrite theirs
    tt = tl.arange(0, TB)
    tok = tt < T
    tl.store(tile_group_ptr + tt, tl.zeros((TB,), tl.int64) + tl.maximum(G - 1, 0), mask=tok)
    tl.store(tile_start_ptr + tt, tl.zeros((TB,), tl.int64), mask=tok)
    tl.store(tile_end_ptr + tt, tl.zeros((TB,), tl.int64), mask=tok)
    tl.debug_barrier()  # the stores above land before the overwrites below
    for i in tl.static_range(MAX_TILES):
        mine = (bins < G) & (i < tiles)
        t = tile_end - tiles + i
        start = row_end - counts + i * BM
        tl.store(tile_group_ptr + t, bins.to(tl.int64), mask=mine)
        tl.store(tile_start_ptr + t, start.to(tl.int64), mask=mine)
        tl.store(tile_end_ptr + t, tl.minimum(start + BM, row_end).to(tl.int64), mask=mine)


def tile_plan(groups: torch.Tensor, num_groups: int) -> TilePlan:
    """`TilePlan.of(groups, num_groups)` in one launch (the same tensors, element for element)."""
    M, G, bm = groups.shape[0], num_groups, CONFIG["BM"]
    T = triton.cdiv(M, bm) + min(G, M)
    dev = groups.device
    order = torch.empty(M, dtype=torch.int64, device=dev)
    tile_group, tile_start, tile_end = (torch.empty(T, dtype=torch.int64, device=dev) for _ in range(3))
    if M == 0 or G == 0:
        return TilePlan.of(groups, num_groups)
    MB = max(triton.next_power_of_2(M), 2)
    _tile_plan_kernel[(1,)](groups.contiguous(), order, tile_group, tile_start, tile_end, M, G, T,
                            BM=bm, MB=MB, GB=max(triton.next_power_of_2(G + 2), 2),
                            TB=max(triton.next_power_of_2(T), 2), MAX_TILES=triton.cdiv(MB, bm),
                            num_warps=4 if MB <= 512 else 8)
    return TilePlan(groups, order, tile_group, tile_start, tile_end)


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, ids_ptr, w_ptr, E, sl, scaling,
                  TOP_K: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr, SOFTMAX: tl.constexpr,
                  HAS_BIAS: tl.constexpr, RENORMALIZE: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    ee = tl.arange(0, BE)
    m = ee < E
    x = tl.load(logits_ptr + n * sl + ee, mask=m, other=float("-inf")).to(tl.float32)
    if SOFTMAX:
        e = tl.where(m, tl.exp(x - tl.max(x, axis=0)), 0.0)
        scores = e / tl.sum(e, axis=0)
    else:
        scores = 1.0 / (1.0 + tl.exp(-x))
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(bias_ptr + ee, mask=m, other=0.0).to(tl.float32)
    choice = tl.where(m, choice, float("-inf"))
    kk = tl.arange(0, BT)
    ids = tl.zeros((BT,), tl.int32)
    w = tl.zeros((BT,), tl.float32)
    for j in tl.static_range(TOP_K):  # the best left, ties to the smaller id: the stable descending sort's order
        best = tl.argmax(choice, axis=0, tie_break_left=True).to(tl.int32)
        pick = ee == best
        ids = tl.where(kk == j, best, ids)
        w = tl.where(kk == j, tl.sum(tl.where(pick, scores, 0.0), axis=0), w)
        choice = tl.where(pick, float("-inf"), choice)
    if RENORMALIZE:
        w = w / (tl.sum(w, axis=0) + 1e-20)
    tl.store(ids_ptr + n * TOP_K + kk, ids.to(tl.int64), mask=kk < TOP_K)
    tl.store(w_ptr + n * TOP_K + kk, w * scaling, mask=kk < TOP_K)


def route(router_logits: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int, score_func: str,
          renormalize: bool, scaling_factor: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.route` per row in one launch: router_logits [N, E] -> (ids [N, top_k] int64 in descending
    choice order, ties to the smaller id; weights [N, top_k] fp32)."""
    N, E = router_logits.shape
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    ids = torch.empty(N, top_k, dtype=torch.int64, device=logits.device)
    weights = torch.empty(N, top_k, dtype=torch.float32, device=logits.device)
    if N and top_k:
        bias = logits if correction_bias is None else correction_bias.reshape(-1).contiguous()
        BE = max(triton.next_power_of_2(E), 2)
        _route_kernel[(N,)](logits, bias, ids, weights, E, logits.stride(0), float(scaling_factor), TOP_K=top_k, BE=BE,
                            BT=max(triton.next_power_of_2(top_k), 2), SOFTMAX=score_func == "softmax",
                            HAS_BIAS=correction_bias is not None, RENORMALIZE=renormalize and top_k > 1,
                            num_warps=1 if BE <= 256 else 4)
    return ids, weights


@triton.jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, D, TOP_K: tl.constexpr, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    dd = tl.program_id(1) * BD + tl.arange(0, BD)
    m = dd < D
    acc = tl.zeros((BD,), tl.float32)
    for j in tl.static_range(TOP_K):  # the slots in order, whatever BD (each element its own sum)
        w = tl.load(w_ptr + n * TOP_K + j).to(tl.float32)
        acc += tl.load(y_ptr + (n * TOP_K + j) * D + dd, mask=m, other=0.0).to(tl.float32) * w
    tl.store(out_ptr + n * D + dd, acc.to(out_ptr.dtype.element_ty), mask=m)


def combine_slots(y: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """y [N * k, D] (each token's slots one after the other), weights [N, k] -> sum_j weights[n, j] y[n k + j]
    [N, D] in fp32, slot by slot, rounded once to out_dtype."""
    N, k = weights.shape
    D = y.shape[-1]
    y, weights = y.contiguous(), weights.contiguous()
    out = torch.empty(N, D, dtype=out_dtype, device=y.device)
    if N and D:
        BD = min(triton.next_power_of_2(D), 1024)
        _combine_kernel[(N, triton.cdiv(D, BD))](y, weights, out, D, TOP_K=k, BD=BD, num_warps=4)
    return out


@triton.jit
def _layer_norm_kernel(x_ptr, w_ptr, b_ptr, out_ptr, D, sx, so, eps, BD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, BD)
    m = dd < D
    x = tl.load(x_ptr + row * sx + dd, mask=m, other=0.0).to(tl.float32)
    centred = tl.where(m, x - tl.sum(x, axis=0) / D, 0.0)
    var = tl.sum(centred * centred, axis=0) / D
    w = tl.load(w_ptr + dd, mask=m, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + dd, mask=m, other=0.0).to(tl.float32)
    y = centred * tl.rsqrt(var + eps) * w + b
    tl.store(out_ptr + row * so + dd, y.to(out_ptr.dtype.element_ty), mask=m)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """`reference.layer_norm` (mean, centred variance, fp32, one rounding to x's dtype) as one program per row of
    x [..., D] (any row stride): each reduction one fixed-shape `tl.sum` over the row padded to a power of two."""
    D = x.shape[-1]
    x2 = x.reshape(-1, D)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _layer_norm_kernel[(x2.shape[0],)](x2, weight.reshape(-1).contiguous(), bias.reshape(-1).contiguous(), out, D,
                                           x2.stride(0), out.stride(0), eps, BD=triton.next_power_of_2(D),
                                           num_warps=4 if D <= 2048 else 8)
    return out.view(x.shape)


@triton.jit
def _gate_output_kernel(o_ptr, g_ptr, out_ptr, H, D, so0, so1, sg, BD: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    dd = tl.arange(0, BD)
    m = dd < D
    o = tl.load(o_ptr + n * so0 + h * so1 + dd, mask=m, other=0.0).to(out_ptr.dtype.element_ty).to(tl.float32)
    g = tl.load(g_ptr + n * sg + h * D + dd, mask=m, other=0.0).to(tl.float32)
    s = 1.0 / (1.0 + tl.exp(-g))
    tl.store(out_ptr + (n * H + h) * D + dd, (o * s).to(out_ptr.dtype.element_ty), mask=m)


def gate_output(o: torch.Tensor, gate: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MLA's gated output: o [N, H, D] (any float dtype and strides but a unit last one; rounded to `dtype`
    first) times sigmoid(gate [N, H * D]) in fp32, rounded once to `dtype` -> [N, H * D] (elementwise: a row's
    bits are its own)."""
    N, H, D = o.shape
    if o.stride(-1) != 1:
        o = o.contiguous()
    if gate.stride(-1) != 1:
        gate = gate.contiguous()
    out = torch.empty(N, H * D, dtype=dtype, device=o.device)
    if N and H and D:
        _gate_output_kernel[(N, H)](o, gate, out, H, D, o.stride(0), o.stride(1), gate.stride(0),
                                    BD=triton.next_power_of_2(D), num_warps=1 if D <= 256 else 4)
    return out
