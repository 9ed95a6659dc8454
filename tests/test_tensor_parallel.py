"""Tensor parallelism of the model (issue 16 item 2): one rank's shard of every layer.

W gloo ranks (one process and one torch thread each, conftest's `ranks`) run their shards of the same
global model with the TP collectives; rank 0's logits must equal the one-process model's.

The bound "within fp32 rounding": the ranks compute the same sums in another order (a
row-parallel projection sums tp partial dot products, then the all-reduce adds them; the
vocab-parallel logits are exact slices). An fp32 dot product of K <= 384 terms rounds by about
sqrt(K) * 2^-24 ~ 1e-6 relative, and that carries through the 5 layers: measured 1.6e-6 - 1.8e-6
relative RMS over all logits at tp 2, 3 and 4 (worst row 3e-6). The tests allow 1e-5 overall and
3e-5 for the worst row; a wrong shard, a missing all-reduce or a flipped discrete choice (a routed
expert, an index top-k pick) moves logits by 1e-2 or more. Argmax must agree everywhere.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from safetensors import safe_open as real_safe_open

from conftest import rel_rms, tiny_linear_config
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset, tiny_parallel_config
from kimiserve.distributed.parallel_state import ParallelConfig, ParallelContext
from kimiserve.model import loader as loader_module
from kimiserve.model.batch import ForwardBatch, SequenceChunk
from kimiserve.model.loader import checkpoint_layout, load_weights, save_checkpoint
from kimiserve.model.model import KimiForCausalLM, build_model

OVERALL_BOUND, ROW_BOUND = 1e-5, 3e-5
CONFIGS = {"parallel": tiny_parallel_config, "linear": tiny_linear_config}


def ids_for(config, batch=2, length=23, seed=5):
    return torch.randint(0, config.vocab_size, (batch, length), generator=torch.Generator().manual_seed(seed))


def assert_fp32_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    rows = out.reshape(-1, out.shape[-1]), ref.reshape(-1, ref.shape[-1])
    worst = max(rel_rms(a, b) for a, b in zip(*rows))
    assert rel_rms(out, ref) <= OVERALL_BOUND and worst <= ROW_BOUND, (rel_rms(out, ref), worst)
    assert torch.equal(out.argmax(-1), ref.argmax(-1))


def rank_context(tp: int, rank: int, expert_parallel: bool = False) -> ParallelContext:
    """A rank's context without process groups: enough to build and load a shard (no collective runs)."""
    return ParallelContext(ParallelConfig(tp, enable_expert_parallel=expert_parallel), rank)


# ------------------------------------------------------------------------------- the shards themselves
def expected_shard(full: torch.nn.Parameter, shard: torch.nn.Parameter, module, name: str) -> torch.Tensor:
    """The part of the one-process parameter `full` that a rank's parameter `shard` must hold."""
    value = full.data
    if ".experts." in name:
        value = value[torch.tensor(module.expert_ids)]
    spec = getattr(shard.weight_loader, "shard", None)
    if spec is None:
        return value
    dim, rank, parts = spec
    n = shard.shape[dim]
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # vocabulary padded with zero rows
        value = torch.cat([value, value.new_zeros(n * parts - value.shape[0], *value.shape[1:])])
    return value.narrow(dim, rank * n, n)


@pytest.mark.parametrize("tp, expert_parallel", [(2, False), (3, False), (4, False), (3, True), (4, True)])
def test_random_shards_are_slices_of_the_one_process_model(tp, expert_parallel):
    """Random init is a virtual checkpoint: each rank's shard holds exactly its slice of the one global
    model (the same seed gives the same model at every tp), heads contiguous, padding rows zero."""
    config = tiny_parallel_config()
    one = build_model(config, torch.float32, seed=3)
    full = dict(one.named_parameters())
    for rank in range(tp):
        shard = build_model(config, torch.float32, seed=3, parallel=rank_context(tp, rank, expert_parallel))
        names = [n for n, _ in shard.named_parameters()]
        assert names == list(full)
        for name, param in shard.named_parameters():
            module = shard.get_submodule(name.rsplit(".", 1)[0])
            expected = expected_shard(full[name], param, module, name)
            assert torch.equal(param.data, expected), name
        attn = shard.model.layers[2].self_attn
        assert attn.num_heads == 12 // tp  # the indexer is replicated
        assert attn.indexer.wq_b.weight.shape == one.model.layers[2].self_attn.indexer.wq_b.weight.shape
        assert shard.model.layers[0].self_attn.num_heads == 12 // tp
        experts = shard.model.layers[1].block_sparse_moe.experts
        if expert_parallel:
            assert experts.expert_ids == list(range(rank * 12 // tp, (rank + 1) * 12 // tp))
            assert experts.w2_packed.shape == (12 // tp, 96, 384 // 2)
        else:
            assert experts.w2_packed.shape == (12, 96, 384 // tp // 2)
            assert experts.w2_scale.shape == (12, 96, 384 // tp // 32)


# ------------------------------------------------------------------------------- full-sequence forward
def full_forward_rank(rank, world_size, config_name):
    config = CONFIGS[config_name]()
    ctx = ParallelContext.create(ParallelConfig(world_size), rank, "cpu")
    out = {}
    for ep in (False, True):
        parallel = dataclasses.replace(ctx, config=ParallelConfig(world_size, enable_expert_parallel=ep))
        model = build_model(config, torch.float32, seed=0, parallel=parallel)
        out[ep] = model(ids_for(config)).numpy()
    return out


@pytest.mark.parametrize("config_name, tp", [("parallel", 2), ("parallel", 3), ("parallel", 4), ("linear", 2)])
def test_full_forward_matches_one_process(ranks, config_name, tp):
    config = CONFIGS[config_name]()
    ref = build_model(config, torch.float32, seed=0)(ids_for(config))
    results = ranks.run(tp, full_forward_rank, config_name)
    for ep in (False, True):
        out = torch.from_numpy(results[0][ep])
        assert out.shape == ref.shape  # the full vocabulary (tp 3 pads 1024 to 1026 and drops the padding)
        assert_fp32_close(out, ref)
        for other in results[1:]:  # every rank got the same all-gathered logits
            assert torch.equal(torch.from_numpy(other[ep]), out)


# ------------------------------------------------------------------------------- checkpoints
class SpySlice:
    def __init__(self, inner, name, reads):
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        t = self.inner[index]
        self.reads.append((self.name, t.numel(), math.prod(self.inner.get_shape())))
        return t


class SpyOpen:
    """safe_open that records every slice read and refuses whole-tensor reads."""

    reads: list = []

    def __init__(self, path, framework):
        self.inner = real_safe_open(path, framework=framework)

    def __enter__(self):
        self.f = self.inner.__enter__()
        return self

    def __exit__(self, *exc):
        return self.inner.__exit__(*exc)

    def keys(self):
        return self.f.keys()

    def get_tensor(self, name):
        raise AssertionError(f"get_tensor({name!r}) reads a whole tensor")

    def get_slice(self, name):
        return SpySlice(self.f.get_slice(name), name, SpyOpen.reads)


@pytest.mark.parametrize("expert_parallel", [False, True])
def test_loading_reads_only_the_ranks_slices(tmp_path, monkeypatch, expert_parallel):
    config = tiny_parallel_config()
    one = build_model(config, torch.float32, seed=1)
    save_checkpoint(one, tmp_path, max_shard_bytes=2_000_000)
    monkeypatch.setattr(loader_module, "safe_open", SpyOpen)
    for rank in range(2):
        SpyOpen.reads = []
        model = build_model(config, torch.float32, seed=None, parallel=rank_context(2, rank, expert_parallel))
        load_weights(model, tmp_path)
        params = dict(model.named_parameters())
        layout = list(checkpoint_layout(model))
        read_names = {name for name, _, _ in SpyOpen.reads}
        assert read_names == {e.name for e in layout if not e.remote}  # every local tensor, no other rank's expert
        sharded = set()
        for e in layout:
            p = params[e.param_name]
            here, full = (p.shape, p.full_shape) if e.expert is None and not e.remote else (p.shape[1:], p.full_shape[1:])
            if math.prod(here) < math.prod(full):
                sharded.add(e.name)
        assert len(sharded) > 50  # heads, MLPs, vocab, TP experts
        for name, numel, total in SpyOpen.reads:
            if name in sharded:
                assert numel < total, f"{name}: read {numel} of {total} values on rank {rank}"
        # what was loaded is the rank's slice of the model that wrote the checkpoint
        reference = build_model(config, torch.float32, seed=1, parallel=rank_context(2, rank, expert_parallel))
        for name, p in reference.named_parameters():
            assert torch.equal(params[name].data, p.data), name


def load_rank(rank, world_size, folder, dtype_name):
    dtype = getattr(torch, dtype_name)
    config = tiny_parallel_config()
    ctx = ParallelContext.create(ParallelConfig(world_size), rank, "cpu")
    random = build_model(config, dtype, seed=2, parallel=ctx)
    loaded = build_model(config, dtype, seed=None, parallel=ctx)
    load_weights(loaded, folder)
    ids = ids_for(config)
    a, b = random(ids), loaded(ids)
    assert torch.equal(a, b)  # the same shard, so the same logits bit for bit
    return b.numpy()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpoint_written_in_one_process_loads_at_tp2(ranks, tmp_path, dtype):
    config = tiny_parallel_config()
    one = build_model(config, dtype, seed=2)
    save_checkpoint(one, tmp_path, max_shard_bytes=2_000_000)
    out = torch.from_numpy(ranks.run(2, load_rank, str(tmp_path), str(dtype).removeprefix("torch."))[0])
    ref = one(ids_for(config))
    if dtype == torch.float32:
        assert_fp32_close(out, ref)
    else:  # bf16 rounds each partial sum before the all-reduce: only finite and the right shape here
        assert out.shape == ref.shape and torch.isfinite(out).all()


def test_save_checkpoint_of_a_shard_is_refused(tmp_path):
    model = build_model(tiny_parallel_config(), torch.float32, seed=None, parallel=rank_context(2, 0))
    with pytest.raises(ValueError, match="save_checkpoint writes a one-process model.*tensor_parallel_size 2"):
        save_checkpoint(model, tmp_path)


# ------------------------------------------------------------------------------- the paged serving forward
DECODES, PAGES = 3, 24


def paged_run(model: KimiForCausalLM, kv_cache_dtype: str, prompts: tuple[int, int]):
    """Prefill two sequences in one batch (a first one over 64 tokens crosses a page), then DECODES steps
    of both, through a pool laid out from the model's per-rank cache config. Returns (logits [2 + 2 * DECODES,
    vocab], the cached latents of every token, block_size)."""
    config = model.config
    layout = CacheLayout.from_config(model.cache_config, kv_cache_dtype, torch.float32)
    pool = PagePool(layout, PAGES)
    n_kda = len(config.kda_layers)
    g = torch.Generator().manual_seed(7)
    seqs = [torch.randint(0, config.vocab_size, (n + DECODES,), generator=g) for n in prompts]
    tables = [torch.tensor([2, 3]), torch.tensor([5])]
    states = [torch.arange(8, 8 + n_kda), torch.arange(8 + n_kda, 8 + 2 * n_kda)]
    pool.zero_state(torch.cat(states))
    chunks, row = [], 0
    for s, n in enumerate(prompts):
        chunks.append(SequenceChunk(row, row + n, 0, tables[s], states[s]))
        row += n
    ids = torch.cat([seq[:n] for seq, n in zip(seqs, prompts)])
    logits = [model.forward_batch(ids, ForwardBatch.build(pool, chunks, "cpu"),
                                  torch.tensor([prompts[0] - 1, sum(prompts) - 1]))]
    for step in range(DECODES):
        chunks = [SequenceChunk(s, s + 1, n + step, tables[s], states[s]) for s, n in enumerate(prompts)]
        ids = torch.stack([seq[n + step] for seq, n in zip(seqs, prompts)])
        logits.append(model.forward_batch(ids, ForwardBatch.build(pool, chunks, "cpu"), torch.arange(2)))
    bs = layout.block_size
    latents = []  # as the cache returns them (equal values <=> equal codes)
    for layer in range(layout.num_mla_layers):
        for seq, table in enumerate(tables):
            pos = torch.arange(prompts[seq] + DECODES)
            latents.append(pool.read_latents(layer, table[pos // bs], pos % bs, torch.float32))
    return torch.cat(logits), torch.cat(latents), bs


def paged_rank(rank, world_size, kv_cache_dtype, expert_parallel, prompts):
    ctx = ParallelContext.create(ParallelConfig(world_size, enable_expert_parallel=expert_parallel), rank, "cpu")
    model = build_model(tiny_parallel_config(), torch.float32, seed=0, parallel=ctx)
    logits, latents, bs = paged_run(model, kv_cache_dtype, prompts)
    return logits.numpy(), latents.numpy(), bs


@pytest.mark.parametrize("tp, kv_cache_dtype, expert_parallel, prompts",
                         [(2, "bf16", False, (70, 13)), (3, "fp8", True, (70, 13)), (2, "bf16", False, (19, 11))])
def test_paged_forward_matches_one_process(ranks, tp, kv_cache_dtype, expert_parallel, prompts):
    """One rank's forward_batch through a pool of its own layout (H / tp KDA heads per state page; MLA
    latents whole): prefill of 2 sequences in one batch, then decodes, equal to the one-process run.

    The cache stores latents as bf16 / fp8 codes, and an fp32 rounding difference upstream can move a
    value across a rounding boundary (measured with prompts of 70 and 13 tokens: 3 of 4272 bf16 codes
    at tp 2, 1 fp8 code at tp 3; none at tp 2 with 19 and 11 tokens, one with 9 and 5): the rows that
    read it then differ by more than fp32 rounding (bf16: up to 2.8e-5 measured; the fp8 step moved
    one row by 1.9e-4). So: a stored latent differs by at most one code step (plus fp32 noise);
    with no code moved every row is within fp32 rounding, else the median row still is and every
    row is within the cache formats' 1e-3 (engine_utils' bound for a flipped code)."""
    one = build_model(tiny_parallel_config(), torch.float32, seed=0)
    ref, ref_latents, one_bs = paged_run(one, kv_cache_dtype, prompts)
    logits, latents, bs = ranks.run(tp, paged_rank, kv_cache_dtype, expert_parallel, prompts)[0]
    logits, latents = torch.from_numpy(logits), torch.from_numpy(latents)
    assert bs % 64 == 0 and bs <= one_bs  # a rank's smaller state page never needs a larger block
    # a moved code is one step of the format away, plus fp32 noise of the row's scale (small values)
    step = {"bf16": 2.0 ** -7, "fp8": 2.0 ** -3}[kv_cache_dtype]
    noise = 1e-5 * ref_latents.pow(2).mean(-1, keepdim=True).sqrt()
    assert ((latents - ref_latents).abs() <= step * ref_latents.abs() + noise).all()
    if torch.equal(latents, ref_latents):
        assert_fp32_close(logits, ref)
    else:
        errors = sorted(rel_rms(a, b) for a, b in zip(logits, ref))
        assert errors[len(errors) // 2] <= ROW_BOUND and errors[-1] <= 1e-3, errors
        assert torch.equal(logits.argmax(-1), ref.argmax(-1))


def test_rank_cache_layout_keeps_the_page_rule():
    """Per rank: a state page holds H / tp KDA heads; block_size stays the smallest multiple of 64 tokens
    whose attention page (whole latents and index keys: not split by TP) holds that state page."""
    config = tiny_parallel_config()
    for tp in (1, 2, 3, 4):
        rank_config = ParallelConfig(tp).cache_config(config)
        assert rank_config.kda_num_heads == 12 // tp and rank_config.kv_latent_dim == config.kv_latent_dim
        model = KimiForCausalLM(config, torch.float32, rank_context(tp, tp - 1)) if tp > 1 else None
        if model is not None:
            assert model.cache_config == rank_config
        for kv in ("bf16", "fp8", "fp4"):
            layout = CacheLayout.from_config(rank_config, kv, torch.float32)
            attention = max(r.offset + r.nbytes for r in layout.latent + layout.index_key + layout.index_scale)
            assert layout.block_size % 64 == 0 and attention >= layout.state_bytes
            assert layout.page_bytes == -(-max(attention, layout.state_bytes) // 16) * 16
            if layout.block_size > 64:  # 64 tokens fewer would not hold the rank's state page
                with pytest.raises(ValueError, match="smaller than a KDA state page"):
                    CacheLayout.from_config(rank_config, kv, torch.float32, block_size=layout.block_size - 64)
            assert PagePool(layout, 2).recurrent.shape == (2, 12 // tp, 8, 8)
    with pytest.raises(ValueError, match=r"KDA heads .* \(12\) is not divisible by tensor_parallel_size \(5\)"):
        ParallelConfig(5).cache_config(config)


# ------------------------------------------------------------------------------- bad layouts
def test_bad_layouts_name_the_size():
    tiny, par = load_preset("tiny"), tiny_parallel_config()
    with pytest.raises(ValueError, match=r"KDA heads .* \(4\) is not divisible by tensor_parallel_size \(3\).*"
                                         r"MLA heads \(num_attention_heads\) \(4\) is not divisible"):
        KimiForCausalLM(tiny, torch.float32, rank_context(3, 0))
    with pytest.raises(ValueError, match=r"MLA heads \(num_attention_heads\) \(12\) is not divisible by "
                                         r"tensor_parallel_size \(5\)"):
        ParallelConfig(5).check_model(par)
    # MXFP4 experts split on the intermediate dim must keep whole 32-value scale groups
    odd = par.replace(moe_intermediate_size=192)  # 96 per rank at tp 2, 64 at tp 3, 48 at tp 4
    ParallelConfig(2).check_model(odd)
    ParallelConfig(3).check_model(odd)
    with pytest.raises(ValueError, match=r"MXFP4 routed experts .* moe_intermediate_size / tp = 192 / 4 = 48 is not "
                                         r"a multiple of 32"):
        ParallelConfig(4).check_model(odd)
    with pytest.raises(ValueError, match="192 / 4 = 48"):
        KimiForCausalLM(odd, torch.float32, rank_context(4, 1))
    ParallelConfig(4, enable_expert_parallel=True).check_model(odd)  # whole experts: nothing is cut
    ParallelConfig(4).check_model(odd.replace(routed_experts_mxfp4=False))  # bf16 experts split anywhere
    with pytest.raises(ValueError, match=r"routed experts \(num_experts, with enable_expert_parallel\) \(12\) is not "
                                         r"divisible by tensor_parallel_size \(8\)"):
        ParallelConfig(8, enable_expert_parallel=True).check_model(par.replace(kda_num_heads=16, num_attention_heads=16,
                                                                                 intermediate_size=256,
                                                                                 routed_expert_hidden_size=128))


@pytest.mark.parametrize("tokens", [1, 9, 300])  # the per-pair, every-expert and loop forms
def test_expert_parallel_shards_sum_to_the_one_process_experts(tokens):
    """With expert parallelism each rank returns its own experts' contribution (any placement, here a
    permutation); the contributions sum to the one-process routed experts' output. No collective: the
    sum is what `combine_expert_outputs` computes over the TP group."""
    from kimiserve.distributed.expert_parallel import ExpertPlacement
    from kimiserve.model.moe import RoutedExperts

    config = tiny_parallel_config()
    one = build_model(config, torch.float32, seed=4).model.layers[1].block_sparse_moe.experts
    g = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, config.moe_hidden_size, generator=g)
    ids = torch.stack([torch.randperm(12, generator=g)[:2] for _ in range(tokens)])
    weights = torch.rand(tokens, 2, generator=g)
    placement = ExpertPlacement.from_permutation(torch.randperm(12, generator=g).tolist(), 3)
    total = torch.zeros_like(x)
    for rank in range(3):
        experts = RoutedExperts(config, torch.float32, rank_context(3, rank, True), placement)
        assert experts.expert_ids == placement.local_experts(rank)
        for name, p in experts.named_parameters():
            p.data.copy_(getattr(one, name).data[torch.tensor(experts.expert_ids)])
        total += experts(x, ids, weights)
    torch.testing.assert_close(total, one(x, ids, weights), rtol=1e-5, atol=1e-6)
