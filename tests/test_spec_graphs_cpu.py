"""The speculative paths that run on CUDA graphs (verify graphs and their KDA replay, the draft model's
decode / verify / drafting-loop graphs), run on the CPU with emulated graphs (`graph_emulation`): greedy
outputs token for token equal to speculation off, every graph set replayed, no leaked pages."""

from __future__ import annotations

import pytest

from engine_utils import GREEDY, make_engine, random_prompts, run
from graph_emulation import emulate_cuda_graphs
from kimiserve.sampling_params import SamplingParams
from test_spec_decode import FEW, mixed_params, ngram, spec_counts, tokens


@pytest.fixture(scope="module")
def reference():
    prompts = random_prompts([20, 57, 9], seed=7)
    params = mixed_params(24)[:2] + [SamplingParams(max_tokens=24, **GREEDY)]
    return prompts, params, tokens(run(make_engine(enforce_eager=True), prompts, params))


def test_ngram_on_emulated_verify_graphs(reference, monkeypatch):
    prompts, params, want = reference
    emulate_cuda_graphs(monkeypatch)
    on = make_engine(speculative_config=ngram(3))
    assert on.runner.verify_graphs is not None
    assert tokens(run(on, prompts, params)) == want
    assert on.runner.verify_graphs.replays > 3
    drafted, accepted, _ = spec_counts(on)
    assert 0 < accepted < drafted
    on.check_idle()


@pytest.mark.parametrize("k", [1, 3])
def test_draft_model_on_emulated_graphs(reference, monkeypatch, k):
    prompts, params, want = reference
    spec = {"method": "draft_model", "model": "tiny", "num_speculative_tokens": k}
    eager = make_engine(enforce_eager=True, speculative_config=spec)
    assert tokens(run(eager, prompts, params)) == want
    emulate_cuda_graphs(monkeypatch)
    on = make_engine(speculative_config=spec)
    assert tokens(run(on, prompts, params)) == want
    sets = [on.runner.verify_graphs, on.proposer.runner.verify_graphs] + ([on.proposer.loop_graphs] if k > 1 else [])
    for graphs in sets:
        assert graphs.disabled is None and graphs.replays > 2, (type(graphs).__name__, graphs.disabled, graphs.replays)
    # the same drafts as the draft model stepping eagerly (the target drafting for itself: the rows without
    # penalties accept every draft, the penalised one none)
    assert spec_counts(on) == spec_counts(eager)
    assert spec_counts(on)[1] > 0
    on.check_idle()
