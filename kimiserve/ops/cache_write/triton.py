"""Triton kernel for `write_mla_tokens`: new tokens' MLA latents and index keys into their page slots.

Bit-equal to `kimiserve.ops.cache_write.reference.write_mla_tokens` run on the same device. Two
details make that hold:

- The e4m3 and bf16 codes are built from the fp32 bits (round to nearest even, as c10's
  `fp8e4m3fn_from_fp32_value` and `round_to_nearest_even` do) rather than by a cast, so the
  result does not depend on Triton's conversion lowering (the interpreter's casts truncate or
  round half up; hardware `cvt.rn.satfinite` would agree on sm_90, the bit code agrees everywhere).
- PyTorch divides a CUDA tensor by a Python number as `x * (1 / b)` (both in fp32), but divides
  a CPU tensor truly. The reference's `x / latent_scale` and `amax / 448` therefore round
  differently per device; the kernel does what torch does on the device of its tensors
  (reciprocal multiply on CUDA, IEEE division elsewhere, i.e. under TRITON_INTERPRET=1). The
  per-token `x / scale` (tensor by tensor) is an IEEE division (`div_rn`) on both.

Documented deviation: a NaN written to a bf16 cache becomes 0x7FFF (CUDA's canonical NaN; torch on
CPU writes 0x7FC0). Everything else, NaN and inf included, matches the reference's bits.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kimiserve.cache import formats
from kimiserve.ops.quant.reference import FP8_DTYPE, FP8_MAX

_TINY = float(torch.finfo(torch.float32).tiny)  # 2^-126: the per-token scale's floor


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern (int16), round to nearest even; NaN -> 0x7FFF."""
    b = x.to(tl.int32, bitcast=True)
    r = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FFF, r)
    return r.to(tl.int16)


@triton.jit
def _e4m3_bits(x):
    """fp32 -> e4m3fn code (uint8), round to nearest even; |x| >= 480, inf and NaN -> 0x7F | sign
    (callers clamp to +-448 first, so only NaN gets there). Same steps as c10's
    fp8e4m3fn_from_fp32_value."""
    b = x.to(tl.int32, bitcast=True)
    sign = (b >> 24) & 0x80
    a = b & 0x7FFFFFFF
    # below 2^-6 (smallest e4m3 normal): adding 2^14 rounds |x| to a multiple of 2^-9 (the subnormal step)
    sub = (a.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # normal: rebias the exponent (127 -> 7), round the 20 dropped mantissa bits to nearest even
    norm = (a + (-1006632960 + 0x7FFFF) + ((a >> 20) & 1)) >> 20  # -1006632960 = (7 - 127) << 23
    code = tl.where(a < (121 << 23), sub, norm)
    code = tl.where(a >= (1087 << 20), 0x7F, code)
    return (code | sign).to(tl.uint8)


@triton.jit
def _clamp_fp8(y):
    """clamp to +-448, NaN passes through (as torch.clamp does)."""
    y = tl.where(y > 448.0, 448.0, y)
    return tl.where(y < -448.0, -448.0, y)


@triton.jit
def _write_mla_kernel(
    lat_ptr, lat_sn, lat_sc, key_ptr, key_sn, key_sc, pages_ptr, offs_ptr,
    lc_ptr, lc_sp, lc_st, lc_sc, kc_ptr, kc_sp, kc_st, kc_sc, ks_ptr, ks_sp, ks_st,
    latent_scale, inv_latent_scale, inv_fp8_max, L, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, HAS_KEYS: tl.constexpr,
    RECIPROCAL: tl.constexpr,
):
    """One program per token n: latent row -> latent_cache[page, off], key row -> key_cache[page, off]
    (+ its scale -> key_scales[page, off] for fp8). Caches are raw-bit views (uint8 / int16)."""
    n = tl.program_id(0).to(tl.int64)
    page = tl.load(pages_ptr + n).to(tl.int64)
    off = tl.load(offs_ptr + n).to(tl.int64)

    c = tl.arange(0, BLOCK_L)
    x = tl.load(lat_ptr + n * lat_sn + c * lat_sc, mask=c < L, other=0.0).to(tl.float32)
    if FP8:
        if RECIPROCAL:
            y = x * inv_latent_scale
        else:
            y = tl.math.div_rn(x, latent_scale)
        codes = _e4m3_bits(_clamp_fp8(y))
    else:
        codes = _bf16_bits(x)
    tl.store(lc_ptr + page * lc_sp + off * lc_st + c * lc_sc, codes, mask=c < L)

    if HAS_KEYS:
        d = tl.arange(0, BLOCK_D)
        k = tl.load(key_ptr + n * key_sn + d * key_sc, mask=d < D, other=0.0).to(tl.float32)
        if FP8:
            amax = tl.max(tl.abs(k), axis=0)
            nans = tl.sum((k != k).to(tl.int32), axis=0)  # a NaN makes torch's amax NaN: the scale becomes 1
            if RECIPROCAL:
                s = amax * inv_fp8_max
            else:
                s = tl.math.div_rn(amax, 448.0)
            s = tl.maximum(s, 1.1754943508222875e-38)
            s = tl.where((amax > 0) & (nans == 0), s, 1.0)
            kcodes = _e4m3_bits(_clamp_fp8(tl.math.div_rn(k, s)))
            tl.store(ks_ptr + page * ks_sp + off * ks_st, s)
        else:
            kcodes = _bf16_bits(k)
        tl.store(kc_ptr + page * kc_sp + off * kc_st + d * kc_sc, kcodes, mask=d < D)


def _raw(cache: torch.Tensor, kv_cache_dtype: str, what: str) -> torch.Tensor:
    """The cache view reinterpreted as its raw bits (uint8 for e4m3, int16 for bf16), strides kept."""
    want = formats.STORAGE_DTYPES[kv_cache_dtype]
    if cache.dtype != want:
        raise ValueError(f"{what} is {cache.dtype}, but a {kv_cache_dtype} cache stores {want}")
    return cache.view(torch.uint8 if want == FP8_DTYPE else torch.int16)


def _kernel_input(x: torch.Tensor, fp8: bool) -> torch.Tensor:
    """Inputs the kernel loads exactly: fp64 bound for a bf16 cache is rounded once here (as the
    reference does); on CPU (TRITON_INTERPRET=1, whose bf16 -> fp32 upcast mangles subnormals)
    bf16/fp16 inputs are widened to fp32 here, exactly."""
    if not fp8 and x.dtype == torch.float64:
        return x.to(torch.bfloat16)
    if x.device.type != "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def _f32(x: float) -> float:
    """x rounded to fp32 (as a Python float holding that fp32 value)."""
    return float(np.float32(x))


def write_mla_tokens(
    latent_cache: torch.Tensor,
    key_cache: torch.Tensor | None,
    key_scales: torch.Tensor | None,
    pages: torch.Tensor,
    offsets: torch.Tensor,
    latent: torch.Tensor,
    keys: torch.Tensor | None,
    kv_cache_dtype: str,
    latent_scale: float,
) -> None:
    """Store tokens' latents [N, L + R] into latent_cache [P, block_size, L + R] and index keys
    [N, D] into key_cache [P, block_size, D] (with per-token fp32 scales into key_scales
    [P, block_size] for fp8) at slots (pages [N], offsets [N]). bf16: values rounded to bf16;
    fp8: latent / latent_scale in e4m3, keys in e4m3 with scale amax / 448 per token.

    Caches are written in place through their (page-strided) views. Same contract and bits as the
    reference; slots named twice get one of the tokens (unspecified which, as in the reference).
    """
    formats.check_kv_cache_dtype(kv_cache_dtype)
    fp8 = kv_cache_dtype == "fp8"
    if fp8 and not latent_scale > 0:
        raise ValueError(f"an FP8 scale must be > 0, got {latent_scale}")
    N, L = latent.shape
    if N == 0:
        return
    latent = _kernel_input(latent, fp8)
    has_keys = keys is not None
    keys = _kernel_input(keys, fp8) if has_keys else None
    lc = _raw(latent_cache, kv_cache_dtype, "latent_cache")
    if has_keys:
        kc = _raw(key_cache, kv_cache_dtype, "key_cache")
        ks = key_scales if fp8 else kc  # the scale pointer is unused for bf16
        if fp8 and (key_scales is None or key_scales.dtype != torch.float32):
            raise ValueError("an fp8 key cache needs fp32 key_scales")
        D = keys.shape[1]
    else:
        keys, kc, ks, D = latent, lc, lc, 1  # placeholders, never touched (HAS_KEYS=False)
    reciprocal = latent.device.type == "cuda"  # torch's tensor / Python-number rule on this device
    inv_scale = _f32(np.float32(1.0) / np.float32(latent_scale)) if fp8 else 1.0
    _write_mla_kernel[(N,)](
        latent, latent.stride(0), latent.stride(1), keys, keys.stride(0), keys.stride(-1), pages, offsets,
        lc, lc.stride(0), lc.stride(1), lc.stride(2), kc, kc.stride(0), kc.stride(1), kc.stride(-1),
        ks, ks.stride(0), ks.stride(1),
        _f32(latent_scale) if fp8 else 1.0, inv_scale, _f32(np.float32(1.0) / np.float32(FP8_MAX)),
        L, D, BLOCK_L=triton.next_power_of_2(L), BLOCK_D=triton.next_power_of_2(D), FP8=fp8,
        HAS_KEYS=has_keys, RECIPROCAL=reciprocal, num_warps=4,
    )
