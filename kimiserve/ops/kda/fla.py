"""KDA on the GPU through fla-core's Triton kernels (imported only when CUDA is present).

Same contracts and semantics as the reference wrappers in `kimiserve.ops.kda.paged` (only rounding
differs): q, k [B, T, H, K] already L2-normalised by the caller (fla's in-kernel L2 norm stays off);
v [B, T, H, V]; g the per-channel natural-log decay [B, T, H, K] (<= 0, fp32), passed to fla as is
(use_gate_in_kernel=False: fla takes it as the pre-computed log decay and does the chunk cumsum
itself); beta [B, T, H] post-sigmoid; states fp32 in fla's default K-first layout [H, K, V]
(state_v_first=False), which is the layout of the state pages; scale K^-0.5.

Shapes fla cannot run (K or V above 256) fall back to the references, per call; so does an fp32
prefill (fla's chunked kernels use tensor-core dots, tf32 for fp32 inputs, ~1e-3 off: an fp32 model
is the accuracy mode). The recurrent kernel has no dots (fp32 throughout), so decode uses fla at
every dtype.
"""

from __future__ import annotations

import torch
from fla.ops.kda import chunk_kda
from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd

from kimiserve.ops.kda import paged as reference

MAX_HEAD_DIM = 256  # chunk_kda asserts K <= 256; the recurrent kernel holds a [K, 32] fp32 tile per program


def supported(K: int, V: int) -> bool:
    """Whether fla runs these head dims (else the references do)."""
    return K <= MAX_HEAD_DIM and V <= MAX_HEAD_DIM


def kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens=None, *, varlen_launch=True):
    """From initial_state [N, H, K, V] fp32 (a copy, not a page view): over [N, T] tokens, or
    (cu_seqlens int64 [N + 1] on the CPU) over the N sequences packed in [1, total]. Returns (o
    shaped as v, in v's dtype; final states [N, H, K, V] fp32). fla's chunked kernels, chunk size 64.

    Several packed sequences go through fla's varlen path (one chunk_kda call, cu_seqlens on the
    device and on the CPU; ~0.3 ms of set-up that one sequence skips); varlen_launch=False runs one
    fla call per sequence instead (the tests compare both)."""
    if not supported(q.shape[-1], v.shape[-1]) or v.dtype not in (torch.bfloat16, torch.float16):
        return reference.kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens)
    if cu_seqlens is not None and not varlen_launch:
        return reference.each_packed_sequence(kda_prefill, q, k, v, g, beta, initial_state, cu_seqlens)
    varlen = {}
    if cu_seqlens is not None and len(cu_seqlens) == 2:  # one sequence: the plain call, no varlen set-up
        cu_seqlens = None
    if cu_seqlens is not None:
        cpu = cu_seqlens.to(device="cpu", dtype=torch.int64)
        varlen = dict(cu_seqlens=cpu.to(q.device, non_blocking=True), cu_seqlens_cpu=cpu)
    o, state = chunk_kda(
        q.contiguous(), k.contiguous(), v.contiguous(), g.float().contiguous(), beta.contiguous(),
        initial_state=initial_state.float().contiguous(), output_final_state=True,
        use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False, **varlen,
    )
    return o, state


def kda_decode(q, k, v, g, beta, states, page_ids):
    """One token per sequence: q, k [Bd, 1, H, K], ..., states the pool's state view [P, H, K, V]
    fp32 (page stride arbitrary, each page's [H, K, V] contiguous), page_ids int [Bd] distinct.

    Updates states[page_ids] in place through fla's continuous-batching path (ssm_state_indices,
    inplace_final_state): each program reads its page's state at page_ids[b] * states.stride(0)
    and writes it back there; no gather or scatter, other pages untouched. Returns o [Bd, 1, H, V]."""
    H, K, V = states.shape[1:]
    if not supported(K, V) or states[0].stride() != (K * V, V, 1):
        return reference.kda_decode(q, k, v, g, beta, states, page_ids)
    if page_ids.numel() == 0:
        return v.new_empty(v.shape)
    with torch.cuda.device(q.device):
        o, _ = fused_recurrent_kda_fwd(
            q=q.contiguous(), k=k.contiguous(), v=v.contiguous(), g=g.float().contiguous(),
            beta=beta.contiguous(), initial_state=states, inplace_final_state=True,
            ssm_state_indices=page_ids.to(device=q.device, dtype=torch.int32).contiguous(),
            use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
        )
    return o
