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
