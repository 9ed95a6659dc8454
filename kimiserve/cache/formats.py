"""How MLA latents and index keys are stored in the cache, per cache dtype (DESIGN.md section 2).

| kv_cache_dtype | latent                         | index key                    |
|----------------|--------------------------------|------------------------------|
| bf16           | bf16                           | bf16                         |
| fp8            | e4m3, one fp32 scale per layer | e4m3 + one fp32 scale/token  |

`roundtrip_*` give what a value reads back as after a trip through the cache; the full-sequence
forward uses them to act as the serving path's oracle for lossy formats.
"""

from __future__ import annotations

import torch

from kimiserve.ops.quant.reference import (
    FP8_DTYPE,
    dequantize_fp8,
    dequantize_fp8_rowwise,
    quantize_fp8,
    quantize_fp8_rowwise,
)

KV_CACHE_DTYPES = ("bf16", "fp8")
STORAGE_DTYPES = {"bf16": torch.bfloat16, "fp8": FP8_DTYPE}


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {kv_cache_dtype!r}")


def index_key_has_scale(kv_cache_dtype: str) -> bool:
    return kv_cache_dtype == "fp8"


def store_latent(x: torch.Tensor, kv_cache_dtype: str, scale: float) -> torch.Tensor:
    return quantize_fp8(x, scale) if kv_cache_dtype == "fp8" else x.to(torch.bfloat16)


def load_latent(codes: torch.Tensor, kv_cache_dtype: str, scale: float, dtype: torch.dtype) -> torch.Tensor:
    return dequantize_fp8(codes, scale, dtype) if kv_cache_dtype == "fp8" else codes.to(dtype)


def store_index_key(x: torch.Tensor, kv_cache_dtype: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    return quantize_fp8_rowwise(x) if kv_cache_dtype == "fp8" else (x.to(torch.bfloat16), None)


def load_index_key(
    codes: torch.Tensor, scales: torch.Tensor | None, kv_cache_dtype: str, dtype: torch.dtype
) -> torch.Tensor:
    return dequantize_fp8_rowwise(codes, scales, dtype) if kv_cache_dtype == "fp8" else codes.to(dtype)


def roundtrip_latent(x: torch.Tensor, kv_cache_dtype: str, scale: float = 1.0) -> torch.Tensor:
    check_kv_cache_dtype(kv_cache_dtype)
    return load_latent(store_latent(x, kv_cache_dtype, scale), kv_cache_dtype, scale, x.dtype)


def roundtrip_index_key(x: torch.Tensor, kv_cache_dtype: str) -> torch.Tensor:
    check_kv_cache_dtype(kv_cache_dtype)
    codes, scales = store_index_key(x, kv_cache_dtype)
    return load_index_key(codes, scales, kv_cache_dtype, x.dtype)
