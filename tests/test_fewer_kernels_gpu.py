"""`backend.fewer_kernel_ops` on CUDA (skipped without a GPU): the default CUDA engine (`select_decode_ops`
applies it: the stacked projections, the addmm and the Triton output gate), decode steps and verify steps
captured as CUDA graphs, against the same engine on `backend.separate_kernel_ops` (each projection apart). The op-level checks are test_merged_linears.py and
test_glue_ops.py::test_gate_output; the CPU engine checks test_merged_linears.py and test_glue_ops_interpret.py."""

import pytest

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def use_separate_kernel_ops(engine) -> None:
    """The target's and the draft model's runners and graph sets on `separate_kernel_ops` (before any capture)."""
    from kimiserve.ops.backend import separate_kernel_ops

    proposer = getattr(engine, "proposer", None)
    for runner in (engine.runner, getattr(proposer, "runner", None)):
        if runner is not None:
            assert "fewer-kernels" in runner.ops.name, runner.ops.name  # the CUDA default
            runner.ops = separate_kernel_ops(runner.ops)
            for graphs in (runner.graphs, runner.verify_graphs):
                if graphs is not None:
                    graphs.release()
                    graphs.ops = runner.ops
    if getattr(proposer, "loop_graphs", None) is not None:
        proposer.loop_graphs.release()
        proposer.loop_graphs.ops = proposer.runner.ops


def tokens(outs):
    return {k: o.outputs[0].token_ids for k, o in outs.items()}


@pytest.mark.parametrize("spec", [None, {"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3}])
def test_fp32_engine_with_fewer_kernel_ops_gives_the_default_tokens(spec):
    """fp32 (in bf16 other GEMM shapes move logits by an ulp, enough to flip near-tied greedy picks)."""
    prompts = random_prompts([20, 57, 9, 90], seed=11)
    params = SamplingParams(max_tokens=40, **GREEDY)
    kw = dict(device="cuda", max_num_seqs=8, num_pages=400, speculative_config=spec)
    separate = make_engine(**kw)
    use_separate_kernel_ops(separate)
    want = tokens(run(separate, prompts, params))
    engine = make_engine(**kw)
    assert tokens(run(engine, prompts, params)) == want
    assert engine.runner.graphs.disabled is None
    if spec is None:
        assert engine.runner.graphs.replays > 10
    else:  # every decode step of a speculating engine is a verify
        assert engine.runner.verify_graphs.replays > 3 and engine.proposer.loop_graphs.replays > 3
    engine.check_idle()


def test_bf16_demo_logits_with_fewer_kernel_ops_stay_within_bf16_rounding():
    """kimi-demo in bf16, the separate-projection engine's tokens fed to both (teacher forcing): every step's
    logits of the default engine within bf16 rounding of those (rel RMS < 2e-2)."""
    from conftest import rel_rms

    prompts = random_prompts([30, 200], seed=12, vocab=768)
    params = SamplingParams(max_tokens=24, **GREEDY)
    kw = dict(model="kimi-demo", device="cuda", max_num_seqs=4, num_pages=200)
    ref = make_engine("bfloat16", **kw)
    use_separate_kernel_ops(ref)
    ref_out = tokens(run(ref, prompts, params))
    engine = make_engine("bfloat16", **kw)
    engine.forced = {tuple(p): ref_out[f"r{i}"] for i, p in enumerate(prompts)}
    run(engine, prompts, params)
    assert set(engine.recorded) == set(ref.recorded)
    worst = max(rel_rms(engine.recorded[k].float(), ref.recorded[k].float()) for k in ref.recorded)
    assert worst < 2e-2, worst
    assert engine.runner.graphs.replays > 10
