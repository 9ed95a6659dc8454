"""The decode-graph plumbing (static buffers, padding rows on reserved pages, context buckets) on the
CPU, with graph capture replaced by an eager replay of the same static buffers; the real capture
runs in tests/test_gpu.py."""

import contextlib

import pytest
import torch

from engine_utils import (GREEDY, MERGE_TEST, assert_matches_full_forward, assert_rows_match, compare_with_full_forward,
                          fp32_row_tolerance, make_engine, merged_twin, random_prompts, run)
from kimiserve.engine import cuda_graphs, worker as engine_module
from kimiserve.sampling_params import SamplingParams


class EagerReplay:
    """Stands in for a CUDA graph: replay() runs the forward on the static buffers into a static output
    (with LoRA: each row's adapter from the static slots buffer, as a captured graph reads it)."""

    def __init__(self, graphs, size, bucket):
        self.args = (graphs.input_ids[:size], graphs._batch(size, bucket), graphs.rows[:size])
        self.forward = graphs.forward
        self.lora = contextlib.nullcontext
        if graphs.lora is not None:
            from kimiserve.lora.serving import LoRARows

            self.lora = lambda: graphs.lora.active(LoRARows(graphs.lora_slots[:size]))  # noqa: E731
        with self.lora():
            self.logits = graphs.forward(*self.args)

    def replay(self):
        with self.lora():
            self.logits.copy_(self.forward(*self.args))


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


def test_lora_decode_graphs_take_each_rows_adapter_as_an_input(eager_graphs):
    """Decode graphs with LoRA: rows of adapters a, b and the base in one graph, each row's slot from the
    static buffer; every request's logits == the full forward of its adapter merged into the weights. An
    adapter covering no projection the graphs were captured with makes them capture again."""
    from kimiserve.lora import LoRAAdapter

    engine = make_engine(max_num_seqs=8, num_pages=300, **MERGE_TEST)
    graphs = engine.runner.graphs
    prompts = random_prompts([12, 30, 7, 21], seed=11)
    params = SamplingParams(max_tokens=6, **GREEDY)
    run(engine, prompts[:1], params, ids=["warm"])  # graphs captured before any adapter
    captured = len(eager_graphs)
    a = LoRAAdapter.init(engine.model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(engine.model, "b", rank=8, random_b=True, seed=2, targets=("q_b_proj", "o_proj", "w2"))
    engine.load_lora_adapter("a", a)
    engine.load_lora_adapter("b", b)
    names = [None, "a", "b", "a"]
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        engine.add_request(f"r{i}", prompt, params, lora_name=name)
    outs = run(engine, [], params)
    assert len(eager_graphs) > captured and graphs.replays >= 5
    twins = {"a": merged_twin(engine, a), "b": merged_twin(engine, b), None: None}
    errors, agree = [], []
    for i, (prompt, name) in enumerate(zip(prompts, names)):
        e, ok, _ = compare_with_full_forward(engine, prompt, outs[f"r{i}"].outputs[0].token_ids, model=twins[name])
        errors, agree = errors + e, agree + ok
    assert_rows_match(errors, agree, fp32_row_tolerance(engine))


def test_enforce_eager_turns_graphs_off(eager_graphs):
    engine = make_engine(enforce_eager=True)
    assert engine.runner.graphs is None and engine.pool.num_pages == 200


def test_context_bucket():
    graphs = cuda_graphs.DecodeGraphs.__new__(cuda_graphs.DecodeGraphs)
    graphs.max_model_len = 20000
    assert [graphs.context_bucket(n) for n in (1, 2048, 4097, 9000, 20000)] == [2048, 2048, 8192, 16384, 20000]


def test_batch_invariant_decode_graphs_give_the_eager_bits(eager_graphs):
    """Batch-invariant mode records `InvariantForward` in its decode graphs: a sequence's logprobs in a
    padded graph batch (5 rows -> 8, the context bucket's width) == alone (a graph of 1) == eager (no
    graphs) == the trainer's, bit for bit; LoRA rows run eagerly."""
    from kimiserve.rl.trainer import PolicyTrainer

    prompts = random_prompts([3, 70, 40, 9, 33], seed=8)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=6, logprobs=0, ignore_eos=True) for s in range(5)]
    lp = lambda o: torch.tensor([x.logprob for x in o.outputs[0].logprobs])  # noqa: E731
    engine = make_engine(batch_invariant=True, max_num_seqs=8, max_model_len=256, num_pages=100)
    assert engine.runner.graphs is not None and engine.runner.graphs.forward == engine.runner.invariant.forward_batch
    outs = run(engine, prompts, params)
    assert engine.runner.graphs.replays >= 5 and {size for size, _ in eager_graphs} >= {8}
    alone = run(engine, prompts[:1], params[0], ids=["alone"])["alone"]
    assert {size for size, _ in eager_graphs} >= {1, 8}
    eager = run(make_engine(batch_invariant=True, enforce_eager=True, max_model_len=256, num_pages=100), prompts, params)
    for i in range(5):
        assert torch.equal(lp(outs[f"r{i}"]), lp(eager[f"r{i}"])), i
    assert alone.outputs[0].token_ids == outs["r0"].outputs[0].token_ids and torch.equal(lp(alone), lp(outs["r0"]))
    with torch.no_grad():
        lps = PolicyTrainer.from_engine(engine).logprobs(prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(5)])
    for i, got in enumerate(lps):
        assert torch.equal(got.cpu(), lp(outs[f"r{i}"])), i


def test_persistent_graph_inputs_equal_a_rebuild():
    """The mirrors keep the rows earlier steps wrote (`DecodeGraphs._written`) and rewrite only rows whose
    pages changed; after every step of random in-place page changes (a page appended, the last page or a
    state page copied on write, a tail released, new lists after a preemption), finishes, admissions,
    batch sizes and table widths, the inputs equal those a fresh instance builds from nothing."""
    import random
    from types import SimpleNamespace

    rng = random.Random(5)
    pool = SimpleNamespace(data=torch.empty(0), block_size=4)
    pad_states = torch.tensor([97, 98, 99])

    def graphs():
        return cuda_graphs.DecodeGraphs(None, pool, None, 16, 64, 96, pad_states, forward=lambda *a: None)

    persistent = graphs()
    persistent._add_mirror()  # two mirrors in turn, as on CUDA
    next_page = iter(range(1000))

    def new_chunk():
        return SimpleNamespace(context_start=0, block_table=[next(next_page) for _ in range(rng.randint(1, 5))],
                               state_pages=[next(next_page) for _ in range(3)])

    chunks = [new_chunk() for _ in range(5)]
    for step in range(300):
        for _ in range(rng.randint(0, 3)):
            action = rng.randrange(8)
            c = rng.choice(chunks) if chunks else None
            if action == 0 and c:
                c.block_table.append(next(next_page))
            elif action == 1 and c:
                c.block_table[-1] = next(next_page)
            elif action == 2 and c:
                c.state_pages[rng.randrange(3)] = next(next_page)
            elif action == 3 and c and len(c.block_table) > 1:
                del c.block_table[rng.randint(1, len(c.block_table) - 1):]
            elif action == 4 and c:
                c.block_table, c.state_pages = list(c.block_table), list(c.state_pages)  # same pages, new lists
            elif action == 5 and chunks:
                chunks.pop(rng.randrange(len(chunks)))  # finished: the rows after it move up
            elif action == 6 and len(chunks) < 16:
                chunks.insert(rng.randint(0, len(chunks)), new_chunk())
            elif action == 7 and c:
                c.block_table, c.state_pages = [next(next_page)], [next(next_page) for _ in range(3)]  # recomputed
        bucket = rng.choice([32, 64])
        cols = bucket // pool.block_size
        for c in chunks:
            c.context_start = rng.randrange(min(len(c.block_table), cols) * pool.block_size)
        size = persistent.padded_size(len(chunks))
        ids = [rng.randrange(500) for _ in chunks]
        fresh = graphs()
        slots = [rng.randrange(3) for _ in chunks] if rng.random() < 0.5 else None  # LoRA slots
        persistent._fill(ids, chunks, size, bucket, slots)
        fresh._fill(ids, chunks, size, bucket, slots)
        fields = lambda g: g.inputs[: cuda_graphs.FIELDS * 16].view(cuda_graphs.FIELDS, 16)  # noqa: E731
        for a, b in ((persistent, fresh), (fresh, persistent)):  # what the graph of `size` rows reads
            assert torch.equal(fields(a)[:, :size], fields(b)[:, :size])
            assert torch.equal(a.state_pages[:size], b.state_pages[:size]), f"step {step}"
            assert torch.equal(a._tables(size, bucket), b._tables(size, bucket)), f"step {step}"
