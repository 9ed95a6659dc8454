"""How MLA latents and index keys are stored in the cache, per cache dtype (DESIGN.md section 2).

`kv_cache_dtype` is one format for both ("bf16", "fp8", "fp4") or a mixed choice "LATENT+KEY"
(e.g. "fp8+fp4": FP8 latents, MXFP4 index keys). Per token and MLA layer (K3.1: latent 576 =
512 NoPE + 64 RoPE, index key 128):

| format | latent                                          | index key                               |
|--------|-------------------------------------------------|-----------------------------------------|
| bf16   | bf16 (1152 B)                                   | bf16 (256 B)                            |
| fp8    | e4m3, one fp32 scale per layer (576 B)          | e4m3 + one fp32 scale per token (132 B) |
| fp4    | NVFP4 row: e2m1 codes + e4m3 scale per 16 dims, | MXFP4: e2m1 codes + ue8m0 scale per 32  |
|        | the layer's fp32 scale as global (324 B)        | dims (64 + 4 = 68 B)                    |

The fp4 latent keeps no dims wider: the 64 RoPE dims are NVFP4 too. FP8 RoPE dims would cost
28 B more per token (420 B against FP8's 708: 1.69x the tokens instead of the 1.7x asked); the
accuracy this costs is measured in BENCHMARKS.md.

`roundtrip_*` give what a value reads back as after a trip through the cache; the full-sequence
forward uses them to act as the serving path's oracle for lossy formats. Index keys may be stored
rotated by an orthonormal Hadamard matrix (spreading outlier channels over the MXFP4 groups; the
scan then rotates the queries, which leaves every dot product unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch

from kimiserve.ops.quant.reference import (
    FP8_DTYPE,
    MXFP4_GROUP,
    dequantize_fp8,
    dequantize_fp8_rowwise,
    dequantize_mxfp4,
    dequantize_nvfp4,
    hadamard,
    nvfp4_row_bytes,
    quantize_fp8,
    quantize_fp8_rowwise,
    quantize_mxfp4,
    quantize_nvfp4,
)


FORMATS = ("bf16", "fp8", "fp4")
KV_CACHE_DTYPES = FORMATS + tuple(f"{a}+{b}" for a in FORMATS for b in FORMATS if a != b)
"""Every accepted kv_cache_dtype: one format for both, or LATENT+KEY."""


@dataclass(frozen=True)
class CacheFormats:
    latent: str
    index_key: str


@lru_cache(maxsize=None)
def parse_kv_cache_dtype(kv_cache_dtype: str) -> CacheFormats:
    """'fp8' -> (fp8, fp8); 'fp8+fp4' -> latent fp8, index keys fp4. ValueError for anything else."""
    parts = kv_cache_dtype.split("+") if isinstance(kv_cache_dtype, str) else []
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or any(p not in FORMATS for p in parts):
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(FORMATS)} or LATENT+KEY of them (e.g. fp8+fp4), "
            f"got {kv_cache_dtype!r}"
        )
    return CacheFormats(*parts)


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    parse_kv_cache_dtype(kv_cache_dtype)


def latent_format(kv_cache_dtype: str) -> str:
    return parse_kv_cache_dtype(kv_cache_dtype).latent


def index_key_format(kv_cache_dtype: str) -> str:
    return parse_kv_cache_dtype(kv_cache_dtype).index_key


def latent_storage(kv_cache_dtype: str, dim: int) -> tuple[torch.dtype, int]:
    """(dtype, elements) of one token's stored latent of `dim` values."""
    fmt = latent_format(kv_cache_dtype)
    if fmt == "fp4":
        return torch.uint8, nvfp4_row_bytes(dim)
    return (FP8_DTYPE if fmt == "fp8" else torch.bfloat16), dim


def index_key_storage(kv_cache_dtype: str, dim: int) -> tuple[torch.dtype, int, torch.dtype | None, int]:
    """(code dtype, code elements, scale dtype or None, scale elements) of one token's index key."""
    fmt = index_key_format(kv_cache_dtype)
    if fmt == "fp4":
        groups = -(-dim // MXFP4_GROUP)  # a last partial group is zero-padded
        return torch.uint8, groups * MXFP4_GROUP // 2, torch.uint8, groups
    if fmt == "fp8":
        return FP8_DTYPE, dim, torch.float32, 1
    return torch.bfloat16, dim, None, 0


def rotates_index_keys(kv_cache_dtype: str, index_key_rotation: bool | None) -> bool:
    """Whether index keys are stored rotated: as asked, or by default (None) for fp4 keys, where the
    rotation raises top-k recall (BENCHMARKS.md)."""
    return index_key_format(kv_cache_dtype) == "fp4" if index_key_rotation is None else index_key_rotation


def latent_scale_of(kv_cache_dtype: str, scale: float) -> float | None:
    """The per-layer latent scale the decode ops take: fp8's scale, fp4's global scale, None for bf16."""
    return None if latent_format(kv_cache_dtype) == "bf16" else scale


def store_latent(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    fmt = latent_format(kv_cache_dtype)
    if fmt == "fp4":
        return quantize_nvfp4(x, scale)
    return quantize_fp8(x, scale) if fmt == "fp8" else x.to(torch.bfloat16)


def load_latent(codes: torch.Tensor, kv_cache_dtype: str, scale: float, dtype: torch.dtype,
                dim: int | None = None) -> torch.Tensor:
    """Dequantised latents [..., dim] (dim: the latent width, needed for fp4 rows whose last group is padded)."""
    fmt = latent_format(kv_cache_dtype)
    if fmt == "fp4":
        return dequantize_nvfp4(codes, scale, dtype, dim)
    return dequantize_fp8(codes, scale, dtype) if fmt == "fp8" else codes.to(dtype)


def store_index_key(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(codes, scales): fp8 per-token fp32 scales [...]; fp4 ue8m0 bytes [..., D / 32]; bf16 None."""
    fmt = index_key_format(kv_cache_dtype)
    if fmt == "fp4":
        pad = -x.shape[-1] % MXFP4_GROUP
        return quantize_mxfp4(torch.nn.functional.pad(x.float(), (0, pad)) if pad else x)
    return quantize_fp8_rowwise(x) if fmt == "fp8" else (x.to(torch.bfloat16), None)


def load_index_key(
    codes: torch.Tensor, scales: torch.Tensor | None, kv_cache_dtype: str, dtype: torch.dtype, dim: int | None = None
) -> torch.Tensor:
    """Dequantised keys [..., dim] (dim: the key width, needed for fp4 keys whose last group is padded)."""
    fmt = index_key_format(kv_cache_dtype)
    if fmt == "fp4":
        return dequantize_mxfp4(codes, scales, dtype)[..., :dim]
    return dequantize_fp8_rowwise(codes, scales, dtype) if fmt == "fp8" else codes.to(dtype)


def rotate_index_keys(x: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., D] times the orthonormal Hadamard matrix (symmetric: applying it twice is the identity),
    in fp32 or wider; used on keys before they are stored and on the queries that scan them.
    matrix: `hadamard(D)` made once by the caller (the pool keeps one on its device), else made here."""
    dt = torch.promote_types(x.dtype, torch.float32)
    h = hadamard(x.shape[-1], dt, x.device) if matrix is None else matrix.to(dt)
    return x.to(dt) @ h


def roundtrip_latent(x: torch.Tensor, kv_cache_dtype: str, scale: float = 1.0) -> torch.Tensor:
    check_kv_cache_dtype(kv_cache_dtype)
    return load_latent(store_latent(x, kv_cache_dtype, scale), kv_cache_dtype, scale, x.dtype, x.shape[-1])


def roundtrip_index_key(x: torch.Tensor, kv_cache_dtype: str, rotate: bool = False) -> torch.Tensor:
    """What an index key reads back as, in its own (unrotated) basis."""
    check_kv_cache_dtype(kv_cache_dtype)
    codes, scales = store_index_key(rotate_index_keys(x) if rotate else x, kv_cache_dtype)
    y = load_index_key(codes, scales, kv_cache_dtype, torch.float32, x.shape[-1])
    return (rotate_index_keys(y) if rotate else y).to(x.dtype)
