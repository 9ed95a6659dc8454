"""The paged decode ops an engine runs, chosen once from the device: Triton kernels on CUDA,
the pure-torch references elsewhere (and on CUDA when Triton is missing)."""

from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import Callable

import torch

from kimiserve.ops.cache_write import reference as cache_write_ref
from kimiserve.ops.indexer import reference as indexer_ref
from kimiserve.ops.kda import paged as kda_ref
from kimiserve.ops.mla import reference as mla_ref
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
    prefill_in_place: bool = False
    """MLA prefill chunks: True runs the decode ops above with one row per query token, reading the
    pages in place (the kernels); False gathers the chunk's context and runs the masked full-sequence
    form (the reference)."""
    kda_decode_step: Callable | None = None
    """(q, k, v, f, b, gate, KDADecodeWeights, conv [P, 3, HK, W-1], states [P, H, K, V], page_ids [Bd])
    -> o [Bd, H, V]: a KDA layer's whole decode step after the projections (`kda.paged.kda_decode_step`);
    None: that composition around `kda_decode`"""

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


def select_decode_ops(device: torch.device) -> DecodeOps:
    if device.type != "cuda":
        return REFERENCE_OPS
    try:
        from kimiserve.ops.cache_write import triton as cache_write_tt
        from kimiserve.ops.indexer import triton as indexer_tt
        from kimiserve.ops.kda import triton_decode as kda_decode_step_tt
        from kimiserve.ops.mla import triton as mla_tt
        from kimiserve.ops.topk import triton as topk_tt
    except ImportError as e:
        warnings.warn(f"Triton kernels unavailable ({e}); the GPU runs the pure-torch reference ops")
        return REFERENCE_OPS
    kda_prefill, kda_decode = _kda_ops()
    return DecodeOps("triton", cache_write_tt.write_mla_tokens, indexer_tt.paged_indexer_scores,
                     topk_tt.topk_indices, mla_tt.paged_sparse_mla_decode, mla_tt.paged_dense_mla_decode,
                     kda_prefill, kda_decode, prefill_in_place=True,
                     kda_decode_step=functools.partial(kda_decode_step_tt.kda_decode_step, fallback=kda_decode))
