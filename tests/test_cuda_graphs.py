"""The decode-graph plumbing (static buffers, padding rows on reserved pages, context buckets) on the
CPU, with graph capture replaced by an eager replay of the same static buffers; the real capture
runs in tests/test_gpu.py."""

import pytest
import torch

from engine_utils import GREEDY, assert_matches_full_forward, make_engine, random_prompts, run
from kimiserve.engine import cuda_graphs, worker as engine_module
from kimiserve.sampling_params import SamplingParams


class EagerReplay:
    """Stands in for a CUDA graph: replay() runs the forward on the static buffers into a static output."""

    def __init__(self, graphs, size, bucket):
        self.args = (graphs.input_ids[:size], graphs._batch(size, bucket), graphs.rows[:size])
        self.model = graphs.model
        self.logits = graphs.model.forward_batch(*self.args)

    def replay(self):
        self.logits.copy_(self.model.forward_batch(*self.args))


@pytest.fixture
def eager_graphs(monkeypatch):
    captured = []

    def capture(self, size, bucket):
        self._fill([], [], size, bucket)
        self.pool.zero_state(self.pad_state_pages)
        fake = EagerReplay(self, size, bucket)
        self.graphs[(size, bucket)] = (fake, fake.logits)
        captured.append((size, bucket))
        return True

    monkeypatch.setattr(engine_module, "uses_cuda_graphs", lambda device, args: not args.enforce_eager)
    monkeypatch.setattr(cuda_graphs.DecodeGraphs, "_capture", capture)
    return captured


def test_capture_sizes():
    assert cuda_graphs.capture_sizes(1) == [1]
    assert cuda_graphs.capture_sizes(5) == [1, 2, 4, 5]
    assert cuda_graphs.capture_sizes(40) == [1, 2, 4, 8, 16, 32, 40]


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("float32", "fp4")])
def test_padded_decode_steps_match_full_forward(eager_graphs, dtype, kv):
    engine = make_engine(dtype, kv, max_num_seqs=20, max_model_len=4096, num_pages=300)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.pad_page == 300 and engine.pool.num_pages == 300 + 1 + 5
    prompts = random_prompts([3, 70, 150, 9, 33], seed=7)
    outs = run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))
    for i, prompt in enumerate(prompts):
        assert_matches_full_forward(engine, prompt, outs[f"r{i}"].outputs[0].token_ids)
    assert graphs.replays >= 11 and {size for size, _ in eager_graphs} >= {8}  # 5 rows padded to 8
    assert all(bucket == 2048 for _, bucket in eager_graphs)
    engine.check_idle()
    assert engine.allocator.stats()["pages_used"] <= engine.allocator.stats()["pages_cached"]


def test_enforce_eager_turns_graphs_off(eager_graphs):
    engine = make_engine(enforce_eager=True)
    assert engine.runner.graphs is None and engine.pool.num_pages == 200


def test_context_bucket():
    graphs = cuda_graphs.DecodeGraphs.__new__(cuda_graphs.DecodeGraphs)
    graphs.max_model_len = 20000
    assert [graphs.context_bucket(n) for n in (1, 2048, 4097, 9000, 20000)] == [2048, 2048, 8192, 16384, 20000]
