"""`DecodeOps.linears`: the projections that read the same input as one GEMM over stacked weights
(`ops.linear.merged`, `backend.fewer_kernel_ops`) against each projection on its own (the reference)."""

import pytest
import torch

from conftest import rel_rms
from kimiserve.model.layers import Linear
from kimiserve.model.parallel_layers import ColumnParallelLinear
from kimiserve.model.parallel_layers import RowParallelLinear
from kimiserve.ops.linear import merged, reference
from kimiserve.ops.linear.merged import merged_linears
from kimiserve.ops.linear.reference import separate_linears

BOUNDS = {torch.float32: 1e-6, torch.bfloat16: 1e-2}


def projections(widths, inp, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    mods = tuple((Linear if i % 2 else ColumnParallelLinear)(inp, w, dtype) for i, w in enumerate(widths))
    for m in mods:
        m.weight.data.copy_(torch.randn(m.weight.shape, generator=g) * inp ** -0.5)
    return mods, g


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, widths, inp", [((1,), (7, 33, 5), 19), ((1, 13), (96, 96, 96, 3, 96, 17), 40),
                                               ((3, 5), (1, 250), 65)])
def test_merged_linears_match_separate_projections(lead, widths, inp, dtype):
    mods, g = projections(widths, inp, dtype, seed=sum(widths))
    before = [m.weight.detach().clone() for m in mods]
    x = torch.randn(*lead, inp, generator=g).to(dtype)
    ref = separate_linears(x, mods)
    out = merged_linears(x, mods)
    assert len(out) == len(mods)
    for o, r, m, w in zip(out, ref, mods, before):
        assert o.shape == r.shape == (*lead, m.weight.shape[0]) and o.dtype == dtype and o.stride(-1) == 1
        assert torch.isfinite(o).all()
        assert rel_rms(o, r) < BOUNDS[dtype]
        assert torch.equal(m.weight, w)  # restacking moved the values, not changed them
    # the parameters are row views of one stacked weight: no second copy of the weights
    base = mods[0].weight.data_ptr()
    offset = 0
    for m in mods:
        assert m.weight.data_ptr() == base + offset * m.weight.element_size()
        offset += m.weight.numel()


def test_writes_into_the_parameters_reach_the_stacked_gemm():
    """A weight sync copying into a parameter changes the next call; a replaced parameter is restacked."""
    mods, g = projections((9, 4, 11), 23, torch.float32, seed=3)
    x = torch.randn(2, 23, generator=g)
    merged_linears(x, mods)
    with torch.no_grad():
        mods[1].weight.copy_(torch.randn(4, 23, generator=g))  # in place, as `weight_loader` and weight syncs do
    for o, r in zip(merged_linears(x, mods), separate_linears(x, mods)):
        assert rel_rms(o, r) < 1e-6
    mods[2].weight.data = torch.randn(11, 23, generator=g)  # a new tensor, e.g. after .to(device)
    for o, r in zip(merged_linears(x, mods), separate_linears(x, mods)):
        assert rel_rms(o, r) < 1e-6
    assert mods[2].weight.data_ptr() == mods[0].weight.data_ptr() + (9 + 4) * 23 * 4


def test_lora_and_mixed_dtypes_run_each_projection():
    mods, g = projections((6, 6), 10, torch.float32, seed=4)
    x = torch.randn(3, 10, generator=g)
    calls = []
    mods[1].lora = lambda x_, y: calls.append(1) or y + 1.0
    out = merged_linears(x, mods)
    assert calls and torch.allclose(out[1], x @ mods[1].weight.T + 1.0)
    assert mods[0].weight.data_ptr() + 60 * 4 != mods[1].weight.data_ptr()  # not stacked
    mixed, _ = projections((6, 6), 10, torch.float32, seed=5)
    mixed[1].weight.data = mixed[1].weight.data.to(torch.bfloat16)
    out = merged_linears(x, mixed)
    assert torch.allclose(out[1], x @ mixed[1].weight.float().T)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lead, inp, out", [((1,), 19, 7), ((1, 13), 40, 33), ((3, 5), 65, 250)])
def test_linear_add_matches_the_reference(lead, inp, out, dtype):
    g = torch.Generator().manual_seed(inp + out)
    for module in (RowParallelLinear(inp, out, dtype, reduce=False), Linear(inp, out, dtype)):
        module.weight.data.copy_(torch.randn(out, inp, generator=g) * inp ** -0.5)
        x = torch.randn(*lead, inp, generator=g).to(dtype)
        addend = torch.randn(*lead, out, generator=g).to(dtype)
        got, want = merged.linear_add(x, module, addend), reference.linear_add(x, module, addend)
        assert got.shape == want.shape and got.dtype == dtype and torch.isfinite(got).all()
        assert rel_rms(got, want) < BOUNDS[dtype]
        assert rel_rms(got, addend.double() + x.double() @ module.weight.double().T) < BOUNDS[dtype]
    calls = []
    module.lora = lambda x_, y: calls.append(1) or y * 2  # LoRA slots: the module's own forward
    assert torch.equal(merged.linear_add(x, module, addend), reference.linear_add(x, module, addend)) and calls


def test_engine_with_merged_projections_matches_reference_ops():
    """The tiny engine (KDA, MLA, latent MoE with shared experts, a dense MLP) with the torch ops of
    `fewer_kernel_ops` (stacked projections, addmm; the interpreter test adds its Triton output gate): the
    reference-ops engine's tokens, logits up to near-tie selections (`assert_ops_match_up_to_ties`); the
    projections really ran stacked."""
    import dataclasses

    from engine_utils import assert_ops_match_up_to_ties, random_prompts
    from kimiserve.ops.backend import REFERENCE_OPS

    ops = dataclasses.replace(REFERENCE_OPS, linears=merged.merged_linears, linear_add=merged.linear_add)
    engine = assert_ops_match_up_to_ties(ops, random_prompts([40, 90, 7], seed=6))
    model = engine.runner.model
    kda = next(m for m in model.modules() if type(m).__name__ == "KimiDeltaAttention")
    assert kda.k_proj.weight.data_ptr() == kda.q_proj.weight.data_ptr() + kda.q_proj.weight.numel() * 4
    mla = next(m for m in model.modules() if type(m).__name__ == "MLAAttention")
    first = mla.q_a_proj.weight if hasattr(mla, "q_a_proj") else mla.q_proj.weight
    assert mla.kv_a_proj_with_mqa.weight.data_ptr() == first.data_ptr() + first.numel() * 4
    moe = next(m for m in model.modules() if type(m).__name__ == "SparseMoE")
    down = moe.routed_expert_down_proj.weight
    assert moe.shared_experts.gate_proj.weight.data_ptr() == down.data_ptr() + down.numel() * 4


def test_spec_graph_kernels_by_op_sums_to_the_decode_graph(monkeypatch, capsys):
    """`benchmarks/spec_graph_kernels.py --by-op` (reference glue, tiny): the parts add up to the decode graph's count."""
    import re
    import sys

    sys.path.insert(0, "benchmarks")
    import spec_graph_kernels

    monkeypatch.setattr(sys, "argv", ["spec_graph_kernels.py", "--model", "tiny", "--tokens", "3", "--by-op"])
    assert spec_graph_kernels.main() == 0
    out = capsys.readouterr().out
    per_replay = float(re.search(r"^target decode\s+\d+\s+([\d.]+)$", out, re.M).group(1))
    total = int(re.search(r"one replay by model part .*: (\d+) kernels", out).group(1))
    parts = dict(re.findall(r"^(KDA layer|MLA layer|MoE block|dense MLP|residual reads \+ norms|embedding|"
                            r"logits \(lm_head\)|final read \+ norm|outside the model)\s+(\d+)", out, re.M))
    assert total == per_replay and sum(map(int, parts.values())) == total
    assert {"KDA layer", "MLA layer", "MoE block", "dense MLP", "embedding"} <= set(parts)
