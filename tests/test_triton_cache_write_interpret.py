"""Triton `write_mla_tokens` under Triton's CPU interpreter (no GPU needed): every 4-bit
kv_cache_dtype, page bytes BIT-EQUAL to the CPU reference (the kernel follows torch's CPU division
rule there; the GPU versions of these checks are tests/test_triton_cache_write.py).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run them in their own process (the variable turns on
TRITON_INTERPRET before the kernels are defined, which a process that already imported them misses):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_cache_write_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from kimiserve.cache.pool import PagePool  # noqa: E402
from kimiserve.ops.cache_write.reference import write_mla_tokens as reference_write  # noqa: E402
from kimiserve.ops.cache_write.triton import write_mla_tokens  # noqa: E402
from kimiserve.ops.quant.reference import quantize_mxfp4, quantize_nvfp4  # noqa: E402
from test_triton_cache_write import FP4_KINDS, _mxfp4_keys, _nvfp4_latents, _pools, check_write  # noqa: E402


@pytest.mark.parametrize("kv", FP4_KINDS)
@pytest.mark.parametrize("N", [1, 7, 33])
def test_tiny_dims(kv, N):
    """Latent 40 (27-byte NVFP4 rows, a last group of 8), keys 16 (one MXFP4 group, zero-padded)."""
    for scale, in_dtype in ((1.0, torch.float32), (0.37, torch.bfloat16), (2.0**-9, torch.float32)):
        check_write("cpu", "tiny", kv, N, in_dtype, scale, num_pages=3)


@pytest.mark.parametrize("kv", FP4_KINDS)
@pytest.mark.parametrize("N", [1, 7, 33])
def test_k31_dims(kv, N):
    """Latent 576 (36 NVFP4 groups, 324-byte rows), keys 128 (4 MXFP4 groups), layer 7, int32 slots."""
    check_write("cpu", "kimi-k3.1-pro", kv, N, torch.float32, 0.0123, layer=7, num_pages=2)
    check_write("cpu", "kimi-k3.1-pro", kv, N, torch.bfloat16, 1.0, layer=7, num_pages=2, index_dtype=torch.int32)


@pytest.mark.parametrize("kv", ["fp4", "fp8+fp4", "fp4+fp8"])
def test_latents_only_leaves_index_regions(kv):
    """keys=None: the index-key and scale regions must keep their 0xFF poison."""
    check_write("cpu", "tiny", kv, 7, torch.float32, 3.0, with_keys=False, num_pages=2)
    check_write("cpu", "kimi-k3.1-pro", kv, 7, torch.float32, 0.5, with_keys=False, num_pages=2)


def test_mixed_formats_without_fp4():
    """The 8-bit mixes go through the same dispatch (fp8 NaN / inf key rows included)."""
    for kv in ("fp8+bf16", "bf16+fp8"):
        check_write("cpu", "tiny", kv, 23, torch.float32, 0.37, num_pages=3)


def test_special_rows_exact_bytes():
    """Rows of zeros, -0, 1e6 and 1e-30 against the quantisers directly (not only the reference op):
    the tiny preset's 27-byte latent rows and 8 + 1 key bytes (16 dims padded to 32), at g = 1."""
    ref, tri = _pools("tiny", "fp4", 2, "cpu")
    L, D = ref.layout.latent_dim, ref.layout.index_dim
    latent = torch.stack([torch.zeros(L), torch.full((L,), -0.0), torch.full((L,), 1e6), torch.full((L,), -1e-30),
                          torch.linspace(-1e6, 1e6, L)])
    keys = torch.stack([torch.zeros(D), torch.full((D,), -0.0), torch.full((D,), 1e6), torch.full((D,), -1e-30),
                        torch.linspace(-1e6, 1e6, D)])
    pages, offsets = torch.tensor([1, 0, 1, 0, 1]), torch.tensor([63, 0, 5, 17, 0])
    write_mla_tokens(tri.latent[0], tri.index_key[0], tri.index_scale[0], pages, offsets, latent, keys, "fp4", 1.0)
    rows = tri.latent[0][pages, offsets]
    assert torch.equal(rows, quantize_nvfp4(latent, 1.0))
    assert rows.shape[-1] == 27 and (rows[:2] == 0).all()  # zero groups: zero codes (no -0) and scale bytes
    assert (rows[2, 24:] == 0x7E).all() and (rows[2, :20] == 0x77).all()  # scale saturates at 448, codes at +6
    assert (rows[3] == 0).all()  # 1e-30 / 6 is below e4m3's smallest subnormal: scale 0, codes 0
    codes, scales = quantize_mxfp4(torch.nn.functional.pad(keys, (0, 32 - D)))
    assert torch.equal(tri.index_key[0][pages, offsets], codes)
    assert torch.equal(tri.index_scale[0][pages, offsets], scales)
    assert scales[:2].eq(0).all() and scales[2].item() == 18 + 127  # 1e6 = 1.907 * 2^19: rounds up -> 2^(20 - 2)
    # and the whole pool (every byte outside the five slots stays 0xFF) equals the reference's
    reference_write(ref.latent[0], ref.index_key[0], ref.index_scale[0], pages, offsets, latent, keys, "fp4", 1.0)
    assert torch.equal(ref.data, tri.data)


def test_pool_write_mla_rotated_keys():
    """Through PagePool.write_mla (keys Hadamard-rotated, per-layer global scales): same pages."""
    ref, tri = _pools("kimi-k3.1-pro", "fp8+fp4", 2, "cpu")
    for pool in (ref, tri):
        pool.latent_scales = [0.01 * (i + 1) for i in range(len(pool.latent_scales))]
    four_ref, four_tri = _pools("tiny", "fp4", 2, "cpu")
    for (a, b), (Lp, Dp) in (((ref, tri), (576, 128)), ((four_ref, four_tri), (40, 16))):
        assert isinstance(a, PagePool) and a.layout.index_key_rotation
        N = 11
        flat = torch.randperm(2 * a.block_size)[:N]
        pages, offsets = flat // a.block_size, flat % a.block_size
        latent = _nvfp4_latents(N, Lp, 0.02, torch.float32)
        keys = _mxfp4_keys(N, Dp, torch.float32).clamp(-1e30, 1e30)  # rotated sums stay finite
        a.write_mla(1, pages, offsets, latent, keys)
        b.write_mla(1, pages, offsets, latent, keys, write=write_mla_tokens)
        assert torch.equal(a.data, b.data)
