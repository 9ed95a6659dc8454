"""`DecodeOps.overlap_shared_experts` on CUDA (skipped without a GPU): each MoE block's shared experts on a second
stream beside its routed experts, in eager steps and in captured decode graphs, give the serial engine's logits bit
for bit (the same kernels; the add is `linear_ref.linear_add`'s). The CPU test of the branch's order and sum is
tests/test_model.py::test_shared_expert_overlap_computes_the_serial_sum."""

import pytest

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def use_ops(engine, overlap: bool) -> None:
    """The runner and its graph sets on `separate_kernel_ops` (the reference's add), with or without the overlap
    (before any capture)."""
    import dataclasses

    from kimiserve.ops.backend import separate_kernel_ops, shared_expert_overlap_ops

    ops = separate_kernel_ops(engine.runner.ops)
    engine.runner.ops = shared_expert_overlap_ops(ops) if overlap else dataclasses.replace(
        ops, overlap_shared_experts=False)
    for graphs in (engine.runner.graphs, engine.runner.verify_graphs):
        if graphs is not None:
            graphs.release()
            graphs.ops = engine.runner.ops


@pytest.mark.parametrize("dtype,model", [("float32", "tiny"), ("bfloat16", "kimi-demo")])
def test_overlapped_shared_experts_give_the_serial_logits(dtype, model):
    import torch

    prompts = random_prompts([30, 7, 120], seed=13)
    params = SamplingParams(max_tokens=24, **GREEDY)
    kw = dict(model=model, device="cuda", max_num_seqs=4, num_pages=300)
    serial = make_engine(dtype, **kw)
    use_ops(serial, False)
    want = {k: o.outputs[0].token_ids for k, o in run(serial, prompts, params).items()}
    engine = make_engine(dtype, **kw)
    use_ops(engine, True)
    engine.forced = {tuple(p): want[f"r{i}"] for i, p in enumerate(prompts)}
    run(engine, prompts, params)
    assert set(engine.recorded) == set(serial.recorded)
    assert all(torch.equal(engine.recorded[k], serial.recorded[k]) for k in serial.recorded)
    assert engine.runner.graphs.replays > 10
    moe = next(m for m in engine.runner.model.modules() if type(m).__name__ == "SparseMoE")
    assert moe.side_stream is not None
    engine.check_idle()
