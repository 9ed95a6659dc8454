"""The verify-graph plumbing (`spec_decode.verify_graphs`: the [sequences, K + 1] grid of static
buffers, padding rows and sequences on reserved pages, decode chunks inside a verify graph, the KDA
replay graph driven by a kept-tokens buffer) on the CPU, with graph capture replaced by an eager
replay of the same static buffers; the real capture runs in tests/test_gpu.py."""

import pytest
import torch

from engine_utils import GREEDY, make_engine, random_prompts, run
from kimiserve.engine import cuda_graphs, worker as engine_module
from kimiserve.engine.spec_decode import draft_graphs, verify_graphs
from kimiserve.sampling_params import SamplingParams
from test_cuda_graphs import EagerReplay
from test_spec_decode import FEW, mixed_params, ngram, spec_counts, tokens


class EagerFn:
    """Stands in for a CUDA graph recorded from `fn`: replay() runs it again (into `out`, if given)."""

    def __init__(self, fn, out=None):
        self.fn, self.out = fn, out

    def replay(self):
        result = self.fn()
        if self.out is not None:
            self.out.copy_(result)


@pytest.fixture
def eager_graphs(monkeypatch):
    captured = []

    def capture_decode(self, size, bucket):
        self._fill([], [], size, bucket)
        self.pool.zero_state(self.pad_state_pages)
        fake = EagerReplay(self, size, bucket)
        self.graphs[(size, bucket)] = (fake, fake.logits)
        return True

    def capture_verify(self, size, bucket):
        self._padding_inputs(size, bucket)
        forward, replay = self._forwards(size, bucket)
        logits = forward()
        replay()  # on the reserved pages only: nothing keeps a token
        self.graphs[(size, bucket)] = (EagerFn(forward, logits), logits, EagerFn(replay))
        captured.append((size, bucket))
        return True

    def capture_loop(self, size, bucket):
        self._fill([], [], [], size, bucket)
        self.pool.zero_state(self.pad_state_pages)
        body = lambda: self._loop(size, bucket)  # noqa: E731
        drafts = body()
        self.graphs[(size, bucket)] = (EagerFn(body, drafts), drafts)
        return True

    monkeypatch.setattr(engine_module, "uses_cuda_graphs", lambda device, args: not args.enforce_eager)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture_decode)
    monkeypatch.setattr(verify_graphs.VerifyGraphs, "_capture", capture_verify)
    monkeypatch.setattr(draft_graphs.DraftLoopGraphs, "_capture", capture_loop)
    return captured


def test_sizes_and_fit():
    g = verify_graphs.VerifyGraphs.__new__(verify_graphs.VerifyGraphs)
    g.T, g.disabled, g.sizes = 4, None, cuda_graphs.capture_sizes(64)
    from kimiserve.model.batch import SequenceChunk

    def chunk(n, verify=True, snapshot=None):
        return SequenceChunk(0, n, 5, torch.zeros(1, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), snapshot,
                             verify)

    assert g.fits([chunk(4), chunk(1, False), chunk(2)])
    assert not g.fits([chunk(1, False)])  # no verify chunk: a decode graph's step
    assert not g.fits([chunk(5)])  # longer than K + 1
    assert not g.fits([chunk(4), chunk(3, False)])  # a prefill chunk
    assert not g.fits([chunk(4)] * 65)  # more sequences than the largest graph


@pytest.mark.parametrize("k", [1, 3])
def test_verify_graphs_greedy_equal(eager_graphs, k):
    """Mixed batches (verify chunks of every length up to K + 1 beside one-token decodes, padded
    sequences) through verify graphs: the tokens of speculation off, drafts both accepted and rejected,
    no leaks."""
    prompts = random_prompts([20, 57, 9, 90, 33], seed=7)
    params = mixed_params() + [SamplingParams(max_tokens=40, allowed_token_ids=FEW[:2], **GREEDY)]
    off = make_engine()
    on = make_engine(speculative_config=ngram(k), max_num_seqs=8, num_pages=300)
    graphs = on.runner.verify_graphs
    assert graphs is not None and graphs.T == k + 1 and graphs.pad_page == 300
    want, got = tokens(run(off, prompts, params)), tokens(run(on, prompts, params))
    assert got == want
    drafted, accepted, _ = spec_counts(on)
    assert 0 < accepted < drafted
    assert graphs.replays > 5 and {size for size, _ in eager_graphs} >= {8}  # 5 sequences padded to 8
    on.check_idle()
    off.check_idle()


def _state(engine, request):
    pages = torch.tensor(request.state_pages)
    return engine.pool.recurrent[pages].clone(), engine.pool.conv[pages].clone()


def test_verify_graph_state_matches_eager_speculation(eager_graphs):
    """Step for step, an engine on verify graphs and one running verify steps eagerly keep the same
    tokens and (to fp32 rounding of the projections' other batch shapes) the same KDA state."""
    prompts = random_prompts([37, 25], seed=9)
    p = SamplingParams(max_tokens=50, allowed_token_ids=FEW, **GREEDY)
    graphed = make_engine(speculative_config=ngram(4))
    eager = make_engine(speculative_config=ngram(4), enforce_eager=True)
    assert eager.runner.verify_graphs is None
    for e in (graphed, eager):
        for i, prompt in enumerate(prompts):
            e.add_request(f"r{i}", prompt, p)
    checked = 0
    while graphed.has_unfinished_requests():
        graphed.step()
        eager.step()
        assert [r.all_ids for r in graphed.scheduler.running] == [r.all_ids for r in eager.scheduler.running]
        for a, b in zip(graphed.scheduler.running, eager.scheduler.running):
            assert a.num_computed == b.num_computed
            for x, y in zip(_state(graphed, a), _state(eager, b)):
                assert float((x - y).norm() / y.norm()) < 1e-5
            checked += 1
    assert checked > 10 and graphed.runner.verify_graphs.replays > 5
    graphed.check_idle()
    eager.check_idle()


def test_verify_graphs_preemption_and_prefix_hits(eager_graphs):
    """A small pool preempts mid-round, a second run hits the prefix cache; seeded n = 3 samples too."""
    prompts = random_prompts([40, 70, 33], seed=3)
    params = mixed_params(48)[:2] + [SamplingParams(max_tokens=48, n=3, seed=11, temperature=0.8, top_p=0.9, top_k=5,
                                                    allowed_token_ids=FEW, frequency_penalty=0.3, ignore_eos=True)]
    want = tokens(run(make_engine(), prompts, params))
    small = make_engine(num_pages=21, speculative_config=ngram(3))
    assert tokens(run(small, prompts, params)) == want
    assert small.stats()["preemptions"] > 0 and small.runner.verify_graphs.replays > 0
    small.check_idle()
    engine = make_engine(speculative_config=ngram(3))
    run(engine, [p[:-3] for p in prompts], params)
    assert tokens(run(engine, prompts, params, ids=["r0", "r1", "r2"])) == want
    assert engine.stats()["prefix_hit_tokens"] > 0
    engine.check_idle()


def test_verify_graphs_with_draft_model(eager_graphs):
    """The target drafting for itself (full K + 1 chunks, every greedy draft kept) through verify graphs;
    the draft model's catch-up chunks through its verify graphs and its drafting loop as one graph
    (while the request with allowed_token_ids runs: step by step on its decode graphs)."""
    prompts = random_prompts([20, 57, 9], seed=7)
    params = [SamplingParams(max_tokens=48, **GREEDY)] * 2 + [SamplingParams(max_tokens=10, n=2, seed=5, temperature=0.9,
                                                                             top_k=4, allowed_token_ids=FEW,
                                                                             ignore_eos=True)]
    want = tokens(run(make_engine(), prompts, params))
    on = make_engine(speculative_config={"method": "draft_model", "model": "tiny", "num_speculative_tokens": 3})
    counts = {}
    release = on.scheduler.on_finish
    on.scheduler.on_finish = lambda r: (counts.__setitem__(r.request_id, (r.num_draft_tokens, r.num_accepted_tokens)),
                                        release(r))
    assert tokens(run(on, prompts, params)) == want
    assert all(counts[r][1] == counts[r][0] > 0 for r in ("r0", "r1")), counts  # the loop's drafts are the target's
    draft = on.proposer.runner
    assert on.runner.verify_graphs.replays > 5 and draft.verify_graphs.replays > 5
    assert on.proposer.loop_graphs.replays > 3 and draft.graphs.replays > 0
    on.check_idle()


def test_benchmark_with_graphs(eager_graphs, tmp_path):
    """benchmarks/spec_decode.py as the H200 runs it (graphs on): the untimed capture run, then timed runs
    that replay the target's verify graphs and the draft model's graphs; the table and the JSON."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import spec_decode

    out = tmp_path / "spec.json"
    assert spec_decode.main(["--quick", "--batch-sizes", "2", "--kinds", "repetitive", "--out", str(out)]) == 0
    rows = {r["method"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ngram"]["same_tokens_as_off"] and rows["draft"]["same_tokens_as_off"]
    assert rows["off"]["graph_replays"]["target_graphs"] == rows["off"]["steps"]
    assert rows["draft"]["graph_replays"]["target_verify_graphs"] == rows["draft"]["steps"] > 0
    assert rows["draft"]["graph_replays"]["draft_loop_graphs"] > 0 and rows["draft"]["graph_replays"]["draft_verify_graphs"] > 0
