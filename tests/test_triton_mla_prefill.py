"""`triton.paged_sparse_mla_prefill` (a prefill chunk's query rows of one sequence, one split per row,
output in the model dtype: rounded by torch from the kernel's fp32, or by the kernel with
round_in_kernel) against `reference.paged_sparse_mla_prefill`, into a NaN-filled `out`, on CUDA; the interpreter
runs the same checks at tiny sizes (tests/test_triton_mla_prefill_interpret.py).

One sequence in scattered pages of a NaN-poisoned pool (`test_triton_mla.build_case`), n query rows
(not a multiple of anything) each selecting its own tokens among the positions it sees (a causal
chunk: row i sees context - n + 1 + i tokens), 96 heads (a 64-head block and a partial one).
"""

from __future__ import annotations

import pytest
import torch

from conftest import rel_rms
from kimiserve.ops.mla import reference as ref
from test_triton_mla import build_case, make_indices

pytestmark = pytest.mark.gpu


def check_prefill(preset: str, kv: str, context: int, n: int, k: int, device: str, dtype=torch.bfloat16,
                  heads: int | None = None, latent_scale: float = 0.05, **kwargs) -> float:
    from kimiserve.ops.mla import triton as tt

    cache, ls, tables, _, _, scale = build_case(preset, kv, [context], heads, device, latent_scale)
    lens = list(range(context - n + 1, context + 1))
    _, q_lat, q_pe = queries(preset, n, heads or build_heads(preset), device)
    idx = make_indices(lens, k, device)
    want = ref.paged_sparse_mla_prefill(q_lat, q_pe, cache, ls, tables[0], idx, scale, dtype)
    errs, results = [], []
    for round_in_kernel in (False, True):  # torch rounds the fp32 result (the default) / the kernel stores dtype
        out = torch.full(q_lat.shape, float("nan"), dtype=dtype, device=device)
        got = tt.paged_sparse_mla_prefill(q_lat, q_pe, cache, ls, tables[0], idx, scale, dtype, out=out,
                                          round_in_kernel=round_in_kernel, **kwargs)
        assert got.data_ptr() == out.data_ptr() and got.dtype == dtype and got.shape == q_lat.shape
        err = rel_rms(got.float(), want.float())
        assert torch.isfinite(got).all() and err < (1e-5 if dtype == torch.float32 else 1e-2), f"rel RMS {err:.3g}"
        errs.append(err)
        results.append(got)
    fresh = tt.paged_sparse_mla_prefill(q_lat, q_pe, cache, ls, tables[0], idx, scale, dtype, **kwargs)
    assert fresh.dtype == dtype and torch.equal(fresh, results[0])  # no out: the default path's values
    return max(errs)


def build_heads(preset: str) -> int:
    from kimiserve.config import load_preset

    return load_preset(preset).num_attention_heads


def queries(preset: str, n: int, H: int, device: str):
    from kimiserve.config import load_preset

    config = load_preset(preset)
    q_lat = torch.randn(n, H, config.kv_lora_rank, device=device)
    q_pe = torch.randn(n, H, config.qk_rope_head_dim, device=device).bfloat16()
    return config, q_lat, q_pe


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("context, n", [(5000, 37), (2100, 2100), (300, 3)])
def test_small_preset_rows(kv, context, n):
    """The small preset's 96 heads, top-2048 (rows seeing fewer tokens select them all, less holes)."""
    err = check_prefill("small", kv, context, n, 2048, "cuda")
    print(f"prefill sparse MLA {kv} context {context} rows {n}: rel RMS {err:.2e}")


def test_other_scale_and_configs():
    """A latent scale that is not a power of two (scaled per element), and explicit tilings."""
    from kimiserve.ops.mla.triton import DecodeConfig

    check_prefill("small", "fp8", 3000, 19, 2048, "cuda", latent_scale=0.07)
    for cfg in (DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=1),
                DecodeConfig(block_h=64, block_n=64, num_warps=8, num_stages=2, reload=False),
                DecodeConfig(block_h=64, block_n=32, num_warps=4, num_stages=2, reload=False)):
        check_prefill("small", "fp8", 3000, 19, 2048, "cuda", config=cfg)
