"""Which torch ops a decode step of the serving batch path issues outside the decode-op kernels, counted
on the CPU: the engine runs a few prompts to their decode phase, then one decode step's
`model.forward_batch` runs under a TorchDispatchMode that records every aten op with the innermost
kimiserve function and module it came from. Calls into `ForwardBatch.ops` (the Triton kernels on CUDA)
and the routed experts (the fused MoE kernel on CUDA) are counted apart, as one kernel each. View ops
(view, slice, expand, ...) and allocations (empty) launch no kernel and are not counted as kernels.

    python benchmarks/decode_glue_ops.py [--preset tiny] [--batch 1] [--dtype bfloat16] [--ops reference|fused]

`--ops fused` counts with the fused glue kernels of `DecodeOps` (interpreted: run with
KIMISERVE_TRITON_INTERPRET=1), so the table shows what they leave. Prints the table by group, by group
and layer kind, and the whole step's count.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

NO_KERNEL = {
    "view", "_unsafe_view", "slice", "select", "t", "transpose", "expand", "unsqueeze", "squeeze", "permute",
    "as_strided", "alias", "detach", "split", "split_with_sizes", "unbind", "empty", "new_empty", "empty_like",
    "empty_strided", "lift_fresh", "_reshape_alias", "diagonal", "narrow", "unfold", "view_as_real",
    "view_as_complex", "_local_scalar_dense", "sym_size", "sym_stride", "sym_numel", "is_same_size",
    "promote_types", "result_type",
}
GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "matmul"}
GROUP_FUNCTIONS = {
    # innermost function name -> group (the first one found walking out from the op)
    "rms_norm": "RMSNorm", "attn_res_read": "attn-res read", "route": "router (route)",
    "gated_rms_norm": "gated RMSNorm", "layer_norm": "LayerNorm", "l2_normalize": "L2 norm",
    "situ_and_mul": "SiTU act", "silu_and_mul": "SiLU act", "apply_rope": "rope", "head_matmul": "MLA head matmuls",
}


def innermost(frame) -> tuple[str, str]:
    """(group, kimiserve function) of the innermost kimiserve frame, the group by `GROUP_FUNCTIONS`."""
    func = None
    while frame is not None:
        code = frame.f_code
        if "kimiserve" in code.co_filename and "benchmarks" not in code.co_filename:
            name = code.co_name
            if func is None:
                func = f"{os.path.basename(code.co_filename)[:-3]}.{name}"
            if name in GROUP_FUNCTIONS:
                return GROUP_FUNCTIONS[name], func
        frame = frame.f_back
    return "", func or "?"


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.rows: list[tuple] = []  # (layer, module path, group, function, op)
        self.modules: list[str] = []
        self.suspended = 0
        self.active = 0

    def __enter__(self):
        self.active += 1
        return super().__enter__()

    def __exit__(self, *exc):
        self.active -= 1
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "CompositeImplicitAutograd"):
            with self:  # count what it decomposes into (inference mode hands the composite op over whole)
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if not self.suspended:
            op = func.__name__.split(".")[0]
            group, fn = innermost(sys._getframe(1))
            path = self.modules[-1] if self.modules else ""
            self.rows.append((path, group, fn, op))
        return func(*args, **kwargs)


def suspending(counter: Counter, fn, label: str):
    def call(*args, **kwargs):
        if counter.active and not counter.suspended:
            counter.rows.append((counter.modules[-1] if counter.modules else "", "", label, "KERNEL"))
        counter.suspended += 1
        try:
            return fn(*args, **kwargs)
        finally:
            counter.suspended -= 1
    return call


def in_module(counter: Counter, fn, name: str):
    def call(*args, **kwargs):
        counter.modules.append(name)
        try:
            return fn(*args, **kwargs)
        finally:
            counter.modules.pop()
    return call


def layer_kind(model, path: str) -> str:
    parts = path.split(".")
    if "layers" not in parts:
        return "outside layers"
    i = int(parts[parts.index("layers") + 1])
    layer = model.model.layers[i]
    attn = type(layer.self_attn).__name__.replace("KimiDeltaAttention", "KDA").replace("MLAAttention", "MLA")
    return f"{attn}+{'MoE' if hasattr(layer, 'block_sparse_moe') else 'MLP'}"


def module_group(path: str) -> str:
    for key, name in (("block_sparse_moe.gate", "router (route)"), ("routed_expert_norm", "RMSNorm"),
                      ("layernorm", "RMSNorm"), ("shared_experts", "shared experts"),
                      ("routed_expert_down_proj", "latent down proj"), ("routed_expert_up_proj", "latent up proj"),
                      ("indexer", "MLA indexer glue"), ("self_attn", "attention glue"), ("block_sparse_moe", "MoE glue"),
                      ("mlp", "dense MLP"), ("lm_head", "logits"), ("embed", "embedding")):
        if key in path:
            return name
    return "layer glue (residual adds, ...)"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=40)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--ops", choices=["reference", "fused"], default="reference")
    parser.add_argument("--by-function", action="store_true", help="also list the ops by kimiserve function")
    args = parser.parse_args()

    from kimiserve.engine.args import EngineArgs
    from kimiserve.engine.engine import LLMEngine
    from kimiserve.model.moe import RoutedExperts
    from kimiserve.sampling_params import SamplingParams

    engine = LLMEngine(EngineArgs(model=args.preset, device="cpu", dtype=args.dtype, max_model_len=args.context + 64,
                                  num_pages=64 * args.batch + 64, enable_prefix_caching=False, seed=0))
    runner = engine.runner
    if args.ops == "fused":
        from kimiserve.ops.backend import fused_glue_ops

        runner.ops = fused_glue_ops(runner.ops)
    counter = Counter()
    ops_fields = {f.name: getattr(runner.ops, f.name) for f in dataclasses.fields(runner.ops)}
    from kimiserve.ops.backend import REFERENCE_OPS

    # the glue fields count op by op while they are the references (the compositions this script measures)
    glue = ("rms_norm", "layer_norm", "add_read_norm", "route", "situ_and_mul", "head_matmul")
    wrapped = {k: suspending(counter, v, f"ops.{k}") for k, v in ops_fields.items()
               if callable(v) and not (k in glue and v is getattr(REFERENCE_OPS, k))}
    runner.ops = dataclasses.replace(runner.ops, **wrapped)
    model = runner.model
    names = {m: n for n, m in model.named_modules()}
    for m in model.modules():
        if isinstance(m, RoutedExperts):
            m.forward = suspending(counter, m.forward, "routed experts (fused MoE on CUDA)")
        if hasattr(m, "forward_attn_res"):  # called directly, not through __call__: no module hooks
            m.forward_attn_res = in_module(counter, m.forward_attn_res, names[m])
        m.register_forward_pre_hook(lambda mod, _a: counter.modules.append(names[mod]) and None)
        m.register_forward_hook(lambda mod, _a, _o: counter.modules.pop() and None)

    g = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        engine.add_request(f"r{i}", torch.randint(0, engine.config.vocab_size, (args.context,), generator=g).tolist(),
                           SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))
    while any(not gr.samples[0].output_ids for gr in engine.groups.values()):
        engine.step()
    forward_batch = model.forward_batch

    def counted(*a, **kw):
        assert all(c.num_tokens == 1 for c in a[1].chunks), "not a decode step"
        with counter:
            return forward_batch(*a, **kw)

    model.forward_batch = counted
    engine.step()  # one decode step of every sequence
    model.forward_batch = forward_batch

    kernels = [r for r in counter.rows if r[3] not in NO_KERNEL]
    by_group, by_kind, by_fn = collections.Counter(), collections.Counter(), collections.Counter()
    ops_of = collections.defaultdict(collections.Counter)
    for path, group, fn, op in kernels:
        if op == "KERNEL":
            group = fn
        elif op in GEMM:
            group = "GEMMs (cuBLAS)"
        group = group or module_group(path)
        by_group[group] += 1
        by_kind[(group, layer_kind(model, path))] += 1
        by_fn[(group, fn)] += 1
        ops_of[group][op] += 1
    n_layers = len(model.model.layers)
    total = sum(by_group.values())
    glue = sum(n for g_, n in by_group.items() if not g_.startswith(("ops.", "routed experts", "GEMMs")))
    print(f"{args.preset} preset, {args.dtype}, batch {args.batch}, one decode step of forward_batch, "
          f"decode ops: {args.ops}: {total} kernels ({glue} outside the decode ops and routed experts, "
          f"nor GEMMs: {glue / n_layers:.0f} per layer over {n_layers} layers)")
    print(f"{'group':34s} {'kernels':>7s} {'/layer':>6s}  top ops")
    for group, n in by_group.most_common():
        top = ", ".join(f"{op} {c}" for op, c in ops_of[group].most_common(6))
        print(f"{group:34s} {n:7d} {n / n_layers:6.1f}  {top}")
    print("\nby group and layer kind (kernels per step)")
    for (group, kind), n in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {group:34s} {kind:16s} {n:5d}")
    if args.by_function:
        print("\nby group and innermost kimiserve function")
        for (group, fn), n in by_fn.most_common():
            print(f"  {group:34s} {fn:40s} {n:5d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
