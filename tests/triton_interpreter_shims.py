"""Make Triton 3.6's CPU interpreter behave like the GPU where the Triton kernels need it.

`enable()` sets TRITON_INTERPRET=1 (call it before any module defining kernels is imported) and
patches the interpreter's gaps, so an interpreter run checks what the GPU computes:
- a scalar used as a loop bound (e.g. from program_id) is a 1-element array, which int() refuses
  since numpy 2.4;
- tl.dot multiplies bf16 operands as their raw uint16 bits;
- (inside `ordered_dots()` only) tl.dot is numpy's BLAS matmul, whose bits for an output row depend
  on the row's place in the tile (OpenBLAS's microkernels); there it becomes d + sum_k a[:, k] b[k, :]
  in increasing k, one fp32 product and add per k for every element alike: the per-element
  property of the GPU's MMA that a batch-invariant kernel relies on (checked on the GPU itself by
  the same tests without the interpreter);
- float casts truncate fp32 -> bf16 (the GPU rounds to nearest even) and turn e4m3 NaN into 480:
  casts between float types go through torch instead.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import pytest
import torch


def enable_or_skip_module() -> None:
    """For an interpreter test module, at its top: skip the whole module unless KIMISERVE_TRITON_INTERPRET=1
    (nothing of Triton is imported then), else `enable()`."""
    if os.environ.get("KIMISERVE_TRITON_INTERPRET") != "1":
        import pytest

        pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 to run the Triton interpreter checks", allow_module_level=True)
    enable()


def device_or_skip_module() -> str:
    """For a module of Triton checks that run on CUDA or under the interpreter, at its top: skip the whole
    module when neither is there, `enable()` the interpreter under KIMISERVE_TRITON_INTERPRET=1 (before any
    kernel module is imported). Returns the device the checks run on: "cpu" under the interpreter, else "cuda"."""
    if os.environ.get("KIMISERVE_TRITON_INTERPRET") == "1":
        enable()
        return "cpu"
    if not torch.cuda.is_available():
        import pytest

        pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 (or run on CUDA) for the Triton batch-invariant kernels",
                    allow_module_level=True)
    return "cuda"


def enable() -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    import triton.language as tl
    from triton.runtime import interpreter as interp

    if getattr(interp, "_kimiserve_shims", False):
        return
    interp._kimiserve_shims = True
    torch_dtypes = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                    tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.float64: torch.float64}
    bits = {1: torch.uint8, 2: torch.uint16, 4: torch.int32, 8: torch.int64}

    def to_torch(data: np.ndarray, dtype) -> torch.Tensor:
        t = torch_dtypes[dtype]
        raw = np.ascontiguousarray(data).view(getattr(np, f"uint{t.itemsize * 8}") if t.itemsize < 4 else data.dtype)
        return torch.from_numpy(raw.copy()).view(t)

    def from_torch(x: torch.Tensor, like: np.dtype) -> np.ndarray:
        return x.contiguous().view(bits[x.element_size()]).numpy().view(like)

    patch_tensor = interp._patch_lang_tensor

    def patch_tensor_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interp._patch_lang_tensor = patch_tensor_index

    builder = interp.InterpreterBuilder
    create_dot, cast_impl, fp_to_fp = builder.create_dot, builder.cast_impl, builder.create_fp_to_fp

    def widen(x):
        if x.dtype.scalar != tl.bfloat16:
            return x
        return interp.TensorHandle(from_torch(to_torch(x.data, tl.bfloat16).float(), np.float32), tl.float32)

    def dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a, b = widen(a), widen(b)
        if not getattr(interp, "_kimiserve_ordered_dot", False):
            return create_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.copy()
        for k in range(a.data.shape[-1]):  # one fp32 product and one add per k, in increasing k
            acc = acc + (a.data[..., :, k : k + 1] * b.data[..., k : k + 1, :]).astype(acc.dtype)
        return interp.TensorHandle(acc, d.dtype.scalar)

    def float_cast(src, dst_type):
        s, d = src.dtype.scalar, dst_type.scalar
        if s not in torch_dtypes or d not in torch_dtypes:
            return None
        out = to_torch(src.data, s).to(torch_dtypes[d])
        return interp.TensorHandle(from_torch(out, interp._get_np_dtype(dst_type)), d)

    def cast(self, src, dst_type):  # also reached through create_fp_ext / create_fp_trunc
        out = float_cast(src, dst_type)
        return cast_impl(self, src, dst_type) if out is None else out

    def fp_cast(self, src, dst_type, rounding_mode):
        out = float_cast(src, dst_type)
        return fp_to_fp(self, src, dst_type, rounding_mode) if out is None else out

    builder.create_dot = dot
    builder.cast_impl = cast
    builder.create_fp_to_fp = fp_cast


@pytest.fixture(autouse=True)
def ordered_dots_when_interpreted():
    """For a module of `device_or_skip_module` checks (imported into it): every test inside `ordered_dots()`
    under the interpreter; on CUDA nothing (the MMA is per-element already)."""
    with ordered_dots() if os.environ.get("KIMISERVE_TRITON_INTERPRET") == "1" else contextlib.nullcontext():
        yield


@contextlib.contextmanager
def ordered_dots():
    """tl.dot as a fixed per-element order of fp32 products and adds while inside (see the module doc)."""
    from triton.runtime import interpreter as interp

    interp._kimiserve_ordered_dot = True
    try:
        yield
    finally:
        interp._kimiserve_ordered_dot = False
