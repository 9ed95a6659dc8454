"""Kernels per CUDA-graph replay of a speculative round, counted on the CPU: the engine runs its graph paths
with emulated graphs (`tests/graph_emulation.py`: each "graph" re-runs its function) and every replay is
counted under a TorchDispatchMode (`decode_glue_ops.Counter`): non-view aten ops, with each `DecodeOps`
kernel field (the fused KDA decode step, the attention kernels, ...) and each routed-experts call counted
as one kernel, as they launch on CUDA. On a launch-bound GPU model these counts, not bytes, set a graph's
device time (kimi-demo's decode step: ~640 kernels in ~0.6 ms on the H200).

    python benchmarks/spec_graph_kernels.py [--model kimi-demo] [--method ngram|draft] [--draft-model kimi-demo-draft]
                                            [--k 3] [--tokens 60] [--by-op] [--ops reference|cuda|fewer]
                                            [--kda-verify-slots]

Prints, per graph (the target's decode / verify / KDA replay graphs, the draft model's), its replays in one
greedy request on a repeated 32-token span and the kernels per replay. `--by-op` also prints, for the
decode, verify and KDA replay graphs of the target and the draft model, the kernels of one replay by part
of the model (KDA layer, MLA layer, MoE block, dense MLP, the residual reads + norms between sublayers,
embedding, logits, outside the model), per layer, and the aten ops of each part with their counts.

`--ops`: which glue ops (`DecodeOps` norms, residual reads, router, SiTU, MLA head matmuls, and the fields
`fewer_kernel_ops` sets) count how. "reference" (the default, the figures in BENCHMARKS.md): their pure-torch
compositions, op by op (what the CPU engine runs). "cuda": the Triton glue kernels of `fused_glue_ops`, as the
CUDA engine runs them; "fewer": those plus `fewer_kernel_ops`. Both run the kernels under Triton's CPU
interpreter (set KIMISERVE_TRITON_INTERPRET=1; slow: use a few --tokens), each Triton launch counted as one
kernel and the torch ops of the wrappers around them op by op.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="kimi-demo")
    p.add_argument("--method", choices=("ngram", "draft"), default="ngram")
    p.add_argument("--draft-model", default="kimi-demo-draft")
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--tokens", type=int, default=60)
    p.add_argument("--by-op", action="store_true", help="the target decode graph's kernels by model part and aten op")
    p.add_argument("--ops", choices=("reference", "cuda", "fewer"), default="reference")
    p.add_argument("--kda-verify-slots", action="store_true",
                   help="verify steps' KDA positions as one `DecodeOps.kda_verify_steps` op per layer into per-position "
                        "state slots, the KDA replay graph the copy of the kept slots (`ops.backend.kda_verify_slot_ops`)")
    p.add_argument("--dtype", default="auto", help="the model dtype (auto: float32 on the CPU; CUDA engines run bfloat16)")
    args = p.parse_args()
    import pytest

    with pytest.MonkeyPatch.context() as patch:  # undone at the end (the tests call main in their process)
        return count(args, p, patch)


def count(args, p, patch) -> int:
    if args.ops != "reference":
        if os.environ.get("KIMISERVE_TRITON_INTERPRET") != "1":
            p.error("--ops cuda|fewer runs the Triton kernels under the CPU interpreter: set KIMISERVE_TRITON_INTERPRET=1")
        import triton_interpreter_shims

        triton_interpreter_shims.enable()

    from decode_glue_ops import NO_KERNEL, Counter, suspending
    from graph_emulation import EagerGraph, emulate_cuda_graphs
    from kimiserve.engine import cuda_graphs
    from kimiserve.engine.args import EngineArgs
    from kimiserve.engine.engine import LLMEngine
    from kimiserve.model.moe import RoutedExperts
    from kimiserve.ops.backend import REFERENCE_OPS
    from kimiserve.sampling_params import SamplingParams

    emulate_cuda_graphs(patch)
    spec = ({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4} if args.method == "ngram"
            else {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k})
    engine = LLMEngine(EngineArgs(model=args.model, dtype=args.dtype, max_model_len=512, num_pages=64, enable_prefix_caching=False,
                                  seed=0, speculative_config=spec))
    counter = Counter()
    if args.ops != "reference":
        count_triton_launches(counter, patch)
    glue = ("rms_norm", "layer_norm", "add_read_norm", "route", "situ_and_mul", "head_matmul", "linears", "linear_add",
            "gate_output")
    sets = {}
    for owner, runner in (("target", engine.runner), ("draft", getattr(engine.proposer, "runner", None))):
        if runner is None:
            continue
        if args.ops != "reference":
            from kimiserve.ops import backend

            runner.ops = backend.fused_glue_ops(runner.ops)
            if args.ops == "fewer":
                runner.ops = backend.fewer_kernel_ops(runner.ops)
        if args.kda_verify_slots:
            from kimiserve.ops import backend

            runner.ops = backend.kda_verify_slot_ops(runner.ops)
        if args.by_op:
            track_modules(counter, runner.model)
        fields = {f.name: getattr(runner.ops, f.name) for f in dataclasses.fields(runner.ops)}
        # glue fields count what they run: op by op (the references), or their Triton launches and wrapper ops
        runner.ops = dataclasses.replace(runner.ops, **{
            k: suspending(counter, v, k) for k, v in fields.items()
            if callable(v) and not (k in glue and (args.ops != "reference" or v is getattr(REFERENCE_OPS, k)))})
        for m in runner.model.modules():
            if isinstance(m, RoutedExperts):
                m.forward = suspending(counter, m.forward, "routed experts")
        for kind in ("graphs", "verify_graphs"):
            graphs = getattr(runner, kind)
            if graphs is not None:
                graphs.ops = runner.ops
                sets[id(graphs)] = f"{owner} {'decode' if kind == 'graphs' else 'verify'}"
    loop = getattr(engine.proposer, "loop_graphs", None)
    if loop is not None:
        loop.ops = engine.proposer.runner.ops
        sets[id(loop)] = "draft loop"

    recorded = collections.Counter()
    record = cuda_graphs.GraphSet.record

    def labelled(self, fn):
        graph, out = record(self, fn)
        name = sets.get(id(self), type(self).__name__)
        graph.label = name + (" KDA replay" if name.endswith("verify") and recorded[id(self)] % 2 else "")
        recorded[id(self)] += 1
        return graph, out

    patch.setattr(cuda_graphs.GraphSet, "record", labelled)
    per = collections.defaultdict(list)
    rows_of = {}  # graph label -> the kernel rows of its last replay
    def counted(self):  # `EagerGraph.replay` with its copy into the recorded outputs (the emulation's, not a kernel) uncounted
        start = len(counter.rows)
        with counter:
            new = self.fn()
        if isinstance(self.out, torch.Tensor):
            self.out.copy_(new)
        rows_of[self.label] = [r for r in counter.rows[start:] if r[3] not in NO_KERNEL]
        per[self.label].append(len(rows_of[self.label]))

    patch.setattr(EagerGraph, "replay", counted)
    g = torch.Generator().manual_seed(0)
    span = torch.randint(0, 768, (32,), generator=g).tolist()
    engine.add_request("r", span * 4, SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.stats()
    print(f"{args.model}, {args.method} K={args.k}: {s['spec_decode_num_drafts']} rounds, "
          f"{s['spec_decode_num_accepted_tokens']} of {s['spec_decode_num_draft_tokens']} drafts accepted")
    print(f"{'graph':28s} {'replays':>7s} {'kernels per replay':>18s}")
    for name, counts in per.items():
        print(f"{name:28s} {len(counts):7d} {sum(counts) / len(counts):18.1f}")
    if args.by_op:
        for owner, runner in (("target", engine.runner), ("draft", getattr(engine.proposer, "runner", None))):
            for graph in ("decode", "verify", "verify KDA replay"):
                if f"{owner} {graph}" in rows_of:
                    print_by_op(runner.model, rows_of[f"{owner} {graph}"], args.ops, f"{owner} {graph}")
    return 0


def count_triton_launches(counter, patch) -> None:
    """Each launch of an (interpreted) Triton kernel counted as one kernel, the ops inside it not at all."""
    from decode_glue_ops import suspending
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run
    patch.setattr(InterpretedFunction, "run",
                  lambda self, *a, **kw: suspending(counter, run, f"triton {self.fn.__name__}")(self, *a, **kw))


def track_modules(counter, model) -> None:
    """Module paths on the counter's stack while each module (and each layer's `forward_attn_res`) runs."""
    from decode_glue_ops import in_module

    names = {m: n for n, m in model.named_modules()}
    for m in model.modules():
        if hasattr(m, "forward_attn_res"):  # called directly, not through __call__: no module hooks
            m.forward_attn_res = in_module(counter, m.forward_attn_res, names[m])
        m.register_forward_pre_hook(lambda mod, _a: counter.modules.append(names[mod]) and None)
        m.register_forward_hook(lambda mod, _a, _o: counter.modules.pop() and None)


def model_part(model, path: str, fn: str) -> str:
    """The part of the model a kernel belongs to, from the module path it ran under."""
    parts = path.split(".")
    if "layers" not in parts:
        if "embed_tokens" in path:
            return "embedding"
        if path == "model":
            return "final read + norm"
        return "logits (lm_head)" if "logits" in fn or "forward_batch" in fn else "outside the model"
    i = parts.index("layers")
    layer = model.model.layers[int(parts[i + 1])]
    sub = parts[i + 2] if len(parts) > i + 2 else ""
    if sub == "self_attn":
        return "KDA layer" if type(layer.self_attn).__name__ == "KimiDeltaAttention" else "MLA layer"
    if sub == "block_sparse_moe":
        return "MoE block"
    if sub == "mlp":
        return "dense MLP"
    return "residual reads + norms"


def print_by_op(model, rows, ops: str, graph: str) -> None:
    from decode_glue_ops import GEMM

    parts, ops_of, layers = collections.Counter(), collections.defaultdict(collections.Counter), collections.defaultdict(set)
    for path, _group, fn, op in rows:
        part = model_part(model, path, fn)
        parts[part] += 1
        ops_of[part]["GEMM " + op if op in GEMM else (fn if op == "KERNEL" else op)] += 1
        bits = path.split(".")
        if "layers" in bits:
            layers[part].add(bits[bits.index("layers") + 1])
    print(f"\n{graph} graph, one replay by model part (glue ops: {ops}): {len(rows)} kernels")
    print(f"{'part':24s} {'kernels':>7s} {'layers':>6s} {'/layer':>7s}")
    for part, n in parts.most_common():
        k = len(layers[part]) or 1
        print(f"{part:24s} {n:7d} {len(layers[part]):6d} {n / k:7.1f}")
    for part, n in parts.most_common():
        print(f"\n{part} ({n}): " + ", ".join(f"{op} {c}" for op, c in ops_of[part].most_common()))


if __name__ == "__main__":
    raise SystemExit(main())
