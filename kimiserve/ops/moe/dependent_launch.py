"""Programmatic dependent launch (PDL, sm_90+) of the fused MoE's decode chain (`MoEConfig.dependent_launch`).

A kernel launched with PDL may start while the kernel launched before it on the stream is still running, and it
waits for that kernel to finish, its writes visible, at `griddepcontrol.wait` (`wait_prior_grid`). The chain
align -> x's MMA-k copy -> gate/up -> down -> combine is launched so; each kernel, once past its own wait, lets the
next one launch (`griddepcontrol.launch_dependents`), whose programs then take the SM slots this kernel's last wave
leaves free and run their prologues there: at 1 token the five launches are ~10 us of a ~115 us layer outside the
two GEMMs' steady state (BENCHMARKS.md, "Session 17 on the H200").

The rule that keeps it correct. Before its wait a kernel writes nothing, and reads only what was complete when its
predecessor passed that predecessor's own wait: the weights, the MoE's inputs (written before the align's
predecessor finished), and the align's outputs in kernels two or more launches after the align. Since every kernel
of the chain lets the next launch only after its own wait, the kernel two launches back has finished by then.
- the align and the combine: wait first;
- x's MMA-k copy: loads x, then waits, then stores;
- the fragment GEMMs (`ops.moe.gluon_decode`): the block's expert, rows and pair ids and the first K step's weights
  before the wait, the activations after it;
- the reduce of a split-K gate/up GEMM's partials (`ops.moe.epilogue._reduce_act_kernel`), between the fragment
  GEMMs: lets the down GEMM launch first and then waits, the one exception to the order above. It is safe because
  the down GEMM reads before its wait only the weights and the align's outputs, and the align has finished once
  any reduce program runs (every gate/up program has passed its wait, so x's copy has finished, which waited for
  the align); the down GEMM's wait is for the reduce, which finishes after the gate/up GEMM.
Kernels launched without PDL (the prefill GEMMs, the Triton tiles' split-K reduce, whatever follows the MoE) keep the
stream's full ordering; `griddepcontrol` instructions are no-ops in a kernel launched without the attribute.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait


@triton.jit
def wait_prior_grid(PDL: tl.constexpr):
    """Under PDL: wait for the kernel launched before this one (finished, writes visible), then let the next one
    launch. Nothing when PDL is off (the interpreter, GPUs before sm_90)."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch_options(enabled: bool) -> dict:
    """The launch keyword of a Triton or Gluon kernel taking part (none when off: the interpreter takes no
    such option)."""
    return {"launch_pdl": True} if enabled else {}


def unsupported(device: torch.device) -> str | None:
    """Why the decode chain cannot be launched with PDL on this device, or None."""
    if device.type != "cuda":
        return f"programmatic dependent launch needs a CUDA device, got {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"programmatic dependent launch needs sm_90 or later, got sm_{major}{minor}"
    return None


__all__ = ["gdc_launch_dependents", "gdc_wait", "launch_options", "unsupported", "wait_prior_grid"]
