"""4-bit (MXFP4, NVFP4) and FP8 quantise/dequantise references: the oracles of every kernel that
reads or writes these formats.

MXFP4 (OCP microscaling FP4), as compressed-tensors packs it (expert weights, index keys):

A group of 32 values along the last dim shares one ue8m0 scale byte (value 2^(byte - 127)); each
value is an e2m1 code (bit 3 sign, bits 0-2 index [0, .5, 1, 1.5, 2, 3, 4, 6]); two codes per
byte, element 2i in the low nibble. The scale exponent is floor(log2 amax), plus one when amax's
significand is >= 1.75, minus 2 (e2m1's largest exponent); values saturate at +-6 and round to
the nearest code, ties to the even code.
"""

import torch

MXFP4_GROUP = 32
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# boundaries between neighbouring codes; a value exactly on one goes to the even code
_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _e2m1_code(x: torch.Tensor) -> torch.Tensor:
    mag = x.abs()
    code = torch.zeros_like(mag, dtype=torch.uint8)
    for b, bound in enumerate(_BOUNDS):
        code += (mag >= bound if b % 2 else mag > bound).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def _e2m1_value(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of e2m1 codes (uint8, low 4 bits), computed rather than looked up, so it needs no
    host-to-device copy (CUDA-graph safe): 0 and 0.5 for exponent 0, else (1 + m / 2) * 2^(e - 1)."""
    e = ((codes >> 1) & 3).float()
    m = (codes & 1).float()
    mag = torch.where(e == 0, m * 0.5, (1 + m * 0.5) * torch.exp2(e - 1))
    return torch.where((codes & 8) != 0, -mag, mag)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., K] (K divisible by 32) -> (packed uint8 [..., K/2], scales uint8 [..., K/32])."""
    if w.shape[-1] % MXFP4_GROUP:
        raise ValueError(f"MXFP4 needs the last dim divisible by {MXFP4_GROUP}, got {w.shape[-1]}")
    wf = w.float()
    _check_finite(wf, "MXFP4")
    groups = wf.view(*wf.shape[:-1], -1, MXFP4_GROUP)
    amax = groups.abs().amax(-1)
    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2^exponent, mantissa in [0.5, 1)
    e = exponent - 1 + (mantissa >= 0.875).to(exponent.dtype) - 2  # significand >= 1.75 rounds up
    biased = torch.where(amax > 0, e + 127, torch.zeros_like(e)).clamp(0, 254)
    scale = _pow2(biased).unsqueeze(-1)
    codes = _e2m1_code((groups / scale).clamp(-6.0, 6.0)).view(*wf.shape[:-1], -1, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return packed.contiguous(), biased.to(torch.uint8)


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_mxfp4`: packed [..., K/2], scales [..., K/32] -> [..., K] in dtype."""
    if packed.shape[-1] * 2 != scales.shape[-1] * MXFP4_GROUP or packed.shape[:-1] != scales.shape[:-1]:
        raise ValueError(f"packed {tuple(packed.shape)} and scales {tuple(scales.shape)} do not describe one tensor")
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(*packed.shape[:-1], -1)
    table = _e2m1_value(torch.arange(16, dtype=torch.uint8, device=packed.device))  # 16 values: cheap, no copy
    values = table[codes.long()].view(*packed.shape[:-1], -1, MXFP4_GROUP)
    scale = _pow2(scales).unsqueeze(-1)
    return (values * scale).view(*packed.shape[:-1], -1).to(dtype)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """2^(biased - 127) in fp32, exactly, for ue8m0 bytes 0..254 (byte 0: the subnormal 2^-127),
    built from the bits: CUDA's exp2 is not exact for subnormal results."""
    b = biased.to(torch.int32)
    return torch.where(b > 0, b << 23, 0x400000).view(torch.float32)


def _true_div(x: torch.Tensor, divisor: float) -> torch.Tensor:
    """fp32 x / fp32(divisor), IEEE-rounded on every device. (PyTorch divides a CUDA tensor by a
    Python number or CPU scalar either truly or as x * (1 / divisor) depending on version and
    operand kind; a divisor tensor on x's device always divides truly. `torch.full` launches a
    fill, so this is safe inside CUDA-graph capture.)"""
    return x / torch.full((), divisor, dtype=torch.float32, device=x.device)


def _check_finite(x: torch.Tensor, fmt: str) -> None:
    if not torch.isfinite(x).all():
        raise ValueError(f"{fmt} quantisation got NaN or Inf values: quantise finite tensors only")


# NVFP4: e2m1 codes, one e4m3 scale per 16 values, one fp32 global scale per tensor (here: per
# layer, chosen in advance like the FP8 latent scale). Value = e2m1 * float(e4m3 scale) * global.
NVFP4_GROUP = 16


def nvfp4_row_bytes(dim: int) -> int:
    """Bytes of one packed NVFP4 row of `dim` values: 8 code bytes and 1 scale byte per group of 16
    (a last partial group is padded with zeros)."""
    return 9 * -(-dim // NVFP4_GROUP)


def quantize_nvfp4(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """x [..., D] (finite) -> packed uint8 rows [..., nvfp4_row_bytes(D)].

    Per group of 16 (the last one zero-padded): block scale s = e4m3(amax / (6 * global_scale))
    (nearest, saturating at 448; a block whose scale rounds to 0 stores zeros), codes = e2m1 nearest
    (ties to even, saturating at +-6) of x / (float(s) * global_scale), all in fp32. Row: the
    8 * groups code bytes (element 2i in the low nibble), then the groups e4m3 scale bytes."""
    if not global_scale > 0:
        raise ValueError(f"an NVFP4 global scale must be > 0, got {global_scale}")
    xf = x.float()
    _check_finite(xf, "NVFP4")
    pad = -xf.shape[-1] % NVFP4_GROUP
    if pad:
        xf = torch.nn.functional.pad(xf, (0, pad))
    g = torch.tensor(global_scale, dtype=torch.float32)
    groups = xf.view(*xf.shape[:-1], -1, NVFP4_GROUP)
    amax = groups.abs().amax(-1)
    block = _true_div(amax, float(6 * g)).clamp(max=FP8_MAX).to(FP8_DTYPE)
    denom = block.float() * g
    y = torch.where(denom.unsqueeze(-1) > 0, groups / denom.unsqueeze(-1).clamp_min(torch.finfo(torch.float32).tiny), 0)
    codes = _e2m1_code(y.clamp(-6.0, 6.0)).view(*xf.shape[:-1], -1, 2)
    packed = codes[..., 0] | (codes[..., 1] << 4)
    return torch.cat([packed, block.view(torch.uint8)], dim=-1).contiguous()


def dequantize_nvfp4(rows: torch.Tensor, global_scale: float, dtype: torch.dtype = torch.float32,
                     dim: int | None = None) -> torch.Tensor:
    """Inverse of `quantize_nvfp4`: uint8 rows [..., 9 * groups] -> [..., dim] in dtype (dim defaults
    to 16 * groups): e2m1 * float(scale) * global_scale in fp32, then rounded to dtype."""
    groups = rows.shape[-1] // 9
    if rows.dtype != torch.uint8 or rows.shape[-1] % 9:
        raise ValueError(f"NVFP4 rows must be uint8 [..., 9 * groups], got {rows.dtype} {tuple(rows.shape)}")
    dim = NVFP4_GROUP * groups if dim is None else dim
    if not NVFP4_GROUP * (groups - 1) < dim <= NVFP4_GROUP * groups:
        raise ValueError(f"NVFP4 rows of {rows.shape[-1]} bytes do not hold {dim} values")
    packed, block = rows[..., : 8 * groups], rows[..., 8 * groups :].contiguous().view(FP8_DTYPE)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).view(*rows.shape[:-1], NVFP4_GROUP * groups)
    table = _e2m1_value(torch.arange(16, dtype=torch.uint8, device=rows.device))
    values = table[codes.long()].view(*rows.shape[:-1], groups, NVFP4_GROUP)
    scale = block.float() * torch.tensor(global_scale, dtype=torch.float32)
    return (values * scale.unsqueeze(-1)).view(*rows.shape[:-1], -1)[..., :dim].to(dtype)


def hadamard(n: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix [n, n] (n a power of two): entry (i, j) is
    (-1)^popcount(i & j) / sqrt(n), so H @ H.T = I and H = H.T. Built with device ops only (no
    host-to-device copy: safe inside CUDA-graph capture)."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two dim, got {n}")
    i = torch.arange(n, device=device)
    both = i.unsqueeze(1) & i.unsqueeze(0)
    parity = torch.zeros_like(both)
    for bit in range(n.bit_length() - 1):
        parity ^= (both >> bit) & 1
    return (1 - 2 * parity).to(dtype) / torch.tensor(n, dtype=dtype, device=device).sqrt()


# FP8 e4m3 (OCP "fn" variant: no infinities, largest finite value 448), as the KV cache stores it.
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def quantize_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale rounded to e4m3 (nearest, ties to even), saturating at +-448. `scale` is one per tensor."""
    if not scale > 0:
        raise ValueError(f"an FP8 scale must be > 0, got {scale}")
    return _true_div(x.float(), scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(q: torch.Tensor, scale: float | torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """e4m3 codes times their scale (a float, or a tensor broadcast against q), in dtype."""
    return (q.float() * scale).to(dtype)


def quantize_fp8_rowwise(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One fp32 scale per row (last dim): scale = amax / 448, so each row uses e4m3's full range.

    Returns (e4m3 [..., D], scales fp32 [...]). An all-zero row gets scale 1; the scale never
    goes below the smallest normal fp32 (a row of subnormals would otherwise get scale 0).
    """
    xf = x.float()
    amax = xf.abs().amax(-1)
    scale = torch.where(amax > 0, _true_div(amax, FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny), torch.ones_like(amax))
    return (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


def dequantize_fp8_rowwise(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of `quantize_fp8_rowwise`: e4m3 [..., D], fp32 scales [...] -> [..., D] in dtype."""
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)
