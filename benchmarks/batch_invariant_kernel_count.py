"""The kernels one batch-invariant decode step launches on the CUDA path, counted on the CPU.

The tiny model's invariant engine runs a few prompts; the third pure decode step runs with every op on
its Triton form (`reference.on_triton` forced on, Triton's interpreter) under a torch dispatch mode:
each Triton launch counts once (the torch ops inside a launch are not counted), each aten op that is not
a view, an allocation or a cast to the tensor's own dtype counts once per call. The counts are grouped by the `InvariantForward` method
they run under (`kimiserve/rl/forward.py`), then listed per (method, op). A kernel count, not a time:
on the GPU each launch in a CUDA graph costs ~1-1.5 us.

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/batch_invariant_kernel_count.py
    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/batch_invariant_kernel_count.py --kda-glue --moe-glue --plan-kernel-max-rows 2048

`--kda-glue` sets `glue.KDA_GLUE_KERNELS`, `--moe-glue` `glue.MOE_GLUE_KERNELS`, `--plan-kernel-max-rows N`
`reference.PLAN_KERNEL_MAX_ROWS` (the opt-in kernels of `ops.batch_invariant.triton_glue`). ~1-5 minutes
(the interpreter).
"""

from __future__ import annotations

import argparse
import collections
import inspect
import json
import os
import sys

os.environ["KIMISERVE_TRITON_INTERPRET"] = "1"
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import triton_interpreter_shims  # noqa: E402

triton_interpreter_shims.enable()

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from triton.runtime.interpreter import InterpretedFunction  # noqa: E402

NOT_KERNELS = {"view", "_unsafe_view", "t", "transpose", "permute", "unsqueeze", "squeeze", "select", "slice",
               "expand", "alias", "detach", "split", "unbind", "split_with_sizes", "as_strided", "_reshape_alias",
               "lift_fresh", "empty", "empty_strided", "is_same_size", "sym_size", "empty_like", "new_empty",
               "narrow", "reshape", "diagonal", "view_as_real"}
"""aten ops that launch no kernel (views, allocations, metadata)."""


def caller() -> str:
    for frame in inspect.stack()[3:50]:
        if frame.filename.endswith(os.path.join("rl", "forward.py")):
            return frame.function
    return "?"


def count_decode_step(decode_step: int, dtype: str = "float32") -> tuple[collections.Counter, collections.Counter]:
    from engine_utils import make_engine, random_prompts, run
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.sampling_params import SamplingParams

    engine = make_engine(dtype, batch_invariant=True, max_num_seqs=8, max_model_len=256, num_pages=100, enforce_eager=True)
    inv = engine.runner.invariant
    by_method, by_op = collections.Counter(), collections.Counter()
    state = {"inside_launch": 0, "on": False, "decodes": 0}

    run_launch = InterpretedFunction.run

    def counted_launch(self, *args, **kwargs):
        if state["on"] and not state["inside_launch"]:
            where = caller()
            by_method[where] += 1
            by_op[(where, "triton " + self.fn.__name__)] += 1
        state["inside_launch"] += 1
        try:
            return run_launch(self, *args, **kwargs)
        finally:
            state["inside_launch"] -= 1

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.overloadpacket.__name__
            out = func(*args, **(kwargs or {}))
            no_op = name == "to" and out is args[0]  # a cast to the dtype it has: no kernel
            if state["on"] and not state["inside_launch"] and name not in NOT_KERNELS and not no_op:
                where = caller()
                by_method[where] += 1
                by_op[(where, name)] += 1
            return out

    forward_batch = inv.forward_batch

    def counted_forward(ids, batch, rows, lora=None):
        if not batch.chunks:
            state["decodes"] += 1
            if state["decodes"] == decode_step:
                state["on"] = True
                try:
                    with Count():
                        return forward_batch(ids, batch, rows, lora)
                finally:
                    state["on"] = False
        return forward_batch(ids, batch, rows, lora)

    InterpretedFunction.run = counted_launch
    bi.on_triton = lambda x: True
    inv.forward_batch = counted_forward
    try:
        run(engine, random_prompts([20, 30, 25, 9], seed=1), SamplingParams(max_tokens=decode_step + 2, temperature=0))
    finally:
        InterpretedFunction.run = run_launch
    return by_method, by_op


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kda-glue", action="store_true", help="glue.KDA_GLUE_KERNELS = True")
    p.add_argument("--moe-glue", action="store_true", help="glue.MOE_GLUE_KERNELS = True")
    p.add_argument("--plan-kernel-max-rows", type=int, default=0, help="reference.PLAN_KERNEL_MAX_ROWS")
    p.add_argument("--fewer-kernels", action="store_true", help="glue.FEWER_KERNELS = True")
    p.add_argument("--residual-epilogue", action="store_true", help="glue.RESIDUAL_EPILOGUE = True")
    p.add_argument("--folded-casts", action="store_true", help="glue.FOLDED_CASTS = True")
    p.add_argument("--decode-step", type=int, default=3, help="which pure decode step to count (batch 4)")
    p.add_argument("--dtype", default="float32", help="the weights' dtype (bfloat16: the casts the GPU's bf16 step has too)")
    p.add_argument("--top", type=int, default=40, help="(method, op) rows to list")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the tables")
    args = p.parse_args()
    from kimiserve.ops.batch_invariant import glue
    from kimiserve.ops.batch_invariant import reference as bi

    glue.KDA_GLUE_KERNELS, glue.MOE_GLUE_KERNELS = args.kda_glue, args.moe_glue
    glue.FEWER_KERNELS, glue.RESIDUAL_EPILOGUE = args.fewer_kernels, args.residual_epilogue
    glue.FOLDED_CASTS = args.folded_casts
    bi.PLAN_KERNEL_MAX_ROWS = args.plan_kernel_max_rows
    by_method, by_op = count_decode_step(args.decode_step, args.dtype)
    total = sum(by_method.values())
    if args.json:
        print(json.dumps({"kda_glue": args.kda_glue, "moe_glue": args.moe_glue, "plan_kernel_max_rows": args.plan_kernel_max_rows,
                          "fewer_kernels": args.fewer_kernels, "residual_epilogue": args.residual_epilogue,
                          "folded_casts": args.folded_casts, "dtype": args.dtype,
                          "total": total, "by_method": dict(by_method.most_common())}))
        return
    print(f"kda_glue={args.kda_glue} moe_glue={args.moe_glue} plan_kernel_max_rows={args.plan_kernel_max_rows} "
          f"fewer_kernels={args.fewer_kernels} residual_epilogue={args.residual_epilogue} folded_casts={args.folded_casts} "
          f"dtype={args.dtype}: {total} kernels "
          "in one decode step")
    for where, n in by_method.most_common():
        print(f"{n:5d} {where}")
    print()
    for (where, op), n in by_op.most_common(args.top):
        print(f"{n:5d} {where:18s} {op}")


if __name__ == "__main__":
    main()
