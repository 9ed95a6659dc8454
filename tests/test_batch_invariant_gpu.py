"""Batch-invariant mode on CUDA with the `small` preset's real widths (skipped without a GPU): the
invariant forward run directly (its traceback is not hidden by the engine's failure isolation), a
sequence's logprobs alone == in a batch, and the engine's (decode steps in CUDA graphs) == the
trainer's; also the tiny model with bf16 weights through the engine (every op on its Triton form) and, as phases, how long each takes."""

import time

import pytest
import torch

from engine_utils import random_prompts, run
from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def lp(out) -> torch.Tensor:
    return torch.tensor([x.logprob for x in out.outputs[0].logprobs])


@pytest.mark.parametrize("model,dtype,fewer", [("tiny", "bfloat16", ""), ("small", "auto", ""),
                                               ("tiny", "bfloat16", "fewer"), ("small", "auto", "fewer"),
                                               ("tiny", "bfloat16", "fewer_epilogue"), ("small", "auto", "fewer_epilogue"),
                                               ("tiny", "bfloat16", "fewer_folded"), ("small", "auto", "fewer_folded")])
def test_invariant_forward_on_cuda_is_batch_invariant_and_engine_equals_trainer(model, dtype, fewer, capsys, monkeypatch):
    """fewer: `glue.FEWER_KERNELS` on (stacked projections, KDA decode from and to the state pages, ...), with
    `glue.RESIDUAL_EPILOGUE` too (fewer_epilogue), or `glue.FOLDED_CASTS` (fewer_folded)."""
    from kimiserve.ops.batch_invariant import glue

    monkeypatch.setattr(glue, "FEWER_KERNELS", bool(fewer))
    monkeypatch.setattr(glue, "RESIDUAL_EPILOGUE", fewer == "fewer_epilogue")
    monkeypatch.setattr(glue, "FOLDED_CASTS", fewer == "fewer_folded")
    t0 = time.perf_counter()
    e = LLMEngine(EngineArgs(model=model, dtype=dtype, device="cuda", batch_invariant=True, max_model_len=512,
                             num_pages=64, max_num_batched_tokens=64, enable_prefix_caching=False))
    vocab = min(e.config.vocab_size, 768)
    prompts = [[t % vocab for t in p] for p in random_prompts([150, 7, 40], seed=4)]
    trainer = PolicyTrainer.from_engine(e, share_weights=True)
    t1 = time.perf_counter()
    with torch.no_grad():  # the forward itself first, outside the engine's step isolation
        whole = trainer.logprobs(prompts, [[1, 2, 3]] * 3)
        alone = trainer.logprobs(prompts[:1], [[1, 2, 3]])
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    assert torch.equal(whole[0], alone[0]) and all(torch.isfinite(x).all() for x in whole)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=5, logprobs=0, ignore_eos=True) for s in range(3)]
    outs = run(e, prompts, params)
    torch.cuda.synchronize()
    t3 = time.perf_counter()
    solo = run(e, prompts[:1], params[0], ids=["solo"])["solo"]
    assert solo.outputs[0].token_ids == outs["r0"].outputs[0].token_ids and torch.equal(lp(solo), lp(outs["r0"]))
    with torch.no_grad():
        lps = trainer.logprobs(prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(3)])
    for i, got in enumerate(lps):
        assert torch.equal(got.cpu(), lp(outs[f"r{i}"])), i
    graphs = e.runner.graphs  # the decode steps replayed captured graphs of the invariant forward (solo: size 1)
    assert graphs is not None and graphs.disabled is None and graphs.replays > 0, graphs and graphs.disabled
    assert 1 in {size for size, _ in graphs.graphs} and len(graphs.graphs) >= 2
    with capsys.disabled():
        print(f"\n{model} {fewer}: build {t1 - t0:.1f} s, trainer forward of 3 sequences twice {t2 - t1:.2f} s, "
              f"engine 3 requests (chunks of 64, 5 tokens each) {t3 - t2:.2f} s")
