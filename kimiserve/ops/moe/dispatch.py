"""Which routed-experts implementation a device runs, chosen once per device type (as
`ops.backend.select_decode_ops` chooses the paged ops): the Triton fused MoE (`ops.moe.triton`) on
CUDA when Triton imports, else None, meaning the model's pure-torch expert forms (and so on the CPU).
`KIMISERVE_MOE=torch` turns the kernel off (the plain-PyTorch path, e.g. as a benchmark's peer)."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Callable


@functools.cache
def fused_moe_for(device_type: str) -> Callable | None:
    """`ops.moe.triton.fused_moe` for "cuda" (when Triton imports and KIMISERVE_MOE is not "torch"), else None."""
    if device_type != "cuda" or os.environ.get("KIMISERVE_MOE", "").lower() == "torch":
        return None
    try:
        from kimiserve.ops.moe import triton as moe_triton
    except ImportError as e:
        warnings.warn(f"Triton unavailable ({e}); the routed experts run the pure-torch forms on the GPU")
        return None
    return moe_triton.fused_moe
