"""The engine equals a full-sequence forward of the same tokens, however it batches, chunks, preempts
or restores prefixes; and it never leaks a page. fp32 runs use `tiny` (random weights, every structural
feature, top-8 indexer); bf16 runs the trained demo model (`BF16_MODEL`), well conditioned enough for
bounds near bf16 rounding (engine_utils.BF16_MEDIAN_TOLERANCE, assert_all_match_full_forward)."""

import pytest
import torch

from conftest import rel_rms
from engine_utils import (
    BF16_MODEL,
    GREEDY,
    assert_all_match_full_forward,
    assert_matches_full_forward,
    assert_same_rows,
    make_engine,
    random_prompts,
    run,
)
from kimiserve.engine.request import sample_seed
from kimiserve.model.batch import CacheRoundTrip
from kimiserve.sampling_params import SamplingParams

MODEL_CACHE = [("float32", "bf16"), ("float32", "fp8"), ("bfloat16", "bf16"), ("bfloat16", "fp8"), ("float32", "fp4"),
               ("bfloat16", "fp4"), ("float32", "fp8+fp4")]


@pytest.fixture
def engines():
    """Engines made by a test; after it, each must be idle with every page free or in the prefix cache."""
    made = []

    def factory(dtype="float32", *args, **kwargs):
        kwargs.setdefault("model", BF16_MODEL if dtype == "bfloat16" else "tiny")
        made.append(make_engine(dtype, *args, **kwargs))
        return made[-1]

    yield factory
    for engine in made:
        engine.check_idle()


@pytest.mark.parametrize("rotation", [False, True])
def test_fp4_index_key_rotation_either_way(engines, rotation):
    """The Hadamard rotation of index keys (default on for fp4 keys) can be turned off; both match
    their oracle, and the rotation changes what the cache holds (so it is really applied)."""
    engine = engines("float32", "fp4", index_key_rotation=rotation)
    assert engine.layout.index_key_rotation is rotation
    prompts = random_prompts([150, 40], seed=9)
    outs = run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert_all_match_full_forward(engine, prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(2)])


@pytest.mark.parametrize("dtype,kv", MODEL_CACHE)
def test_prefill_and_decode_match_full_forward(engines, dtype, kv):
    engine = engines(dtype, kv)
    prompts = random_prompts([3, 70, 150])  # 150 > one page (64) and >> index_topk (8): sparse
    outs = run(engine, prompts, SamplingParams(max_tokens=20, **GREEDY))
    tokens = [outs[f"r{i}"].outputs[0].token_ids for i in range(3)]
    assert all(len(t) == 20 and outs[f"r{i}"].outputs[0].finish_reason == "length" for i, t in enumerate(tokens))
    assert_all_match_full_forward(engine, prompts, tokens)


@pytest.mark.parametrize("dtype,kv", MODEL_CACHE)
def test_whole_prompt_prefill_is_bit_equal(engines, dtype, kv):
    """One sequence, the whole prompt in one chunk: the same ops in the same order as the full forward
    (without prefix caching, which splits the prompt's last token off to keep a snapshot before it),
    on the same shapes: the layers see the [1, 150, d] batch, and the logits projection the one row
    the engine samples from (the full forward's [150, d] product may run another BLAS kernel, which
    rounds differently: ~1e-6 in fp32, and it may in bf16 on another CPU). So bit-identical."""
    engine = engines(dtype, kv, enable_prefix_caching=False)
    prompt = random_prompts([150], seed=5)[0]
    run(engine, [prompt], SamplingParams(max_tokens=1, **GREEDY))
    with torch.inference_mode():
        trip = CacheRoundTrip(kv, index_key_rotation=engine.layout.index_key_rotation)
        hidden = engine.model.model(torch.tensor(prompt)[None], trip)[0]
        ref = engine.model.logits(hidden[torch.tensor([len(prompt) - 1])])[0]
    got = engine.recorded[(tuple(prompt), None, 0)]
    assert torch.equal(got, ref), (got - ref).abs().max()
    # the same oracle as the full forward's last row, but for the rounding of another product shape:
    # ~1e-7 in fp32; in bf16 at most one bf16 ulp (2^-8 relative) per logit
    full = engine.model(torch.tensor(prompt), kv_cache_dtype=kv)[-1]
    assert rel_rms(ref, full) < (1e-5 if engine.dtype == torch.float32 else 2**-8)


@pytest.mark.parametrize("dtype,kv,chunk", [(dtype, kv, chunk) for chunk in (1, 7, 64) for dtype, kv in MODEL_CACHE
                                             if dtype == "float32" or chunk == 7])
def test_chunked_prefill(engines, dtype, kv, chunk):
    """Prompts prefilled `chunk` tokens a step, one request after another, their rows pooled: the
    rows of one request share one trajectory, so one discrete flip moves them all (with bf16's chaos,
    one request's 40-row median came to 1.52x the full forward's on another CPU's rounding; with fp8,
    one flipped cache code put all 16 rows at ~1e-3 and one at 0.05). The prompts' seed is 3: with the
    random weights of per-tensor seeds (one global model at every tensor-parallel size), seed 2's
    150-token prompt at chunk 7 met such a cascade with fp4 index keys at one torch thread (rows off by
    1-66%, a top-k pick flipped; at two threads it passes), as 1 of 6 prompt seeds did.
    Every cache format at chunks 1 (a step per token), 7 (dividing no prompt) and 64 with the fp32
    model; the bf16 model (the same chunking code, its cost ~3x) at chunk 7 with each format."""
    engine = engines(dtype, kv, max_num_batched_tokens=chunk)
    prompts = random_prompts([150, 60, 30], seed=3)
    tokens = []
    for i, prompt in enumerate(prompts):
        before = engine.stats()["steps"]
        outs = run(engine, [prompt], SamplingParams(max_tokens=16, **GREEDY), ids=[f"r{i}"])
        assert engine.stats()["steps"] - before == -(-len(prompt) // chunk) + 15
        tokens.append(outs[f"r{i}"].outputs[0].token_ids)
    assert_all_match_full_forward(engine, prompts, tokens)


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("float32", "fp4")])
def test_mixed_batch_equals_each_request_alone(engines, dtype, kv):
    """Each request alone, fed the batch's tokens (so every step has the same context even where a
    rounding difference flips a greedy pick), sees the batch's logits up to rounding."""
    prompts = random_prompts([5, 90, 33, 140, 1], seed=3)
    params = SamplingParams(max_tokens=12, **GREEDY)
    together = engines(dtype, kv, max_num_batched_tokens=40)  # decodes and prefill chunks share steps
    outs = run(together, prompts, params)
    tokens = [outs[f"r{i}"].outputs[0].token_ids for i in range(len(prompts))]
    assert_all_match_full_forward(together, prompts, tokens)
    alone_rows = {}
    for prompt, toks in zip(prompts, tokens):
        alone = engines(dtype, kv)
        alone.forced[tuple(prompt)] = toks
        assert run(alone, [prompt], params)["r0"].outputs[0].token_ids == toks
        alone_rows.update(alone.recorded)
    assert_same_rows(together, together.recorded, alone_rows, prompts, tokens)


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("bfloat16", "bf16")])
def test_forced_preemption(engines, dtype, kv):
    # 256-token sequences need 4 pages + 5 state pages; 22 pages cannot hold four 100 + 60 token sequences
    engine = engines(dtype, kv, max_model_len=256, num_pages=22, enable_prefix_caching=False)
    prompts = random_prompts([100, 101, 102, 103], seed=4)
    outs = run(engine, prompts, SamplingParams(max_tokens=60, **GREEDY))
    assert engine.stats()["preemptions"] > 0
    tokens = [outs[f"r{i}"].outputs[0].token_ids for i in range(4)]
    assert all(len(t) == 60 for t in tokens)
    assert_all_match_full_forward(engine, prompts, tokens)


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("float32", "fp4")])
def test_prefix_cache_multi_turn(engines, dtype, kv):
    engine = engines(dtype, kv)
    cold = engines(dtype, kv, enable_prefix_caching=False)
    turn1, extra = random_prompts([75, 21], seed=6)
    params = SamplingParams(max_tokens=15, **GREEDY)
    answer = run(engine, [turn1], params, ids=["t1"])["t1"].outputs[0].token_ids
    turn2 = turn1 + answer + extra  # the next turn repeats the conversation so far
    before = engine.stats()["computed_tokens"]
    out2 = run(engine, [turn2], params, ids=["t2"])["t2"]
    # the snapshot at the end of turn 1 holds every computed token: prompt + answer but the last token
    hit = len(turn1) + len(answer) - 1
    assert out2.num_cached_tokens == hit
    assert engine.stats()["computed_tokens"] - before == len(turn2) - hit + 14
    assert engine.stats()["prefix_hit_tokens"] == hit
    cold.forced[tuple(turn2)] = out2.outputs[0].token_ids  # the same context at every step
    reference = run(cold, [turn2], params, ids=["t2"])["t2"]
    assert reference.num_cached_tokens == 0
    assert_same_rows(engine, engine.recorded, cold.recorded, [turn2], [out2.outputs[0].token_ids])
    assert_all_match_full_forward(engine, [turn1, turn2], [answer, out2.outputs[0].token_ids])


def test_prefix_hit_at_prompt_end_snapshot(engines):
    """A prompt that extends an earlier prompt restores the state kept before that prompt's last token."""
    engine = engines()
    base, more = random_prompts([100, 10], seed=7)
    first = run(engine, [base], SamplingParams(max_tokens=3, **GREEDY), ids=["a"])["a"]
    out = run(engine, [base + more], SamplingParams(max_tokens=5, **GREEDY), ids=["b"])["b"]
    assert out.num_cached_tokens == 99
    assert_all_match_full_forward(engine, [base, base + more], [first.outputs[0].token_ids, out.outputs[0].token_ids])


@pytest.mark.parametrize("dtype,kv,budget", [("float32", "bf16", 2048), ("float32", "fp8", 2048), ("float32", "bf16", 64)])
def test_repeated_prompt_computes_one_token(engines, dtype, kv, budget):
    """With budget 64 the 129-token prompt's last chunk is its last token alone (the copy path)."""
    engine = engines(dtype, kv, max_num_batched_tokens=budget)
    prompt = random_prompts([129], seed=14)[0]
    params = SamplingParams(max_tokens=10, **GREEDY)
    first = run(engine, [prompt], params, ids=["a"])["a"]
    tokens, first_rows = first.outputs[0].token_ids, dict(engine.recorded)
    assert_matches_full_forward(engine, prompt, tokens)
    before = engine.stats()["computed_tokens"]
    engine.forced[tuple(prompt)] = tokens  # the same context at every step as the first run
    again = run(engine, [prompt], params, ids=["b"])["b"]
    assert again.num_cached_tokens == 128 and first.num_cached_tokens == 0
    assert engine.stats()["computed_tokens"] - before == 1 + 9
    assert_same_rows(engine, first_rows, engine.recorded, [prompt], [tokens])


def test_prefix_cache_evicted_under_pressure(engines):
    engine = engines(max_model_len=256, num_pages=22)
    prompts = random_prompts([100, 100, 100, 100], seed=8)
    for i, prompt in enumerate(prompts):  # one after the other: each finishes and leaves snapshots
        run(engine, [prompt], SamplingParams(max_tokens=20, **GREEDY), ids=[f"q{i}"])
    assert engine.stats()["snapshots"] >= 1
    assert engine.stats()["pages_free"] + engine.stats()["pages_cached"] == 22


def test_abort_mid_generation(engines):
    engine = engines()
    prompts = random_prompts([40, 60, 80], seed=9)
    params = SamplingParams(max_tokens=30, **GREEDY)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    for _ in range(5):
        engine.step()
    engine.abort_request("r1")
    engine.abort_request("unknown")  # ignored
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert set(outs) == {"r0", "r2"}
    tokens = [outs[r].outputs[0].token_ids for r in ("r0", "r2")]
    assert_all_match_full_forward(engine, [prompts[0], prompts[2]], tokens)


def test_abort_waiting_request(engines):
    engine = engines(max_num_seqs=1)
    engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=4, **GREEDY))
    engine.add_request("b", [4, 5, 6], SamplingParams(max_tokens=4, **GREEDY))
    engine.step()
    assert engine.stats()["waiting"] == 1
    engine.abort_request("b")
    while engine.has_unfinished_requests():
        engine.step()


def test_seeded_sampling_reproduces(engines):
    prompts = random_prompts([20, 30, 40], seed=10)
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    a = run(engines(), [prompts[0]], seeded)["r0"].outputs[0].token_ids
    # the same request in another batch, with other requests around it, samples the same tokens
    others = [SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True)] * 2
    b = run(engines(max_num_batched_tokens=16), [prompts[1], prompts[0], prompts[2]], [others[0], seeded, others[1]])
    assert b["r1"].outputs[0].token_ids == a
    c = run(engines(), [prompts[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert c["r0"].outputs[0].token_ids != a


def test_seeded_sampling_survives_preemption(engines):
    prompts = random_prompts([100, 101, 102, 103], seed=11)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=40, ignore_eos=True) for s in range(4)]
    roomy = run(engines(max_model_len=256), prompts, params)
    tight_engine = engines(max_model_len=256, num_pages=22, enable_prefix_caching=False)
    tight = run(tight_engine, prompts, params)
    assert tight_engine.stats()["preemptions"] > 0
    for rid in roomy:
        assert tight[rid].outputs[0].token_ids == roomy[rid].outputs[0].token_ids


def test_parallel_samples_fork_the_prompt(engines):
    engine = engines()
    prompt = random_prompts([90], seed=12)[0]
    greedy = run(engine, [prompt], SamplingParams(max_tokens=10, **GREEDY), ids=["g"])["g"].outputs[0].token_ids
    fresh = engines(enable_prefix_caching=False)
    before = fresh.stats()["computed_tokens"]
    out = run(fresh, [prompt], SamplingParams(n=3, max_tokens=10, **GREEDY), ids=["n"])["n"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.token_ids == greedy for o in out.outputs)
    # the prompt ran once: 90 prompt tokens + 9 fed-back tokens per sample
    assert fresh.stats()["computed_tokens"] - before == 90 + 3 * 9
    sampled = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=10, ignore_eos=True)
    x = run(engines(), [prompt], sampled)["r0"]
    y = run(engines(), [prompt], sampled)["r0"]
    assert [o.token_ids for o in x.outputs] == [o.token_ids for o in y.outputs]
    assert len({tuple(o.token_ids) for o in x.outputs}) > 1
    # sample i draws every token from the seed sample_seed(7, i): the same as a lone request with that seed
    for i, o in enumerate(x.outputs):
        alone = SamplingParams(temperature=1.0, seed=sample_seed(7, i), max_tokens=10, ignore_eos=True)
        assert run(engines(), [prompt], alone)["r0"].outputs[0].token_ids == o.token_ids


def test_stop_token_and_max_model_len(engines):
    engine = engines(max_model_len=80)
    prompt = random_prompts([30], seed=13)[0]
    free = run(engine, [prompt], SamplingParams(max_tokens=60, **GREEDY), ids=["a"])["a"].outputs[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 50  # 30 + 50 = max_model_len
    stop_at = free.token_ids[4]
    first = free.token_ids.index(stop_at)
    out = run(engine, [prompt], SamplingParams(max_tokens=60, stop_token_ids=[stop_at], **GREEDY), ids=["b"])
    o = out["b"].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop_at and o.token_ids == free.token_ids[: first + 1]


def test_bad_input_leaves_nothing_allocated(engines):
    engine = engines(max_model_len=64)
    cases = [
        (lambda: engine.add_request("a", [1] * 64, SamplingParams()), "max_model_len"),
        (lambda: engine.add_request("b", [], SamplingParams()), "empty"),
        (lambda: engine.add_request("c", [5000], SamplingParams()), "token ids"),
        (lambda: engine.add_request("d", [1, 2], SamplingParams(stop_token_ids=[99999])), "stop_token_ids"),
        (lambda: engine.add_request("e", [1, 2], SamplingParams(n=1000)), "max_num_seqs"),
        (lambda: engine.add_request("f", [1, 2], "greedy"), "SamplingParams"),
    ]
    for call, word in cases:
        with pytest.raises(ValueError, match=word):
            call()
    engine.add_request("g", [1, 2], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("g", [1, 2], SamplingParams())
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.stats()["pages_used"] == engine.stats()["pages_cached"]


def test_engine_arguments_checked():
    with pytest.raises(ValueError, match="lower max_model_len"):
        make_engine(max_model_len=4096, num_pages=20)
    with pytest.raises(ValueError, match="max_model_len=5000 is longer"):
        make_engine(max_model_len=5000)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_engine(kv="fp6")
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        make_engine(max_num_batched_tokens=0)


def test_sparsity_is_exercised():
    """The tiny model's top-8 indexer changes the output at these lengths (so the tests above check sparse attention)."""
    from kimiserve.model.model import build_model

    config = make_engine().config
    prompt = torch.tensor(random_prompts([150])[0])
    sparse = build_model(config, torch.float32)(prompt)
    dense = build_model(config.replace(index_topk=4096), torch.float32)(prompt)
    assert torch.equal(sparse[:8], dense[:8])  # within the first 8 tokens every token is selected
    assert float((sparse[100:] - dense[100:]).norm() / dense[100:].norm()) > 0.05


@pytest.mark.parametrize("budget", [7, 2048])
def test_logprobs_and_prompt_logprobs_match_full_forward(engines, budget):
    engine = engines(max_num_batched_tokens=budget)
    prompt = random_prompts([40], seed=15)[0]
    params = SamplingParams(max_tokens=6, logprobs=3, prompt_logprobs=2, **GREEDY)
    out = run(engine, [prompt], params)["r0"]
    tokens = out.outputs[0].token_ids
    ref = torch.log_softmax(engine.model(torch.tensor(prompt + tokens), kv_cache_dtype="bf16"), dim=-1)
    # |d logprob| <= 2 max |d logit|: ~1e-6 where the chunked engine and the full forward cache the
    # same bf16 latents, up to ~1e-4 where a rounding difference moved one cached value to the next
    # bf16 code (measured 7.7e-5 with 7-token chunks; 1e-4 was the bound); 1e-3 is the fp32 bf16-cache
    # row tolerance (engine_utils), and a wrong position or chunk gives errors of order 1. The top
    # tokens are those of the full forward up to the same tolerance, so a near-tie may come either way.
    tol = 1e-3

    def assert_top(entry, row, k):
        ids = torch.tensor([t for t, _ in entry.top])
        assert len(ids) == k and torch.allclose(row[ids], row.topk(k).values, rtol=0, atol=tol), (entry.top, row.topk(k))
        assert torch.allclose(torch.tensor([lp for _, lp in entry.top]), row[ids], rtol=0, atol=tol)

    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry.token_id == prompt[pos]
        assert abs(entry.logprob - float(ref[pos - 1, prompt[pos]])) < tol
        assert_top(entry, ref[pos - 1], 2)
    for step, entry in enumerate(out.outputs[0].logprobs):
        row = ref[len(prompt) - 1 + step]
        assert entry.token_id == tokens[step] and entry.rank == 1  # greedy picks the best token
        assert abs(entry.logprob - float(row[tokens[step]])) < tol
        assert_top(entry, row, 3)


@pytest.fixture(scope="module")
def linear_checkpoint(tmp_path_factory):
    """A tiny Kimi-Linear-shaped model folder: no indexer (dense MLA), no q-LoRA, plain residuals."""
    from conftest import tiny_linear_config
    from kimiserve.model.loader import save_checkpoint
    from kimiserve.model.model import build_model
    from kimiserve.tokenizer import load_tokenizer

    folder = tmp_path_factory.mktemp("tiny-linear")
    save_checkpoint(build_model(tiny_linear_config(), torch.float32, seed=3), folder)
    load_tokenizer("tiny").save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("kv", ["bf16", "fp8"])
def test_dense_mla_model_from_folder(engines, linear_checkpoint, kv):
    engine = engines("float32", kv, model=linear_checkpoint, max_num_batched_tokens=48)
    assert not engine.config.has_indexer and engine.config.attn_res_block_size is None
    prompts = random_prompts([5, 100], seed=16)
    outs = run(engine, prompts, SamplingParams(max_tokens=12, **GREEDY))
    assert_all_match_full_forward(engine, prompts, [outs[f"r{i}"].outputs[0].token_ids for i in range(2)])
    again = run(engine, [prompts[1]], SamplingParams(max_tokens=3, **GREEDY), ids=["again"])["again"]
    assert again.num_cached_tokens == 99


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("bfloat16", "fp8")])
def test_prefill_in_place_matches_full_forward(engines, linear_checkpoint, dtype, kv, dense):
    """Prefill chunks through the paged decode ops, one row per query token (what CUDA runs, here
    with the reference ops): chunked, batched with decodes, and after a prefix hit."""
    import dataclasses

    from kimiserve.ops.backend import REFERENCE_OPS

    model = linear_checkpoint if dense else (BF16_MODEL if dtype == "bfloat16" else "tiny")
    engine = engines(dtype, kv, model=model, max_num_batched_tokens=37)
    engine.runner.ops = dataclasses.replace(REFERENCE_OPS, prefill_in_place=True)
    prompts = random_prompts([4, 90, 130], seed=21)
    n = 16 if dtype == "bfloat16" and dense else 8  # the random model's bf16 rule is statistical: 3 x 16 + 3 rows
    outs = run(engine, prompts, SamplingParams(max_tokens=n, **GREEDY))
    again = run(engine, [prompts[2] + [7, 8, 9]], SamplingParams(max_tokens=3, **GREEDY), ids=["again"])["again"]
    assert again.num_cached_tokens == 129
    # one pool of rows: the 3 rows of `again` alone were too few for the bf16 rule (0.443 against an
    # allowed 0.41 on an AMD EPYC), and fp32's median of 3 rows is one cache code flip from failing
    assert_all_match_full_forward(engine, [*prompts, prompts[2] + [7, 8, 9]],
                                  [*(outs[f"r{i}"].outputs[0].token_ids for i in range(3)), again.outputs[0].token_ids])


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_cache_summary_counts_the_pool(kv):
    """The startup line's figures are the engine's own: pages x block_size tokens, and how many
    max_model_len requests (their pages plus the KDA state pages) the pages hold."""
    engine = make_engine("float32", kv, num_pages=50, max_model_len=300)
    bs, state = engine.layout.block_size, engine.allocator.num_state_pages_per_seq
    line = engine.cache_summary()
    assert "50 pages" in line and f"{50 * bs:,} tokens" in line and f"({kv}, {bs} tokens per page)" in line
    assert f"{50 / (-(-300 // bs) + state):.2f} requests of max_model_len=300" in line
