"""Triton kernel for `write_mla_tokens`: new tokens' MLA latents and index keys into their page slots.

Bit-equal to `kimiserve.ops.cache_write.reference.write_mla_tokens` run on the same device, for every
kv_cache_dtype (latents and index keys each bf16, fp8 or fp4). The details that make that hold:

- The e4m3 and bf16 codes are built from the fp32 bits (round to nearest even, as c10's
  `fp8e4m3fn_from_fp32_value` and `round_to_nearest_even` do) rather than by a cast, so the
  result does not depend on Triton's conversion lowering (the interpreter's casts truncate or
  round half up; hardware `cvt.rn.satfinite` would agree on sm_90, the bit code agrees everywhere).
- Every division is an IEEE division (`div_rn`), as the reference's (which divides by scalars
  through a device tensor, so no device or PyTorch version turns it into a reciprocal multiply).
- e2m1 codes come from the same boundary comparisons as the reference's `_e2m1_code` (ties to the
  even code; no clamp needed: anything past 5 is code 7, as the reference's clamp to +-6 gives);
  MXFP4's scale exponent is read from amax's fp32 bits (exponent field, and the two top mantissa
  bits for "significand >= 1.75"), which equals the reference's frexp rule for every finite amax,
  subnormals included (those clamp to byte 0).

Documented deviations: a NaN written to a bf16 cache becomes 0x7FFF (CUDA's canonical NaN; torch on
CPU writes 0x7FC0). fp4 latents or keys must be finite: the reference raises on NaN / inf, the
kernel (which must not synchronise) writes unspecified bytes for them. Everything else, NaN and inf
in bf16 and fp8 included, matches the reference's bits.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from kimiserve.cache import formats
from kimiserve.ops.quant.reference import MXFP4_GROUP, NVFP4_GROUP

_CODE = {"bf16": 0, "fp8": 1, "fp4": 2}  # the kernel's LAT / KEY constexprs


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
def _e4m3_value(code):
    """Exact fp32 value of non-negative e4m3fn codes (int32; NaN's 0x7F reads as 480, never reached
    for a finite amax and a global scale > 0)."""
    e = code >> 3
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    return tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)  # subnormal: m * 2^-9


@triton.jit
def _clamp_fp8(y):
    """clamp to +-448, NaN passes through (as torch.clamp does)."""
    y = tl.where(y > 448.0, 448.0, y)
    return tl.where(y < -448.0, -448.0, y)


@triton.jit
def _e2m1_code(y):
    """fp32 -> e2m1 code (int32: bit 3 the sign bit, -0 included; 0-2 the magnitude, nearest with
    ties to the even code, saturating at 6; NaN -> 0 | sign), the reference's comparisons."""
    mag = tl.abs(y)
    code = (mag > 0.25).to(tl.int32) + (mag >= 0.75).to(tl.int32) + (mag > 1.25).to(tl.int32)
    code += (mag >= 1.75).to(tl.int32) + (mag > 2.5).to(tl.int32) + (mag >= 3.5).to(tl.int32)
    code += (mag > 5.0).to(tl.int32)
    return code | ((y.to(tl.int32, bitcast=True) >> 28) & 8)


@triton.jit
def _group_pairs(src, s_stride, n, GROUP: tl.constexpr, BLOCK_G: tl.constexpr):
    """n values at src (stride s_stride, zero past n) in groups of GROUP, as (group index [BLOCK_G],
    pair index [GROUP / 2], even elements, odd elements [BLOCK_G, GROUP / 2] fp32, group amax):
    the two tiles share cache lines, and a code byte's two nibbles meet without a reshape."""
    gi = tl.arange(0, BLOCK_G)
    j = tl.arange(0, GROUP // 2)
    col = gi[:, None] * GROUP + 2 * j[None, :]
    lo = tl.load(src + col * s_stride, mask=col < n, other=0.0).to(tl.float32)
    hi = tl.load(src + (col + 1) * s_stride, mask=col + 1 < n, other=0.0).to(tl.float32)
    return gi, j, lo, hi, tl.maximum(tl.max(tl.abs(lo), axis=1), tl.max(tl.abs(hi), axis=1))


@triton.jit
def _nvfp4_row(src, s_stride, dst, d_stride, L, g, g6, BLOCK_G: tl.constexpr):
    """One NVFP4 row: L values at src (stride s_stride) -> 8 * G code bytes, then G e4m3 block-scale
    bytes, at dst (stride d_stride), G = ceil(L / 16)."""
    G = (L + 15) // 16
    gi, j, lo, hi, amax = _group_pairs(src, s_stride, L, 16, BLOCK_G)
    s = tl.math.div_rn(amax, g6)
    s = tl.where(s > 448.0, 448.0, s)  # clamp(max=448), NaN passes through
    sbits = _e4m3_bits(s)
    denom = _e4m3_value(sbits.to(tl.int32)) * g
    safe = tl.maximum(denom, 1.1754943508222875e-38)[:, None]
    zero = (denom > 0)[:, None]
    ylo = tl.where(zero, tl.math.div_rn(lo, safe), 0.0)
    yhi = tl.where(zero, tl.math.div_rn(hi, safe), 0.0)
    packed = (_e2m1_code(ylo) | (_e2m1_code(yhi) << 4)).to(tl.uint8)
    byte = gi[:, None] * 8 + j[None, :]
    tl.store(dst + byte * d_stride, packed, mask=gi[:, None] < G)
    tl.store(dst + (8 * G + gi) * d_stride, sbits, mask=gi < G)


@triton.jit
def _mxfp4_row(src, s_stride, dst, d_stride, sc, sc_stride, D, BLOCK_G: tl.constexpr):
    """One MXFP4 row: D values (zero-padded to groups of 32) -> 16 * G code bytes at dst and G ue8m0
    scale bytes at sc."""
    G = (D + 31) // 32
    gi, j, lo, hi, amax = _group_pairs(src, s_stride, D, 32, BLOCK_G)
    bits = amax.to(tl.int32, bitcast=True)
    # floor(log2 amax) + 127 is the exponent field; significand >= 1.75 is mantissa bits 22 and 21
    biased = (bits >> 23) + (((bits >> 21) & 3) == 3).to(tl.int32) - 2
    biased = tl.minimum(tl.maximum(biased, 0), 254)  # amax 0 or below 2^-125 -> 0
    scale = tl.where(biased > 0, biased << 23, 0x400000).to(tl.float32, bitcast=True)  # 2^(biased - 127)
    ylo = tl.math.div_rn(lo, scale[:, None])
    yhi = tl.math.div_rn(hi, scale[:, None])
    packed = (_e2m1_code(ylo) | (_e2m1_code(yhi) << 4)).to(tl.uint8)
    byte = gi[:, None] * 16 + j[None, :]
    tl.store(dst + byte * d_stride, packed, mask=gi[:, None] < G)
    tl.store(sc + gi * sc_stride, biased.to(tl.uint8), mask=gi < G)


@triton.jit
def _write_mla_kernel(
    lat_ptr, lat_sn, lat_sc, key_ptr, key_sn, key_sc, pages_ptr, offs_ptr,
    lc_ptr, lc_sp, lc_st, lc_sc, kc_ptr, kc_sp, kc_st, kc_sc, ks_ptr, ks_sp, ks_st, ks_sg,
    scale, scale_div, L, D,
    BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, LAT: tl.constexpr, KEY: tl.constexpr,
    HAS_KEYS: tl.constexpr,
):
    """One program per token n: latent row -> latent_cache[page, off], key row -> key_cache[page, off]
    (+ its scale(s) -> key_scales[page, off]). Formats: 0 bf16, 1 fp8, 2 fp4; caches are raw-bit views
    (uint8 / int16). BLOCK_L / BLOCK_D count elements, or groups for fp4. The latent divisor
    scale_div is fp8's scale or fp4's 6 * g (an fp32 product); `scale` is fp4's g."""
    n = tl.program_id(0).to(tl.int64)
    page = tl.load(pages_ptr + n).to(tl.int64)
    off = tl.load(offs_ptr + n).to(tl.int64)

    lat_row = lat_ptr + n * lat_sn
    lc_row = lc_ptr + page * lc_sp + off * lc_st
    if LAT == 2:
        _nvfp4_row(lat_row, lat_sc, lc_row, lc_sc, L, scale, scale_div, BLOCK_L)
    else:
        c = tl.arange(0, BLOCK_L)
        x = tl.load(lat_row + c * lat_sc, mask=c < L, other=0.0).to(tl.float32)
        if LAT == 1:
            y = tl.math.div_rn(x, scale_div)
            codes = _e4m3_bits(_clamp_fp8(y))
        else:
            codes = _bf16_bits(x)
        tl.store(lc_row + c * lc_sc, codes, mask=c < L)

    if HAS_KEYS:
        key_row = key_ptr + n * key_sn
        kc_row = kc_ptr + page * kc_sp + off * kc_st
        if KEY == 2:
            _mxfp4_row(key_row, key_sc, kc_row, kc_sc, ks_ptr + page * ks_sp + off * ks_st, ks_sg, D, BLOCK_D)
        else:
            d = tl.arange(0, BLOCK_D)
            k = tl.load(key_row + d * key_sc, mask=d < D, other=0.0).to(tl.float32)
            if KEY == 1:
                amax = tl.max(tl.abs(k), axis=0)
                nans = tl.sum((k != k).to(tl.int32), axis=0)  # a NaN makes torch's amax NaN: the scale becomes 1
                s = tl.math.div_rn(amax, 448.0)
                s = tl.maximum(s, 1.1754943508222875e-38)
                s = tl.where((amax > 0) & (nans == 0), s, 1.0)
                kcodes = _e4m3_bits(_clamp_fp8(tl.math.div_rn(k, s)))
                tl.store(ks_ptr + page * ks_sp + off * ks_st, s)
            else:
                kcodes = _bf16_bits(k)
            tl.store(kc_row + d * kc_sc, kcodes, mask=d < D)


def _raw(cache: torch.Tensor, want: torch.dtype, width: int, fmt: str, what: str) -> torch.Tensor:
    """The cache view reinterpreted as its raw bits (uint8 for e4m3 and fp4, int16 for bf16), strides kept."""
    if cache.dtype != want:
        raise ValueError(f"{what} is {cache.dtype}, but a {fmt} cache stores {want}")
    if cache.dim() != 3 or cache.shape[-1] != width:
        raise ValueError(f"{what} must be [pages, block_size, {width}] for {fmt}, got {tuple(cache.shape)}")
    return cache.view(torch.int16 if want == torch.bfloat16 else torch.uint8)


def _kernel_input(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Inputs the kernel loads exactly: fp64 bound for a bf16 cache is rounded once here (as the
    reference does; fp8 and fp4 round fp64 to fp32 first, as the kernel's load does); on CPU
    (TRITON_INTERPRET=1, whose bf16 -> fp32 upcast mangles subnormals) bf16/fp16 inputs are widened
    to fp32 here, exactly."""
    if fmt == "bf16" and x.dtype == torch.float64:
        return x.to(torch.bfloat16)
    if x.device.type != "cuda" and x.dtype in (torch.bfloat16, torch.float16):
        return x.float()
    return x


def _fp4_groups_block(n: int, group: int) -> int:
    return triton.next_power_of_2(-(-n // group))


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
    """Store tokens' latents [N, L + R] into latent_cache [P, block_size, width] and index keys
    [N, D] into key_cache [P, block_size, width] (with their scales into key_scales: fp8 fp32
    [P, block_size], fp4 ue8m0 uint8 [P, block_size, groups]) at slots (pages [N], offsets [N]), in
    the formats of `kimiserve.cache.formats` (bf16; fp8 with latent_scale / per-token scales; fp4:
    NVFP4 latent rows with latent_scale as global scale, MXFP4 keys).

    Caches are written in place through their (page-strided) views. Same contract and bits as the
    reference; slots named twice get one of the tokens (unspecified which, as in the reference).
    """
    fmts = formats.parse_kv_cache_dtype(kv_cache_dtype)
    lat_fmt, key_fmt = fmts.latent, fmts.index_key
    if lat_fmt != "bf16" and not latent_scale > 0:
        raise ValueError(f"an {lat_fmt.upper()} scale must be > 0, got {latent_scale}")
    N, L = latent.shape
    if N == 0:
        return
    latent = _kernel_input(latent, lat_fmt)
    lc = _raw(latent_cache, *formats.latent_storage(kv_cache_dtype, L), lat_fmt, "latent_cache")
    has_keys = keys is not None
    if has_keys:
        D = keys.shape[1]
        keys = _kernel_input(keys, key_fmt)
        code_dtype, width, scale_dtype, groups = formats.index_key_storage(kv_cache_dtype, D)
        kc = _raw(key_cache, code_dtype, width, key_fmt, "key_cache")
        if scale_dtype is None:
            ks, ks_sg = kc, 0  # the scale pointer is unused for bf16
        elif key_scales is None or key_scales.dtype != scale_dtype:
            raise ValueError(f"a {key_fmt} key cache needs {scale_dtype} key_scales")
        elif key_fmt == "fp8" or key_scales.dim() == 2:
            if key_scales.dim() != 2 or groups != 1:
                raise ValueError(f"key_scales must be [pages, block_size, {groups}], got {tuple(key_scales.shape)}")
            ks, ks_sg = key_scales, 0
        else:
            if key_scales.dim() != 3 or key_scales.shape[-1] != groups:
                raise ValueError(f"key_scales must be [pages, block_size, {groups}], got {tuple(key_scales.shape)}")
            ks, ks_sg = key_scales, key_scales.stride(2)
        block_d = _fp4_groups_block(D, MXFP4_GROUP) if key_fmt == "fp4" else triton.next_power_of_2(D)
    else:
        keys, kc, ks, ks_sg, D, block_d = latent, lc, lc, 0, 1, 1  # placeholders, never touched (HAS_KEYS=False)
    g = np.float32(latent_scale) if lat_fmt != "bf16" else np.float32(1.0)
    div = g * np.float32(6.0) if lat_fmt == "fp4" else g  # the reference's 6 * g, an fp32 product
    block_l = _fp4_groups_block(L, NVFP4_GROUP) if lat_fmt == "fp4" else triton.next_power_of_2(L)
    _write_mla_kernel[(N,)](
        latent, latent.stride(0), latent.stride(1), keys, keys.stride(0), keys.stride(-1), pages, offsets,
        lc, lc.stride(0), lc.stride(1), lc.stride(2), kc, kc.stride(0), kc.stride(1), kc.stride(-1),
        ks, ks.stride(0), ks.stride(1), ks_sg,
        float(g), float(div),
        L, D, BLOCK_L=block_l, BLOCK_D=block_d, LAT=_CODE[lat_fmt], KEY=_CODE[key_fmt],
        HAS_KEYS=has_keys, num_warps=4,
    )
