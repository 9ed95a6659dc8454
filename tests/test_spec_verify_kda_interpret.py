"""The KDA verify path of speculative decoding with the fused Triton decode step under Triton's CPU
interpreter: verify outputs and replayed state bit for bit those of decode steps on the same kernel.

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_spec_verify_kda_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from kimiserve.ops.backend import REFERENCE_OPS  # noqa: E402
from kimiserve.ops.kda import paged, triton_decode  # noqa: E402
from spec_verify_cases import check_verify_matches_decode  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_decode_fused_kernel(dtype):
    import dataclasses

    calls = []

    def kernel(*args, **kw):
        calls.append(args[0].shape[0])
        return triton_decode.kda_decode_step(*args, fallback=paged.kda_decode, **kw)

    fused = dataclasses.replace(REFERENCE_OPS, name="fused-kda-interpreted", kda_decode_step=kernel)
    check_verify_matches_decode(fused, "cpu", dtype)
    check_verify_matches_decode(fused, "cpu", dtype, lengths=(5, 5, 2), accepted=(5, 2, 1), seed=3, lower_bound=None)
    assert len(calls) > 10 and triton_decode.supported(16, 16, 4)  # every step ran the kernel


def test_engine_speculation_on_fused_kda_matches_off():
    """The tiny engine on the fused KDA decode kernel (interpreted): n-gram speculation gives the tokens
    of speculation off on the same kernel, with drafts both accepted and rejected."""
    import dataclasses

    from engine_utils import make_engine, random_prompts, run
    from kimiserve.sampling_params import SamplingParams
    from test_spec_decode import FEW, GREEDY, ngram, spec_counts, tokens

    fused = dataclasses.replace(REFERENCE_OPS, name="fused-kda-interpreted", kda_decode_step=lambda *a, **kw:
                                triton_decode.kda_decode_step(*a, fallback=paged.kda_decode, **kw))
    prompts = random_prompts([30], seed=5)
    params = SamplingParams(max_tokens=16, allowed_token_ids=FEW, **GREEDY)
    outs = []
    for spec in (None, ngram(3)):
        engine = make_engine(speculative_config=spec)
        engine.runner.ops = fused
        outs.append(tokens(run(engine, prompts, params)))
        engine.check_idle()
    assert outs[1] == outs[0]
    drafted, accepted, _ = spec_counts(engine)
    assert 0 < accepted < drafted


def fused_kda_ops():
    import dataclasses
    import functools

    return dataclasses.replace(REFERENCE_OPS, name="fused-kda-interpreted",
                               kda_decode_step=functools.partial(triton_decode.kda_decode_step, fallback=paged.kda_decode))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_slots_match_decode_one_launch_kernel(dtype):
    """The layer's verify positions through the one-launch verify kernel into slots, the commit a copy: the
    outputs and committed states of decode steps on the fused decode kernel, bit for bit."""
    from kimiserve.ops.backend import kda_verify_slot_ops
    from kimiserve.ops.kda import triton_verify

    ops = kda_verify_slot_ops(fused_kda_ops())
    assert ops.kda_verify_steps.func is triton_verify.kda_verify_steps
    check_verify_matches_decode(ops, "cpu", dtype, slots=True)
    check_verify_matches_decode(ops, "cpu", dtype, lengths=(5, 5, 2), accepted=(5, 2, 1), seed=3, lower_bound=None,
                                slots=True)


def test_engine_draft_model_on_verify_slots_matches_off():
    """The tiny engine on the fused KDA kernels (interpreted) with the one-launch verify op and slot commits, the
    draft model's catch-up chunks (ragged: 2..K + 1 tokens) too: the tokens of speculation off on the fused
    decode kernel."""
    from engine_utils import make_engine, random_prompts, run
    from kimiserve.ops.backend import kda_verify_slot_ops
    from kimiserve.sampling_params import SamplingParams
    from test_spec_decode import FEW, GREEDY, spec_counts, tokens

    prompts = random_prompts([30], seed=5)
    params = SamplingParams(max_tokens=10, allowed_token_ids=FEW, **GREEDY)
    off = make_engine()
    off.runner.ops = fused_kda_ops()
    want = tokens(run(off, prompts, params))
    on = make_engine(speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3})
    for runner in (on.runner, getattr(on.proposer, "runner", None)):
        if runner is not None:
            runner.ops = kda_verify_slot_ops(fused_kda_ops())
    assert tokens(run(on, prompts, params)) == want
    drafted, accepted, _ = spec_counts(on)
    assert accepted > 0
    on.check_idle()
