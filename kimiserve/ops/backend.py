"""The paged decode ops an engine runs, chosen once from the device: Triton kernels on CUDA,
the pure-torch references elsewhere (and on CUDA when Triton is missing)."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from kimiserve.ops.activation import reference as activation_ref
from kimiserve.ops.attn_res import reference as attn_res_ref
from kimiserve.ops.cache_write import reference as cache_write_ref
from kimiserve.ops.indexer import reference as indexer_ref
from kimiserve.ops.kda import paged as kda_ref
from kimiserve.ops.linear import reference as linear_ref
from kimiserve.ops.mla import reference as mla_ref
from kimiserve.ops.moe import reference as moe_ref
from kimiserve.ops.norm import reference as norm_ref
from kimiserve.ops.topk.reference import topk_reference


@dataclass(frozen=True)
class DecodeOps:
    name: str
    write_mla_tokens: Callable
    """(latent_cache, key_cache, key_scales, pages, offsets, latent, keys, kv_cache_dtype, latent_scale)"""
    indexer_scores: Callable
    """(q, weights, key_cache, key_scales, block_tables, context_lens, dtype, max_context, *, rotation=None)
    -> [B, max_context] fp32; rotation: the matrix the keys were stored rotated by (the query is rotated first)"""
    topk: Callable
    """(scores, k, lengths) -> [B, k] positions"""
    sparse_mla_decode: Callable
    """(q_latent, q_pe, latent_cache, latent_scale, block_tables, indices, scale, dtype) -> [B, H, L]"""
    dense_mla_decode: Callable
    """(q_latent, q_pe, latent_cache, latent_scale, block_tables, context_lens, scale, dtype, max_context) -> [B, H, L]"""
    kda_prefill: Callable
    """(q, k, v, g, beta, initial_state [N, H, K, V], cu_seqlens [N + 1] on the CPU or None) -> (o, final states [N, H, K, V]):
    KDA chunked form over [N, T] tokens, or varlen over N sequences packed in [1, total]"""
    kda_decode: Callable
    """(q, k, v, g, beta, states [P, H, K, V] view, page_ids [Bd]) -> o [Bd, 1, H, V]; updates those pages"""
    prefill_indexer_scores: Callable = indexer_ref.prefill_indexer_scores
    """(q [n, Hi, D], weights [n, Hi], key_cache, key_scales, block_table [M], context_lens [n], dtype, max_context,
    *, rotation=None) -> [n, max_context] fp32: the index scan of a prefill chunk's rows, all of one sequence"""
    sparse_mla_prefill: Callable = mla_ref.paged_sparse_mla_prefill
    """(q_latent [n, H, L], q_pe, latent_cache, latent_scale, block_table [M], indices [n, k], scale, dtype, *, out=None)
    -> [n, H, L] in dtype: sparse MLA of a prefill chunk's rows, all of one sequence"""
    short_conv: Callable = kda_ref.short_conv
    """(q, k, v [B, T, H * K], KDADecodeWeights, num_heads, conv_state [B, 3, H * K, W - 1] | None) -> (q, k
    L2-normalised, v [B, T, H, K], new conv state): KDA's short conv over prefill chunks"""
    gated_rms_norm: Callable = norm_ref.gated_rms_norm
    """(x, gate [..., d], weight [d], eps) -> RMSNorm(x) * weight * sigmoid(gate) in x's dtype (KDA's output norm)"""
    prefill_in_place: bool = False
    """MLA prefill chunks: True runs the decode ops above with one row per query token, reading the
    pages in place (the kernels); False gathers the chunk's context and runs the masked full-sequence
    form (the reference)."""
    kda_decode_step: Callable | None = None
    """(q, k, v, f, b, gate, KDADecodeWeights, conv [P, 3, HK, W-1], states [P, H, K, V], page_ids [Bd])
    -> o [Bd, H, V]: a KDA layer's whole decode step after the projections (`kda.paged.kda_decode_step`);
    None: that composition around `kda_decode`"""
    kda_verify_steps: Callable | None = None
    """(q, k, v, f, b, gate [N, ...], KDADecodeWeights, conv, states, page_ids [B], grid [B, T], lengths [B] | None,
    active, out [N, H, V], conv_slots [T, B, ...], state_slots [T, B, H, K, V]) -> out: a KDA layer's speculative
    verify positions with the state after each saved to its slot (`kda.paged.kda_verify_steps`; on CUDA
    `kda.triton_verify`, one launch per layer), so that the commit copies slots instead of replaying the decode
    op. None (the default; `kda_verify_slot_ops` sets it): position by position through `kda_decode_step` on
    copies of the pages, then the replay of the kept positions."""
    rms_norm: Callable = norm_ref.rms_norm
    """(x, weight, eps) -> RMSNorm of x in x's dtype (the MLA latent norms, the latent MoE's norm, the final norm)"""
    add_read_norm: Callable = attn_res_ref.add_read_norm
    """(running, addend | None, blocks, read_norm_weight, read_proj_weight, norm_weight, eps) -> (the sublayer's
    normed input, the live sum): the residual add, the attention-residual read and the RMSNorm before a sublayer"""
    route: Callable = moe_ref.route
    """(fp32 router logits [N, E], correction bias, top_k, **routing options) -> (ids, weights) [N, k]"""
    situ_and_mul: Callable = activation_ref.situ_and_mul
    """(gate, up, beta, linear_beta) -> the SiTU gated activation (shared experts, dense MLPs)"""
    layer_norm: Callable = norm_ref.layer_norm
    """(x, weight, bias, eps) -> LayerNorm of x in x's dtype (the indexer's key norm)"""
    head_matmul: Callable = mla_ref.head_matmul
    """(x [B, H, I], w [H, I, O]) -> [B, H, O] in the compute dtype: MLA's query absorption (w_kc) and output
    projection (w_vc transposed) of the decode rows"""
    linears: Callable = linear_ref.separate_linears
    """(x [..., in], modules) -> each projection module's output: the projections of a layer that read the same
    input (KDA's q, k, v, beta, output gate and gate down-projection; MLA's q_a, kv_a, index key and output gate;
    the shared experts' gate and up with the latent MoE's down projection; a dense MLP's gate and up)"""
    linear_add: Callable = linear_ref.linear_add
    """(x, module, addend) -> addend + module(x): the shared experts' down projection onto the routed output"""
    gate_output: Callable = activation_ref.gate_output
    """(o [..., n] fp32 or dtype, gate [..., n] | None, dtype) -> o in dtype times sigmoid(gate): MLA's output gate
    on the attention output of a serving batch's rows"""
    overlap_shared_experts: bool = False
    """CUDA: a MoE block's shared experts (activation and down projection, after the projections that read the
    block's input) run on a second stream beside the router, the routed experts and the latent projections, and are
    added after the join as `linear_ref.linear_add` adds them (SGLang's dual-stream MoE): a few-token batch's routed
    experts read their weights below the copy bandwidth, which the shared experts' GEMM can use
    (`shared_expert_overlap_ops`). Nothing changes on the CPU."""
    moe_layout: str = "checkpoint"
    """The layout MXFP4 routed experts hold their codes in where the fused MoE kernel runs (`ModelRunner.ops`
    re-lays them once when set): "checkpoint" (the "lut" decode) or "shift" (`ops.moe.mxfp4_layout`, the
    cheaper "shift" decode; layers whose scale bytes exceed MAX_SHIFT_SCALE keep the checkpoint layout)."""

    def __post_init__(self):
        if self.kda_decode_step is None:
            object.__setattr__(self, "kda_decode_step", functools.partial(kda_ref.kda_decode_step,
                                                                          kda_decode=self.kda_decode))


REFERENCE_OPS = DecodeOps(
    "reference", cache_write_ref.write_mla_tokens, indexer_ref.paged_indexer_scores, topk_reference,
    mla_ref.paged_sparse_mla_decode, mla_ref.paged_dense_mla_decode, kda_ref.kda_prefill, kda_ref.kda_decode,
)


def _kda_ops() -> tuple[Callable, Callable]:
    """fla-core's KDA kernels, or the references (with a warning) when fla does not import."""
    try:
        from kimiserve.ops.kda import fla as kda_fla
    except Exception as e:  # ImportError, or fla failing to set itself up on this device
        warnings.warn(f"fla-core unavailable ({e}); KDA runs the pure-torch reference on the GPU")
        return kda_ref.kda_prefill, kda_ref.kda_decode
    return kda_fla.kda_prefill, kda_fla.kda_decode


def fused_glue_ops(ops: DecodeOps) -> DecodeOps:
    """`ops` with the Triton kernels of the decode step's glue (RMSNorm, LayerNorm, the residual add + attention-residual
    read + RMSNorm, the router's selection, SiTU, MLA's per-head matmuls): what the serving path runs on CUDA (and what
    the interpreter tests run on the CPU). Raises ImportError without Triton."""
    from kimiserve.ops.activation import triton as activation_tt
    from kimiserve.ops.attn_res import triton as attn_res_tt
    from kimiserve.ops.mla import head_matmul_triton
    from kimiserve.ops.moe import route_triton
    from kimiserve.ops.norm import triton as norm_tt

    return dataclasses.replace(ops, rms_norm=norm_tt.rms_norm, layer_norm=norm_tt.layer_norm, add_read_norm=attn_res_tt.add_read_norm,
                               route=route_triton.route, situ_and_mul=activation_tt.situ_and_mul,
                               head_matmul=head_matmul_triton.head_matmul)


PREFILL_SCAN_BLOCK_Q = 8
"""Query rows per program of the query-tiled index scan on CUDA: the fastest tiling with every mask right in
the H200 sweep (benchmarks/prefill_attention.py, 2026-12-01 session 4: 8 rows x 8 key tiles, 4 warps, 2 stages,
1.33 ms against the decode kernel's 2.21-2.33 ms for 512 rows over 32K / 128K fp8 keys)."""


def prefill_kernels(ops: DecodeOps) -> DecodeOps:
    """`ops` with the prefill kernels (what `select_decode_ops` runs on CUDA; the interpreter tests apply it
    to their own op sets): the query-tiled index scan (`PREFILL_SCAN_BLOCK_Q` rows per program), sparse MLA
    rounding its output to the model dtype in the kernel, and KDA's short conv (+ L2 norms) and gated output
    norm as Triton kernels. On the H200 (session 4) they took the `small` preset's 32K prefill from 1.68 to
    1.34 s and 128K from 7.30 to 5.76 s (benchmarks/e2e_step.py). Raises ImportError without Triton."""
    from kimiserve.ops.conv import triton as conv_tt
    from kimiserve.ops.indexer import triton_prefill as indexer_prefill_tt
    from kimiserve.ops.mla import triton as mla_tt
    from kimiserve.ops.norm import triton as norm_tt

    return dataclasses.replace(
        ops, prefill_indexer_scores=functools.partial(indexer_prefill_tt.prefill_indexer_scores, block_q=PREFILL_SCAN_BLOCK_Q),
        sparse_mla_prefill=functools.partial(mla_tt.paged_sparse_mla_prefill, round_in_kernel=True),
        short_conv=conv_tt.short_conv, gated_rms_norm=norm_tt.gated_rms_norm)


def _projection_base(name: str) -> str:
    return name.replace("+fewer-kernels", "").replace("+separate-projections", "")


def fewer_kernel_ops(ops: DecodeOps) -> DecodeOps:
    """`ops` with fewer kernels per decode step (what `select_decode_ops` gives a CUDA engine since session 6):
    the projections of a layer that read the same input as one GEMM over their stacked weights
    (`ops.linear.merged`), the shared experts' down projection accumulating onto the routed output (addmm), and
    MLA's output cast + sigmoid gate as one Triton kernel. kimi-demo's bf16 decode graph as it launches on CUDA
    (`benchmarks/spec_graph_kernels.py --ops cuda|fewer --dtype bfloat16`, CPU count): 211 -> 149 kernels (KDA
    layer 9 -> 4, MoE block 12 -> 9, MLA layer 23 -> 18); on the H200 its decode graph replays in 0.48 instead of
    0.61 ms (1.27x the tokens/s at batch 1, same greedy tokens; BENCHMARKS.md, "Session 6 on the H200"). The
    first eager call with a group stacks its weights (a call under CUDA graph capture with an unstacked group
    runs the projections apart); graphs captured before a parameter was replaced (not copied into) read the
    old storage. Raises ImportError without Triton."""
    from kimiserve.ops.activation import triton as activation_tt
    from kimiserve.ops.linear import merged

    return dataclasses.replace(ops, name=f"{_projection_base(ops.name)}+fewer-kernels", linears=merged.merged_linears,
                               linear_add=merged.linear_add, gate_output=activation_tt.gate_output)


def separate_kernel_ops(ops: DecodeOps) -> DecodeOps:
    """`ops` with each projection, the shared experts' down projection and add, and MLA's output gate as their
    reference compositions: the other side of `fewer_kernel_ops`' A/B (the CUDA engine before session 6)."""
    return dataclasses.replace(ops, name=f"{_projection_base(ops.name)}+separate-projections", linears=linear_ref.separate_linears,
                               linear_add=linear_ref.linear_add, gate_output=activation_ref.gate_output)


def shared_expert_overlap_ops(ops: DecodeOps) -> DecodeOps:
    """`ops` with `overlap_shared_experts` (opt-in: on one H100 the `small` preset's decode step gained nothing
    from it at batch 1 or 64, BENCHMARKS.md session 26, `benchmarks/e2e_step.py --shared-experts serial,overlap`);
    `dataclasses.replace(ops, overlap_shared_experts=False)` is the other side of the A/B."""
    return dataclasses.replace(ops, name=f"{ops.name}+shared-overlap", overlap_shared_experts=True)


def shift_moe_layout(ops: DecodeOps) -> DecodeOps:
    """`ops` with the MXFP4 routed experts re-laid for the fused MoE kernel's "shift" decode: what
    `select_decode_ops` gives a CUDA engine (H200, session 5: 1-2% faster whole decode steps of `small` than
    the checkpoint layout's "lut" decode, 1.17-1.26x faster MoE layers); the benchmarks' and tests' name for it
    beside `dataclasses.replace(ops, moe_layout="checkpoint")`, the other side of the A/B."""
    return dataclasses.replace(ops, name=f"{ops.name}+moe-shift", moe_layout="shift")


KDA_VERIFY_SLOTS_ON_CUDA = True
"""The switch: True gives CUDA engines `kda_verify_slot_ops` (verify steps' KDA positions in one Triton launch per
layer, the commit a copy of per-position state slots). On since session 10: the launch is the decode step's own
compiled kernel, so on the H200 its positions are bit for bit decode steps (`tests/test_kda_verify_steps_interpret.py`
and `tests/test_spec_decode_gpu.py` pass there both ways), and kimi-demo's rounds are 9-15% faster (BENCHMARKS.md)."""


def kda_verify_slot_ops(ops: DecodeOps) -> DecodeOps:
    """`ops` with `kda_verify_steps` set: the one-launch Triton op (`kda.triton_verify`) when `ops.kda_decode_step`
    is the fused Triton decode step (with the same fallback, block_v and counters, whose form and bits it
    keeps), else the reference loop around `ops.kda_decode_step`."""
    step = ops.kda_decode_step
    if getattr(getattr(step, "func", None), "__module__", None) == "kimiserve.ops.kda.triton_decode":
        from kimiserve.ops.kda import triton_verify

        verify = functools.partial(triton_verify.kda_verify_steps, **step.keywords)
    else:
        verify = functools.partial(kda_ref.kda_verify_steps, decode_step=step)
    return dataclasses.replace(ops, name=f"{ops.name}+kda-verify-slots", kda_verify_steps=verify)


def select_decode_ops(device: torch.device) -> DecodeOps:
    if device.type != "cuda":
        return REFERENCE_OPS
    try:
        from kimiserve.ops.cache_write import triton as cache_write_tt
        from kimiserve.ops.indexer import triton as indexer_tt
        from kimiserve.ops.indexer import triton_prefill as indexer_prefill_tt
        from kimiserve.ops.kda import triton_decode as kda_decode_step_tt
        from kimiserve.ops.mla import triton as mla_tt
        from kimiserve.ops.topk import triton as topk_tt
        fused_glue_ops(REFERENCE_OPS)  # imports the glue kernels' modules
    except ImportError as e:
        warnings.warn(f"Triton kernels unavailable ({e}); the GPU runs the pure-torch reference ops")
        return REFERENCE_OPS
    kda_prefill, kda_decode = _kda_ops()
    kernels = DecodeOps("triton", cache_write_tt.write_mla_tokens, indexer_tt.paged_indexer_scores,
                        topk_tt.topk_indices, mla_tt.paged_sparse_mla_decode, mla_tt.paged_dense_mla_decode,
                        kda_prefill, kda_decode, prefill_in_place=True, moe_layout="shift",
                        prefill_indexer_scores=indexer_prefill_tt.prefill_indexer_scores,
                        sparse_mla_prefill=mla_tt.paged_sparse_mla_prefill,
                        kda_decode_step=functools.partial(kda_decode_step_tt.kda_decode_step, fallback=kda_decode))
    ops = fewer_kernel_ops(prefill_kernels(fused_glue_ops(kernels)))
    return kda_verify_slot_ops(ops) if KDA_VERIFY_SLOTS_ON_CUDA else ops
