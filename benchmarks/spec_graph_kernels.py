"""Kernels per CUDA-graph replay of a speculative round, counted on the CPU: the engine runs its graph paths
with emulated graphs (`tests/graph_emulation.py`: each "graph" re-runs its function) and every replay is
counted under a TorchDispatchMode (`decode_glue_ops.Counter`): non-view aten ops, with each `DecodeOps`
kernel field (the fused KDA decode step, the attention kernels, ...) and each routed-experts call counted
as one kernel, as they launch on CUDA. On a launch-bound GPU model these counts, not bytes, set a graph's
device time (kimi-demo's decode step: ~640 kernels in ~0.6 ms on the H200).

    python benchmarks/spec_graph_kernels.py [--model kimi-demo] [--method ngram|draft] [--draft-model kimi-demo-draft]
                                            [--k 3] [--tokens 60]

Prints, per graph (the target's decode / verify / KDA replay graphs, the draft model's), its replays in one
greedy request on a repeated 32-token span and the kernels per replay.
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
    args = p.parse_args()

    import pytest

    from decode_glue_ops import NO_KERNEL, Counter, suspending
    from graph_emulation import EagerGraph, emulate_cuda_graphs
    from kimiserve.engine import cuda_graphs
    from kimiserve.engine.args import EngineArgs
    from kimiserve.engine.engine import LLMEngine
    from kimiserve.model.moe import RoutedExperts
    from kimiserve.ops.backend import REFERENCE_OPS
    from kimiserve.sampling_params import SamplingParams

    patch = pytest.MonkeyPatch()
    emulate_cuda_graphs(patch)
    spec = ({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4} if args.method == "ngram"
            else {"method": "draft_model", "model": args.draft_model, "num_speculative_tokens": args.k})
    engine = LLMEngine(EngineArgs(model=args.model, max_model_len=512, num_pages=64, enable_prefix_caching=False,
                                  seed=0, speculative_config=spec))
    counter = Counter()
    glue = ("rms_norm", "layer_norm", "add_read_norm", "route", "situ_and_mul", "head_matmul")  # reference glue: op by op
    sets = {}
    for owner, runner in (("target", engine.runner), ("draft", getattr(engine.proposer, "runner", None))):
        if runner is None:
            continue
        fields = {f.name: getattr(runner.ops, f.name) for f in dataclasses.fields(runner.ops)}
        runner.ops = dataclasses.replace(runner.ops, **{
            k: suspending(counter, v, k) for k, v in fields.items()
            if callable(v) and not (k in glue and v is getattr(REFERENCE_OPS, k))})
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
    replay = EagerGraph.replay

    def counted(self):
        start = len(counter.rows)
        with counter:
            replay(self)
        per[self.label].append(sum(1 for r in counter.rows[start:] if r[3] not in NO_KERNEL))

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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
