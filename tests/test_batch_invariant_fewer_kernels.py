"""`glue.FEWER_KERNELS` on the CPU: the projections of one input as one invariant product over their
row-stacked weights (`InvariantForward.projections`). The CPU's tree sum is per output element, so the
stacked products give each projection its own bits: the invariant engine with the switch on == off bit
for bit (base rows and LoRA rows in one batch), the trainer (autograd into the weights: a differentiable
cat of the same values) == the engine, the parameters are row views of the stacked weights (no second
copy) and a weight sync that copies into them reaches the next step. The GPU's bits (other tiles for the
stacked shapes) are `test_batch_invariant_fewer_kernels_interpret.py`'s."""

import torch

from engine_utils import make_engine, random_prompts, run
from test_cuda_graphs import eager_graphs  # noqa: F401 (the fixture)
from kimiserve.lora import LoRAAdapter
from kimiserve.ops.batch_invariant import glue
from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.rl.weight_sync import sync_weights
from kimiserve.sampling_params import SamplingParams

PROMPTS = random_prompts([21, 4, 13, 40], seed=3)
PARAMS = [SamplingParams(temperature=1.0, seed=s, max_tokens=5, logprobs=0, ignore_eos=True) for s in range(4)]


def lps(out) -> torch.Tensor:
    return torch.tensor([lp.logprob for lp in out.outputs[0].logprobs])


def engine(**kw):
    return make_engine(dtype="bfloat16", batch_invariant=True, max_model_len=256, num_pages=100, **kw)


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid].outputs[0].token_ids == b[rid].outputs[0].token_ids, rid
        assert torch.equal(lps(a[rid]), lps(b[rid])), rid


def test_stacked_projections_keep_the_cpu_bits_the_trainer_agrees_and_weight_syncs_reach_them(monkeypatch):
    off = engine(max_num_batched_tokens=16)
    want = run(off, PROMPTS, PARAMS)
    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    e = engine(max_num_batched_tokens=16)
    got = run(e, PROMPTS, PARAMS)
    assert_same(got, want)
    # the parameters are row views of one stacked weight per group (KDA layer 1, MLA layer 4, a MoE, the dense MLP)
    layers = e.model.model.layers
    kda, mla = layers[0].self_attn, layers[3].self_attn
    groups = [(kda.q_proj, kda.k_proj, kda.v_proj, kda.b_proj, kda.g_proj, kda.f_a_proj),
              (kda.q_conv1d, kda.k_conv1d, kda.v_conv1d),
              (mla.q_b_proj, mla.indexer.wq_b),
              (*mla.input_projections(), mla.g_proj, mla.indexer.weights_proj),
              (layers[1].block_sparse_moe.routed_expert_down_proj, layers[1].block_sparse_moe.shared_experts.gate_proj,
               layers[1].block_sparse_moe.shared_experts.up_proj),
              (layers[0].mlp.gate_proj, layers[0].mlp.up_proj)]
    for group in groups:
        ptr = group[0].weight.data_ptr()
        for m in group:
            assert m.weight.data_ptr() == ptr, [type(x).__name__ for x in group]
            ptr += m.weight.numel() * m.weight.element_size()
    # the trainer with autograd into every weight: the engine's bits, and gradients into the stacked groups' weights
    trainer = PolicyTrainer.from_engine(e)
    trainable = trainer.trainable_parameters()
    completions = [got[f"r{i}"].outputs[0].token_ids for i in range(4)]
    for i, lp in enumerate(trainer.logprobs(PROMPTS, completions)):
        assert torch.equal(lp.detach(), lps(got[f"r{i}"])), i
    sum(lp.sum() for lp in trainer.logprobs(PROMPTS, completions)).backward()
    grads = [p.grad for p in trainable if p.grad is not None]
    assert len(grads) > 0.9 * len(trainable) and all(torch.isfinite(g).all() for g in grads)
    t_kda = trainer.model.model.layers[0].self_attn
    assert all(m.weight.grad is not None and m.weight.grad.abs().sum() > 0 for m in (t_kda.q_proj, t_kda.v_proj, t_kda.g_proj))
    # a weight sync copies into the parameters: the stacked weights see it, as the separate products do
    g = torch.Generator().manual_seed(7)
    new = {n: (p.detach().float() + 0.05 * torch.randn(p.shape, generator=g)).to(p.dtype)
           for n, p in e.model.named_parameters()
           if n.endswith(("self_attn.k_proj.weight", "self_attn.kv_a_proj_with_mqa.weight", "shared_experts.up_proj.weight",
                          "self_attn.v_conv1d.weight"))}
    assert len(new) >= 4
    sync_weights(e, new)
    monkeypatch.setattr(glue, "FEWER_KERNELS", False)
    sync_weights(off, new)
    want = run(off, PROMPTS, PARAMS, ids=[f"s{i}" for i in range(4)])
    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    after = run(e, PROMPTS, PARAMS, ids=[f"s{i}" for i in range(4)])
    assert_same(after, want)
    assert not torch.equal(lps(after["s0"]), lps(got["r0"]))


def test_residual_epilogue_keeps_the_cpu_bits_and_the_trainer_agrees(monkeypatch):
    """`glue.RESIDUAL_EPILOGUE` (with `FEWER_KERNELS`; on the CPU a product's add is the separate add, but the
    MoE's sum is (residual + routed) + shared: other bits): a sequence alone == in a chunked batch, the trainer
    with autograd through the epilogues == the engine, with gradients."""
    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    monkeypatch.setattr(glue, "RESIDUAL_EPILOGUE", True)
    e = engine(max_num_batched_tokens=16)
    got = run(e, PROMPTS, PARAMS)
    alone = run(engine(), PROMPTS[:1], PARAMS[0])
    assert_same(alone, {"r0": got["r0"]})
    trainer = PolicyTrainer.from_engine(e)
    trainer.trainable_parameters()  # requires grad
    completions = [got[f"r{i}"].outputs[0].token_ids for i in range(4)]
    lps_t = trainer.logprobs(PROMPTS, completions)
    for i, lp in enumerate(lps_t):
        assert torch.equal(lp.detach(), lps(got[f"r{i}"])), i
    sum(lp.sum() for lp in lps_t).backward()
    layer = trainer.model.model.layers[1]
    for m in (layer.self_attn.o_proj, layer.block_sparse_moe.routed_expert_up_proj, layer.block_sparse_moe.shared_experts.down_proj):
        assert m.weight.grad is not None and torch.isfinite(m.weight.grad).all() and m.weight.grad.abs().sum() > 0


def lora_batch(monkeypatch, stacked: bool, epilogue: bool = False) -> dict:
    """An adapter's rows and base rows in one chunked batch; asserts the trainer's logprobs == the engine's."""
    monkeypatch.setattr(glue, "FEWER_KERNELS", stacked)
    monkeypatch.setattr(glue, "RESIDUAL_EPILOGUE", epilogue)
    e = make_engine(dtype="bfloat16", batch_invariant=True, enable_lora=True, max_model_len=256, num_pages=100,
                    max_num_batched_tokens=16)
    adapter = LoRAAdapter.init(e.model, "a", rank=4, random_b=True, seed=1)
    e.load_lora_adapter("a", adapter)
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=5, logprobs=0, ignore_eos=True)
    names = ["a", None, "a"]
    for i, (p, n) in enumerate(zip(PROMPTS, names)):
        e.add_request(f"x{i}", p, params, lora_name=n)
    outs = {}
    while e.has_unfinished_requests():
        outs.update({o.request_id: o for o in e.step() if o.finished})
    trainer = PolicyTrainer.from_engine(e)
    with torch.no_grad():
        for i, (p, n) in enumerate(zip(PROMPTS, names)):
            completion = outs[f"x{i}"].outputs[0].token_ids
            lora = adapter.batch_for(len(p) + len(completion)) if n else None
            got = trainer.logprobs([p], [completion], lora=lora)[0]
            assert torch.equal(got, lps(outs[f"x{i}"])), (stacked, i)
    return outs


def test_stacked_projections_with_lora_rows_in_the_batch(monkeypatch):
    """Adapter rows and base rows in one batch: the stacked form's bits == the separate form's (the CPU), and
    in both the trainer's LoRA logprobs == the engine's."""
    assert_same(lora_batch(monkeypatch, True), lora_batch(monkeypatch, False))
    lora_batch(monkeypatch, True, epilogue=True)  # the adapter's delta after the epilogue: other bits, engine == trainer


def test_invariant_decode_graphs_with_fewer_kernels(eager_graphs, monkeypatch):  # noqa: F811
    """The invariant decode graphs (CPU emulation: warm-up, then replays of the recorded step) with both switches
    on: a padded graph batch == alone == eager == the trainer (`test_cuda_graphs`' check)."""
    import test_cuda_graphs

    monkeypatch.setattr(glue, "FEWER_KERNELS", True)
    monkeypatch.setattr(glue, "RESIDUAL_EPILOGUE", True)
    test_cuda_graphs.test_batch_invariant_decode_graphs_give_the_eager_bits(eager_graphs)


def test_stack_columns_views_only_slices_of_one_storage():
    """`_stack_columns` returns a view for adjacent column slices of one result, and stacks separate tensors
    even when they lie back to back in memory (the CUDA caching allocator places them so; here three
    tensors over one buffer, each with a storage of its own: session 7's H200 failure)."""
    from kimiserve.rl.forward import _stack_columns

    N, P = 1, 6
    whole = torch.arange(N * 3 * P, dtype=torch.float32).view(N, 3 * P)
    parts = list(whole.split(P, dim=1))
    with torch.no_grad():
        view = _stack_columns(parts)
    assert view.data_ptr() == whole.data_ptr() and torch.equal(view, torch.stack(parts, 1))
    buffer = memoryview(bytearray(whole.numpy().tobytes()))
    size = P * 4
    apart = [torch.frombuffer(buffer[i * size:(i + 1) * size], dtype=torch.float32).view(N, P) for i in range(3)]
    assert apart[1].data_ptr() == apart[0].data_ptr() + size  # back to back, separate storages
    with torch.no_grad():
        stacked = _stack_columns(apart)
    assert torch.equal(stacked, torch.stack(apart, 1))
