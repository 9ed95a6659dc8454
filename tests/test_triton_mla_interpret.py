"""Smoke checks of the Triton MLA decode kernels under Triton's CPU interpreter (no GPU needed).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run them in their own process (the variable turns on
TRITON_INTERPRET before the kernels are defined, which a process that already imported them misses):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_mla_interpret.py -q
"""

import dataclasses

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from conftest import rel_rms  # noqa: E402
from kimiserve.ops.mla import reference as ref  # noqa: E402
from kimiserve.ops.mla import triton as tt  # noqa: E402
from kimiserve.ops.quant.reference import dequantize_nvfp4  # noqa: E402
from test_triton_mla import assert_same_values, build_case, fp4_rows, make_indices  # noqa: E402


def _nan_out(q: torch.Tensor) -> torch.Tensor:
    return torch.full(q.shape, float("nan"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv, scale_l", [("bf16", 1.0), ("fp8", 0.05), ("fp8", 0.125), ("fp4", 1.0), ("fp4", 0.05)])
def test_tiny_dims(kv, scale_l, dtype):
    """L=32, R=8 (padded to 16), 4 heads in a 16-head block, 64-token pages; forced 3 splits. fp4: 27-byte
    NVFP4 rows (3 groups, R in the half-filled last one), read byte-aligned."""
    lens = [1, 63, 130]
    cache, ls, tables, q_lat, q_pe, scale = build_case("tiny", kv, lens, None, "cpu", scale_l)
    cfg = tt.DecodeConfig(block_n=16, num_splits=3)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    idx = make_indices(lens, 70, "cpu")
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, dtype)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, dtype, out=_nan_out(q_lat), config=cfg)
    assert torch.isfinite(got).all() and rel_rms(got, want) < tol
    ctx = torch.tensor(lens)
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, dtype)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, dtype, out=_nan_out(q_lat), config=cfg)
    assert torch.isfinite(got).all() and rel_rms(got, want) < tol


@pytest.mark.parametrize("num_splits", [1, 8])
def test_dense_mixed_lengths_and_poison(num_splits):
    """Splits past a short row's end, an empty row (NaN, like the reference), and the poisoning's
    sanity: pointing a table entry at an unowned page turns that row NaN."""
    lens = [0, 63, 700]
    cache, ls, tables, q_lat, q_pe, scale = build_case("tiny", "fp8", lens, None, "cpu", 0.125)
    ctx = torch.tensor(lens)
    cfg = tt.DecodeConfig(num_splits=num_splits, block_n=16)
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16, out=_nan_out(q_lat),
                                    config=cfg)
    assert got[0].isnan().all() and want[0].isnan().all()
    assert torch.isfinite(got[1:]).all() and rel_rms(got[1:], want[1:]) < 1e-2
    bad = tables.clone()
    bad[2, 5] = tables[0, -1]
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, bad, ctx, scale, torch.bfloat16, config=cfg)
    assert got[2].isnan().all() and torch.isfinite(got[1]).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L, R", [(512, 64), (32, 8), (48, 5)])
def test_fp4_dequantisation_is_bit_exact(L, R, dtype):
    """The kernels' in-register NVFP4 dequantisation vs the reference's on random bytes (every code;
    zero, subnormal, normal and NaN scales), including ones that make subnormal and huge products."""
    rows = fp4_rows(37, L, R, "cpu")
    for g in [1.0, 0.05, 3e-3, 1e-36, 1e30]:
        assert_same_values(tt.dequantize_fp4_rows(rows, g, L, R, dtype), dequantize_nvfp4(rows, g, dtype, L + R))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [3, 32], ids=["batch3", "batch32"])
def test_tiny_dims_fp4_default_config(dtype, batch):
    """The fp4 default tiling (and its split plan) at the tiny dims; from batch 32 sparse decode takes
    64-head blocks (tiny has 4 heads: one masked block)."""
    lens = [1, 63, 130] if batch == 3 else [1 + 7 * i for i in range(batch)]
    cache, ls, tables, q_lat, q_pe, scale = build_case("tiny", "fp4", lens, None, "cpu", 0.05)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    idx = make_indices(lens, 70, "cpu")
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, dtype)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, dtype, out=_nan_out(q_lat))
    assert torch.isfinite(got).all() and rel_rms(got, want) < tol
    ctx = torch.tensor(lens)
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, dtype)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, dtype, out=_nan_out(q_lat))
    assert torch.isfinite(got).all() and rel_rms(got, want) < tol


def test_fp4_default_config_by_batch():
    """Sparse bf16 decode switches to 64-head blocks at SPARSE_FP4_WIDE_HEADS_FROM_BATCH (the tiling
    test_triton_mla.py times as "h64 w8 s2"); dense decode and fp32 do not."""
    batch1 = tt.default_fp4_config(torch.bfloat16)
    wide = dataclasses.replace(batch1, block_h=64, num_warps=8, num_stages=2)
    n = tt.SPARSE_FP4_WIDE_HEADS_FROM_BATCH
    assert tt.default_fp4_config(torch.bfloat16, n - 1) == batch1 and tt.default_fp4_config(torch.bfloat16, n) == wide
    assert tt.default_fp4_config(torch.bfloat16, n, sparse=False) == batch1
    assert tt.default_fp4_config(torch.float32, n) == tt.default_config(torch.float32)


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_k31_dims(kv, num_splits):
    """Real widths (L=512, R=64; fp4: 324-byte rows, read 4-byte aligned), 16 heads, the format's K3.1
    pages (fp8 384 tokens, fp4 704); a row of only -1 gives NaN; a table entry pointing at an unowned
    page (NaN bytes) turns its row NaN."""
    lens = [1, 63, 130]
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, lens, 16, "cpu")
    idx = make_indices(lens, 96, "cpu")
    cfg = tt.DecodeConfig(num_splits=num_splits)
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16,
                                     out=_nan_out(q_lat), config=cfg)
    assert torch.isfinite(got).all() and rel_rms(got, want) < 1e-2
    idx[1] = -1
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16, config=cfg)
    assert got[1].isnan().all() and torch.isfinite(got[0::2]).all()
    assert rel_rms(got[0::2], want[0::2]) < 1e-2
    bad = tables.clone()
    bad[0, 0] = tables[0, -1]
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, bad, torch.tensor(lens), scale, torch.bfloat16, config=cfg)
    assert got[0].isnan().all() and torch.isfinite(got[1:]).all()
