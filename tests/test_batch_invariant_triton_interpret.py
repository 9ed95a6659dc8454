"""The Triton batch-invariant kernels under Triton's CPU interpreter (no GPU needed), and on CUDA.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_triton_interpret.py -q

Under the interpreter tl.dot runs as a fixed per-element order of products and adds
(`triton_interpreter_shims.ordered_dots`: numpy's BLAS is not row-invariant inside a tile); on CUDA the
same tests check the tensor cores themselves.
"""

import pytest
import torch
import torch.nn.functional as F

import triton_interpreter_shims
from triton_interpreter_shims import ordered_dots_when_interpreted  # noqa: F401 (an autouse fixture)

DEVICE = triton_interpreter_shims.device_or_skip_module()
INTERPRET = DEVICE == "cpu"

from kimiserve.ops.batch_invariant import triton as bi_triton  # noqa: E402


def rows_subsets(M: int):
    """Row ranges that put rows at other places in their tiles and give other M."""
    bm = bi_triton.CONFIG["BM"]
    return [(0, 1), (5, 6), (bm - 1, bm + 2), (3, M - 7), (M - 1, M), (1, M), (0, M)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K,N", [(150, 200, 130), (70, 37, 5), (3, 64, 129)])
def test_matmul_matches_fp64_and_rows_do_not_depend_on_the_batch(dtype, M, K, N):
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    y = bi_triton.matmul(x, w)
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    for lo, hi in rows_subsets(M):
        if lo < hi <= M:
            assert torch.equal(bi_triton.matmul(x[lo:hi], w), y[lo:hi]), (lo, hi)
    perm = torch.randperm(M, generator=g).to(DEVICE)
    assert torch.equal(bi_triton.matmul(x[perm], w), y[perm])
    others = torch.randn(2 * M + 11, K, generator=g).to(dtype).to(DEVICE)
    others[::3] = float("nan")  # other rows, even NaN ones, leave a row's bits alone
    mixed = torch.cat([others[: M + 5], x, others[M + 5 :]])
    assert torch.equal(bi_triton.matmul(mixed, w)[M + 5 : 2 * M + 5], y)
    assert torch.equal(bi_triton.matmul(torch.stack([x, x], 1)[:, 1], w), y)  # strided rows
    assert torch.equal(bi_triton.matmul(x, w, out_dtype=dtype), y.to(dtype))  # rounded once, as .to()


TILE_CANDIDATES = [{"BM": 64, "BN": 32, "BK": 64, "num_warps": 4, "num_stages": 4},
                   {"BM": 64, "BN": 64, "BK": 128, "num_warps": 4, "num_stages": 4},
                   {"BM": 64, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 3}]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("config", [bi_triton.CONFIG, *(c for _, c in bi_triton.NARROW_CONFIGS), *TILE_CANDIDATES])
def test_every_tile_config_keeps_rows_independent_of_the_batch(monkeypatch, config, dtype):
    """Whatever tiles a weight's shape gets (`tile_config`, never a function of M), a row's bits are
    the same alone, among other rows, at another place in its tile, and through the grouped matmul."""
    assert config["BM"] == bi_triton.CONFIG["BM"]  # the device-side expert plan tiles rows by BM
    monkeypatch.setattr(bi_triton, "tile_config", lambda N, K: config)
    g = torch.Generator().manual_seed(5)
    M, K, N = 70, 200, 40
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    y = bi_triton.matmul(x, w)
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    for lo, hi in [(0, 1), (5, 6), (63, 66), (1, M)]:
        assert torch.equal(bi_triton.matmul(x[lo:hi], w), y[lo:hi]), (lo, hi)
    groups = torch.randint(0, 2, (M,), generator=g).to(DEVICE)
    stacked = torch.stack([w, w.flip(0)])
    grouped = bi_triton.grouped_matmul(x, stacked, bi_triton.TilePlan.of(groups, 2))
    for e in range(2):
        rows = torch.nonzero(groups == e)[:, 0]
        assert torch.equal(grouped[rows], bi_triton.matmul(x[rows], stacked[e]))


def test_matmul_mixed_dtypes_run_in_fp32_and_empty_shapes():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(33, 70, generator=g).to(DEVICE)
    x = torch.randn(9, 70, generator=g).to(torch.bfloat16).to(DEVICE)
    y = bi_triton.matmul(x, w)
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    assert torch.equal(bi_triton.matmul(x[4:5], w), y[4:5])
    assert bi_triton.matmul(x[:0], w).shape == (0, 33)
    with pytest.raises(ValueError, match="matmul needs"):
        bi_triton.matmul(x, w[:, :5])


def test_batched_matmul_is_each_batch_alone():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(67, 3, 40, generator=g).to(torch.bfloat16).to(DEVICE)  # [N, H, K] as the MLA heads
    w = torch.randn(3, 21, 40, generator=g).to(torch.bfloat16).to(DEVICE)
    y = bi_triton.matmul(x.transpose(0, 1), w)  # strided [H, N, K]
    for h in range(3):
        assert torch.equal(y[h], bi_triton.matmul(x[:, h].contiguous(), w[h]))
    assert torch.equal(bi_triton.matmul(x[30:31].transpose(0, 1), w), y[:, 30:31])
    with pytest.raises(ValueError, match="matmul needs"):
        bi_triton.matmul(x.transpose(0, 1), w[:2])


def _kda_inputs(N, H, K, V, g):
    from kimiserve.ops.batch_invariant import reference as bi

    q = bi.l2_normalize(torch.randn(N, H, K, generator=g))
    k = bi.l2_normalize(torch.randn(N, H, K, generator=g))
    v = torch.randn(N, H, V, generator=g)
    gate = -torch.rand(N, H, K, generator=g) * 0.5
    beta = torch.rand(N, H, generator=g)
    return [t.to(DEVICE) for t in (q, k, v, gate, beta)]


def test_kda_recurrence_matches_the_steps_and_a_segment_alone_or_chunked():
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.ops.batch_invariant import triton_kda

    g = torch.Generator().manual_seed(2)
    H, K, V = 2, 24, 40  # V spans two column blocks, K is padded to 32
    lengths = torch.tensor([9, 1, 14])
    starts = torch.tensor([0, 9, 10])
    N = int(lengths.sum())
    q, k, v, gate, beta = _kda_inputs(N, H, K, V, g)
    state = torch.randn(3, H, K, V, generator=g).to(DEVICE) * 0.1
    snap_t = torch.tensor([8, -1, 5])
    dev = lambda *ts: [t.to(DEVICE) for t in ts]  # noqa: E731
    o, final, snaps = triton_kda.recurrence(q, k, v, gate, beta, state, *dev(starts, lengths, snap_t), K ** -0.5)
    ro, rfinal, rsnaps = bi._kda_recurrence_steps(q, k, v, gate, beta, state, *dev(starts, lengths, snap_t), K ** -0.5)
    torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, rfinal, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snaps, rsnaps, rtol=1e-5, atol=1e-5)
    assert torch.equal(snaps[1], torch.zeros_like(snaps[1]))
    # segment 2 alone, then in two chunks (5 + 9 tokens) with the fp32 state carried: the same bits
    rows = slice(10, 24)
    one = lambda *a: [t.to(DEVICE) for t in (torch.tensor([0]), torch.tensor([a[0]]), torch.tensor([a[1]]))]  # noqa: E731
    alone_o, alone_final, _ = triton_kda.recurrence(q[rows], k[rows], v[rows], gate[rows], beta[rows], state[2:3],
                                                    *one(14, -1), K ** -0.5)
    assert torch.equal(alone_o, o[rows]) and torch.equal(alone_final, final[2:3])
    first = slice(10, 15)
    o1, s1, _ = triton_kda.recurrence(q[first], k[first], v[first], gate[first], beta[first], state[2:3],
                                      *one(5, -1), K ** -0.5)
    assert torch.equal(s1, snaps[2:3])  # the state before token 5 is the state after 5 tokens
    second = slice(15, 24)
    o2, s2, _ = triton_kda.recurrence(q[second], k[second], v[second], gate[second], beta[second], s1,
                                      *one(9, -1), K ** -0.5)
    assert torch.equal(torch.cat([o1, o2]), o[rows]) and torch.equal(s2, final[2:3])
    for t in range(14):  # token by token, as decode steps
        ot, st, _ = triton_kda.recurrence(q[10 + t : 11 + t], k[10 + t : 11 + t], v[10 + t : 11 + t],
                                          gate[10 + t : 11 + t], beta[10 + t : 11 + t], state[2:3] if t == 0 else st,
                                          *one(1, -1), K ** -0.5)
        assert torch.equal(ot, o[10 + t : 11 + t])


def test_kda_recurrence_backward_is_the_steps_gradient():
    from kimiserve.ops.batch_invariant import reference as bi

    g = torch.Generator().manual_seed(5)
    H, K, V = 1, 8, 8
    inputs = [t.requires_grad_(True) for t in _kda_inputs(7, H, K, V, g)]
    state = (torch.randn(2, H, K, V, generator=g).to(DEVICE) * 0.1).requires_grad_(True)
    seg = [torch.tensor(x).to(DEVICE) for x in ([0, 4], [4, 3], [2, -1])]
    o, final, _ = bi._KDARecurrence.apply(*inputs, state, *seg, K ** -0.5)
    ro, rfinal, _ = bi._kda_recurrence_steps(*inputs, state, *seg, K ** -0.5)
    w1, w2 = torch.randn_like(o), torch.randn_like(final)
    got = torch.autograd.grad((o * w1).sum() + (final * w2).sum(), [*inputs, state])
    want = torch.autograd.grad((ro * w1).sum() + (rfinal * w2).sum(), [*inputs, state])
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _flat_contexts(g, lengths, width):
    """Flat buffer of sequences' contexts and, per query row (every position of every sequence), its base and length."""
    flat = torch.randn(sum(lengths), width, generator=g)
    starts = torch.tensor([0] + lengths[:-1]).cumsum(0)
    base = torch.cat([torch.full((n,), int(s)) for s, n in zip(starts, lengths)])
    lens = torch.cat([torch.arange(1, n + 1) for n in lengths])
    return flat, base, lens


def test_latent_attention_kernel_matches_torch_and_rows_do_not_depend_on_the_batch():
    from kimiserve.ops.batch_invariant import attention, triton_attention

    g = torch.Generator().manual_seed(6)
    H, L, R = 20, 56, 16  # two head blocks, L padded to 64, the width 72 in two column chunks
    flat, base, lens = _flat_contexts(g, [70, 9, 40], L + R)
    flat = flat.to(torch.bfloat16).float()
    G = len(base)
    q = torch.randn(G, H, L + R, generator=g)
    listed = torch.stack([torch.randperm(80, generator=g)[:50] for _ in range(G)]) % lens.unsqueeze(1)
    listed = torch.sort(listed, -1).values
    count = torch.clamp(lens, max=50)
    listed = torch.where(torch.arange(50) < count.unsqueeze(1), listed, 10_000)  # sentinels past the count
    q, flat, base, lens, listed, count = (t.to(DEVICE) for t in (q, flat, base, lens, listed, count))
    out = triton_attention.sparse_latent_attention(q, flat, base, listed, count, 0.1, L)
    ref = attention._attention_torch(q.to(torch.bfloat16).float(), flat, base, listed, count, 0.1, L)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)  # probabilities are bf16 operands
    for rows in (slice(5, 6), slice(69, 75), slice(0, G)):
        assert torch.equal(triton_attention.sparse_latent_attention(q[rows], flat, base[rows], listed[rows], count[rows],
                                                                   0.1, L), out[rows])
    # the row in another flat buffer (other sequences before it) with a wider padded list
    shift = 13
    flat2 = torch.cat([torch.randn(shift, L + R, generator=g).to(DEVICE), flat])
    wide = torch.cat([listed, torch.full((G, 40), 7, device=DEVICE)], 1)
    assert torch.equal(triton_attention.sparse_latent_attention(q, flat2, base + shift, wide, count, 0.1, L), out)


def test_indexer_kernel_matches_torch_and_topk_lists_do_not_depend_on_the_batch():
    from kimiserve.ops.batch_invariant import attention, triton_attention

    g = torch.Generator().manual_seed(7)
    Hi, D = 5, 24
    keys, base, lens = _flat_contexts(g, [90, 3, 33], D)
    keys = keys.to(torch.bfloat16).float()
    G = len(base)
    iq = torch.randn(G, Hi, D, generator=g).to(torch.bfloat16)
    iw = torch.randn(G, Hi, generator=g)
    iq, iw, keys, base, lens = (t.to(DEVICE) for t in (iq, iw, keys, base, lens))
    S = int(lens.max())
    scores = triton_attention.indexer_scores(iq, iw, keys, base, lens, S)
    ctx = torch.minimum(torch.arange(S, device=DEVICE).unsqueeze(0), (lens - 1).unsqueeze(1))
    picked = keys[base.unsqueeze(1) + ctx]  # [G, S, D]
    want = (torch.einsum("ghd,gsd->gsh", iq.float(), picked).relu() * iw.unsqueeze(1)).sum(-1)
    want = want.masked_fill(torch.arange(S, device=DEVICE) >= lens.unsqueeze(1), float("-inf"))
    torch.testing.assert_close(scores, want, rtol=1e-4, atol=1e-4)
    listed, count = attention._listed_cuda(triton_attention, iq, iw, keys, base, lens, 16, S)
    assert torch.equal(count, torch.clamp(lens, max=16))
    for r in (0, 40, 89, 92, 125):
        top = torch.sort(torch.topk(scores[r, : lens[r]], int(count[r])).indices).values
        assert torch.equal(listed[r, : count[r]], top)
    for rows in (slice(89, 90), slice(93, 126)):  # alone or with others: the same scores and lists
        Sr = int(lens[rows].max())
        assert torch.equal(triton_attention.indexer_scores(iq[rows], iw[rows], keys, base[rows], lens[rows], Sr),
                           scores[rows, :Sr])
        sub, sub_count = attention._listed_cuda(triton_attention, iq[rows], iw[rows], keys, base[rows], lens[rows], 16, Sr)
        assert torch.equal(sub_count, count[rows])
        for j in range(sub.shape[0]):
            n = int(sub_count[j])
            assert torch.equal(sub[j, :n], listed[rows][j, :n])


def test_latent_attention_backward_is_the_torch_gradient():
    from kimiserve.ops.batch_invariant import attention

    g = torch.Generator().manual_seed(8)
    H, L, R = 3, 16, 16
    flat, base, lens = _flat_contexts(g, [6, 4], L + R)
    G = len(base)
    q = torch.randn(G, H, L + R, generator=g).to(DEVICE).requires_grad_(True)
    flat = flat.to(DEVICE).requires_grad_(True)
    listed = torch.arange(6).expand(G, 6).contiguous().to(DEVICE)
    base, lens = base.to(DEVICE), lens.to(DEVICE)
    out = attention._LatentAttention.apply(q, flat, base, listed, lens, 0.3, L)
    ref = attention._attention_torch(q, flat, base, listed, lens, 0.3, L)
    w = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * w).sum(), (q, flat)), torch.autograd.grad((ref * w).sum(), (q, flat))):
        torch.testing.assert_close(a, b)


def check_engine_alone_batched_and_trainer(monkeypatch, lengths: list[int], seed: int, max_tokens: int) -> None:
    """The tiny model (bf16 weights) in batch-invariant mode with every op on its Triton form, prompts of
    `lengths`: the first alone == in a batch of all of them prefilled in chunks of 8, and the trainer's
    logprobs == the engine's (torch.equal)."""
    from engine_utils import random_prompts, run
    from kimiserve.engine.args import EngineArgs
    from kimiserve.engine.engine import LLMEngine
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.rl.trainer import PolicyTrainer
    from kimiserve.sampling_params import SamplingParams

    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda x: True)
    make = lambda **k: LLMEngine(EngineArgs(model="tiny", dtype="bfloat16", device=DEVICE, max_model_len=256,  # noqa: E731
                                            num_pages=64, batch_invariant=True, **k))
    prompts = random_prompts(lengths, seed=seed)
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=max_tokens, logprobs=0, ignore_eos=True)
              for s in range(len(prompts))]
    e = make(max_num_batched_tokens=8)
    outs = run(e, prompts, params)
    alone = run(make(), [prompts[0]], params[0])["r0"]
    lp = lambda o: torch.tensor([x.logprob for x in o.outputs[0].logprobs])  # noqa: E731
    assert alone.outputs[0].token_ids == outs["r0"].outputs[0].token_ids
    assert torch.equal(lp(alone), lp(outs["r0"]))
    with torch.no_grad():
        lps = PolicyTrainer.from_engine(e).logprobs(prompts, [outs[f"r{i}"].outputs[0].token_ids
                                                              for i in range(len(prompts))])
    for i, got in enumerate(lps):
        assert torch.equal(got.cpu(), lp(outs[f"r{i}"]))


def test_invariant_engine_on_the_kernels_is_batch_invariant_and_equals_the_trainer(monkeypatch):
    """`check_engine_alone_batched_and_trainer` on the kernels as they are."""
    check_engine_alone_batched_and_trainer(monkeypatch, [21, 4, 13], seed=2, max_tokens=3)  # 21 > the tiny index_topk (8): the sparse path


@pytest.mark.parametrize("dtype,wdtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                          (torch.float32, torch.float32)])
def test_rms_norm_kernels_match_the_torch_forms_and_rows_do_not_depend_on_the_batch(dtype, wdtype):
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.ops.batch_invariant import triton_norm

    g = torch.Generator().manual_seed(9)
    x = (torch.randn(37, 300, generator=g) * 3).to(dtype).to(DEVICE)
    w = torch.randn(300, generator=g).to(wdtype).to(DEVICE)
    gate = torch.randn(37, 300, generator=g).to(dtype).to(DEVICE)
    for got, want, fn in ((triton_norm.rms_norm(x, w, 1e-5), bi._rms_norm_torch(x, w, 1e-5),
                           lambda r: triton_norm.rms_norm(x[r], w, 1e-5)),
                          (triton_norm.rms_norm(x, w, 1e-5, gate), bi._gated_rms_norm_torch(x, gate, w, 1e-5),
                           lambda r: triton_norm.rms_norm(x[r], w, 1e-5, gate[r]))):
        assert got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
        for rows in (slice(0, 1), slice(20, 21), slice(3, 30)):
            assert torch.equal(fn(rows), got[rows])
    xs = torch.stack([x, x], 1)[:, 1]  # strided rows, and [N, H, K] shapes as the KDA output norm
    assert torch.equal(triton_norm.rms_norm(xs, w, 1e-5), triton_norm.rms_norm(x, w, 1e-5))
    x3 = x.view(37, 3, 100)
    assert torch.equal(triton_norm.rms_norm(x3, w[:100], 1e-5).view(37, 300)[5:6],
                       triton_norm.rms_norm(x3[5:6], w[:100], 1e-5).view(1, 300))


def test_rms_norm_backward_is_the_torch_gradient():
    from kimiserve.ops.batch_invariant import reference as bi

    g = torch.Generator().manual_seed(10)
    x = torch.randn(5, 40, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(40, generator=g).to(DEVICE).requires_grad_(True)
    gate = torch.randn(5, 40, generator=g).to(DEVICE).requires_grad_(True)
    for out, ref, leaves in ((bi._Norm.apply(x, w, None, 1e-5), bi._rms_norm_torch(x, w, 1e-5), (x, w)),
                             (bi._Norm.apply(x, w, gate, 1e-5), bi._gated_rms_norm_torch(x, gate, w, 1e-5), (x, w, gate))):
        c = torch.randn_like(out)
        for a, b in zip(torch.autograd.grad((out * c).sum(), leaves), torch.autograd.grad((ref * c).sum(), leaves)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_glue_kernels_match_the_torch_forms_and_rows_do_not_depend_on_the_batch(monkeypatch, dtype):
    """The serving path's SiTU and read + norm kernels as the invariant forward's GPU forms: close to the
    torch (tree) forms, and each row's bits the same alone, in other batches and at other places."""
    from kimiserve.ops.batch_invariant import reference as bi

    monkeypatch.setattr(bi, "on_triton", lambda x: True)
    g = torch.Generator().manual_seed(11)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)  # noqa: E731
    N, D, inter = 29, 200, 333
    gate, up = rnd(N, inter, scale=3), rnd(N, inter, scale=3)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    got = bi.situ_and_mul(gate, up, 4.0, 25.0)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), bi._situ_and_mul_torch(gate, up, 4.0, 25.0).float(), rtol=tol, atol=tol)
    for rows in (slice(0, 1), slice(17, 18), slice(2, 27)):
        assert torch.equal(bi.situ_and_mul(gate[rows], up[rows], 4.0, 25.0), got[rows])
    running, rn, rp, nw = rnd(N, D), rnd(D), rnd(1, D), rnd(D)
    for n_blocks in (0, 1, 3):
        blocks = [rnd(N, D) for _ in range(n_blocks)]
        out = bi.read_norm(running, blocks, rn, rp, nw, 1e-5)
        want = bi._read_norm_torch(running, blocks, rn, rp, nw, 1e-5)
        assert out.dtype == dtype and not out.isnan().any()
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
        for rows in (slice(0, 1), slice(17, 18), slice(2, 27)):
            assert torch.equal(bi.read_norm(running[rows], [b[rows] for b in blocks], rn, rp, nw, 1e-5), out[rows])


def test_glue_kernels_backward_is_the_torch_gradient(monkeypatch):
    from kimiserve.ops.batch_invariant import reference as bi

    monkeypatch.setattr(bi, "on_triton", lambda x: True)
    g = torch.Generator().manual_seed(12)
    leaf = lambda *shape: torch.randn(*shape, generator=g).to(DEVICE).requires_grad_(True)  # noqa: E731
    gate, up = leaf(6, 50), leaf(6, 50)
    out, ref = bi.situ_and_mul(gate, up, 4.0, 25.0), bi._situ_and_mul_torch(gate, up, 4.0, 25.0)
    c = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * c).sum(), (gate, up)), torch.autograd.grad((ref * c).sum(), (gate, up))):
        torch.testing.assert_close(a, b)
    running, rn, rp, nw, blocks = leaf(6, 40), leaf(40), leaf(1, 40), leaf(40), [leaf(6, 40), leaf(6, 40)]
    leaves = (running, rn, rp, nw, *blocks)
    out, ref = bi.read_norm(running, blocks, rn, rp, nw, 1e-5), bi._read_norm_torch(running, blocks, rn, rp, nw, 1e-5)
    c = torch.randn_like(out)
    for a, b in zip(torch.autograd.grad((out * c).sum(), leaves), torch.autograd.grad((ref * c).sum(), leaves)):
        torch.testing.assert_close(a, b)
    out = bi.read_norm(running, [], None, None, nw, 1e-5)  # no blocks: the norm alone
    ref = bi._read_norm_torch(running, [], None, None, nw, 1e-5)
    for a, b in zip(torch.autograd.grad(out.sum(), (running, nw)), torch.autograd.grad(ref.sum(), (running, nw))):
        torch.testing.assert_close(a, b)


def test_mxfp4_matmul_is_the_matmul_of_the_dequantised_weight(monkeypatch):
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(11)
    N, K = 70, 160  # K: two full 64-column steps and a half one (scale groups of 32)
    packed, scales = quantize_mxfp4(torch.randn(N, K, generator=g))
    scales[0, 0], scales[1, 1] = 0, 3  # the subnormal 2^-127 and a tiny power of two
    packed, scales = packed.to(DEVICE), scales.to(DEVICE)
    x = torch.randn(67, K, generator=g).to(torch.bfloat16).to(DEVICE)
    w = dequantize_mxfp4(packed, scales, torch.bfloat16)
    y = bi_triton.matmul_mxfp4(x, packed, scales)
    if INTERPRET:  # the same bf16 tiles in the same order
        assert torch.equal(y, bi_triton.matmul(x, w))
    torch.testing.assert_close(y, bi_triton.matmul(x, w), rtol=1e-5, atol=1e-5)
    for rows in (slice(0, 1), slice(64, 67), slice(9, 40)):
        assert torch.equal(bi_triton.matmul_mxfp4(x[rows], packed, scales), y[rows])
    with pytest.raises(ValueError, match="matmul_mxfp4 needs"):
        bi_triton.matmul_mxfp4(x[:, :64], packed, scales)
    # through the invariant linear (the experts' path): the kernel forward, x's gradient
    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    xg = x[:5].clone().requires_grad_(True)
    out = bi.linear(xg, bi.MXFP4Weight(packed, scales, torch.bfloat16))
    assert torch.equal(out, y[:5].to(torch.bfloat16))
    (gx,) = torch.autograd.grad(out.float().sum(), xg)
    torch.testing.assert_close(gx.float(), w.float().sum(0).expand(5, K).to(torch.bfloat16).float())


@pytest.mark.parametrize("D", [4, 37, 2048, 5000])
def test_row_sum_matches_fp64_and_rows_do_not_depend_on_the_batch(D):
    from kimiserve.ops.batch_invariant import triton_norm

    g = torch.Generator().manual_seed(D)
    R = max(3, 20000 // D)  # several row tiles
    x = torch.randn(R, D, generator=g).to(DEVICE)
    s = triton_norm.row_sum(x)
    torch.testing.assert_close(s, x.double().sum(-1).float(), rtol=1e-5, atol=1e-4)
    for rows in (slice(0, 1), slice(R - 1, R), slice(1, R - 1)):
        assert torch.equal(triton_norm.row_sum(x[rows]), s[rows])
    assert torch.equal(triton_norm.row_sum(x.T.contiguous().T), s)  # strided input
    assert triton_norm.row_sum(x.to(torch.bfloat16)).dtype == torch.bfloat16


def test_tree_sum_on_the_triton_form_and_its_backward(monkeypatch):
    from kimiserve.ops.batch_invariant import reference as bi

    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    g = torch.Generator().manual_seed(12)
    x = torch.randn(6, 5, 7, generator=g).to(DEVICE).requires_grad_(True)
    for dim, keepdim in ((-1, False), (1, True), (0, False)):
        s = bi.tree_sum(x, dim, keepdim)
        torch.testing.assert_close(s, x.sum(dim, keepdim=keepdim), rtol=1e-5, atol=1e-5)
        w = torch.randn_like(s)
        (got,) = torch.autograd.grad((s * w).sum(), x)
        (want,) = torch.autograd.grad((x.sum(dim, keepdim=keepdim) * w).sum(), x)
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("mxfp4", [False, True])
def test_grouped_matmul_gives_each_row_the_matmul_of_its_group(mxfp4):
    from kimiserve.ops.batch_invariant import reference as bi
    from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4

    g = torch.Generator().manual_seed(13)
    E, N, K, M = 4, 40, 96, 150
    if mxfp4:
        packed, scales = quantize_mxfp4(torch.randn(E, N, K, generator=g))
        weights = (packed.to(DEVICE), scales.to(DEVICE))
        dense = dequantize_mxfp4(*weights, torch.bfloat16)
    else:
        dense = torch.randn(E, N, K, generator=g).to(torch.bfloat16).to(DEVICE)
        weights = dense
    x = torch.randn(M, K, generator=g).to(torch.bfloat16).to(DEVICE)
    groups = torch.randint(0, E, (M,), generator=g)
    groups[:80] = 2  # one group over two row tiles
    groups[100] = -1
    plan = bi_triton.TilePlan.of(groups.to(DEVICE), E)
    y = bi_triton.grouped_matmul(x, weights, plan)
    for e in range(E):
        rows = torch.nonzero(groups == e)[:, 0].to(DEVICE)
        assert torch.equal(y[rows], bi_triton.matmul(x[rows], dense[e]))
    assert torch.equal(y[100], torch.zeros(N, device=DEVICE))
    sub = bi_triton.TilePlan.of(groups[90:97].to(DEVICE), E)  # other rows, other tiles: the same bits
    assert torch.equal(bi_triton.grouped_matmul(x[90:97], weights, sub), y[90:97])
    one = bi_triton.TilePlan.of(groups[100:101].to(DEVICE), E)  # only a row of no group: zeros, no tile used
    assert torch.equal(bi_triton.grouped_matmul(x[100:101], weights, one), torch.zeros(1, N, device=DEVICE))


@pytest.mark.parametrize("M,G", [(1, 16), (16, 16), (150, 4), (130, 1), (7, 3)])
def test_tile_plan_covers_each_group_in_tiles_of_one_group(M, G):
    """The device-side plan: every row of a group in exactly one used tile of that group (at most BM
    rows, consecutive in `order`), rows of no group in none, the unused tiles empty."""
    g = torch.Generator().manual_seed(M * 31 + G)
    groups = torch.randint(-1, G, (M,), generator=g)
    plan = bi_triton.TilePlan.of(groups.to(DEVICE), G)
    bm = bi_triton.CONFIG["BM"]
    assert plan.tile_group.shape[0] == -(-M // bm) + min(G, M)
    seen = []
    order = plan.order.cpu()
    for t, s, e in zip(plan.tile_group.tolist(), plan.tile_start.tolist(), plan.tile_end.tolist()):
        assert 0 <= e - s <= bm
        rows = order[s:e]
        assert (groups[rows] == t).all()
        seen += rows.tolist()
    assert sorted(seen) == torch.nonzero(groups >= 0)[:, 0].tolist()
    assert [sorted(r.tolist()) for _, r in plan.host_groups()] == [
        torch.nonzero(groups == e)[:, 0].tolist() for e in range(G) if (groups == e).any()]


def test_expert_linear_forward_is_the_grouped_matmul_and_its_backward_the_plain_gradient(monkeypatch):
    from kimiserve.ops.batch_invariant import reference as bi

    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    g = torch.Generator().manual_seed(14)
    w = torch.randn(3, 20, 48, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_(True)
    x = torch.randn(30, 48, generator=g).to(torch.bfloat16).to(DEVICE).requires_grad_(True)
    groups = torch.randint(0, 3, (30,), generator=g).to(DEVICE)
    plan = bi.group_rows(x, groups, 3)
    assert isinstance(plan, bi_triton.TilePlan)
    y = bi.expert_linear(x, plan, w)
    assert torch.equal(y, bi_triton.grouped_matmul(x, w, plan).to(torch.bfloat16))
    c = torch.randn(30, 20, generator=g).to(DEVICE)
    gx, gw = torch.autograd.grad((y.float() * c).sum(), (x, w))
    ref = torch.einsum("nk,nok->no", x.float(), w.float()[groups])
    rx, rw = torch.autograd.grad((ref * c).sum(), (x, w))
    torch.testing.assert_close(gx.float(), rx.float(), rtol=2e-2, atol=6e-2)  # bf16 gradients
    torch.testing.assert_close(gw.float(), rw.float(), rtol=2e-2, atol=6e-2)


def test_lora_batch_on_the_grouped_kernel_matches_the_reference_and_each_adapter_alone(monkeypatch):
    """LoRA rows on the Triton path (A and B as one device-planned grouped launch each): close to the
    per-adapter reference, and each row's bits those of its adapter's rows alone; experts by (adapter, expert)."""
    from kimiserve.config import load_preset
    from kimiserve.lora import LoRAAdapter, LoRABatch, lora_reference
    from kimiserve.model.model import build_model
    from kimiserve.ops.batch_invariant import reference as bi

    if INTERPRET:
        monkeypatch.setattr(bi, "on_triton", lambda t: True)
    model = build_model(load_preset("tiny"), torch.bfloat16).to(DEVICE)
    a = LoRAAdapter.init(model, "a", rank=4, random_b=True, seed=1)
    b = LoRAAdapter.init(model, "b", rank=8, random_b=True, seed=2)
    name = "model.layers.1.self_attn.q_proj"
    weight = model.get_submodule(name).weight
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, weight.shape[1], generator=g).to(torch.bfloat16).to(DEVICE)
    slots = torch.tensor([0, -1, 1, 1, 0, -1, -1, 1, 0, 0, 1]).to(DEVICE)
    batch = LoRABatch([a, b], slots)
    assert isinstance(bi.group_rows(x, slots, 3), bi_triton.TilePlan)
    got = batch.apply(name, x, bi.linear(x, weight))
    torch.testing.assert_close(got.float(), lora_reference(x.float(), weight.float(), [a, b], slots, name), rtol=3e-2, atol=3e-2)
    for slot, adapter in ((0, a), (1, b)):
        rows = torch.nonzero(slots == slot)[:, 0]
        alone = LoRABatch([adapter], torch.zeros(len(rows), dtype=torch.int64, device=DEVICE))
        assert torch.equal(alone.apply(name, x[rows], bi.linear(x[rows], weight)), got[rows])
    assert torch.equal(got[slots == -1], bi.linear(x, weight)[slots == -1])
    key = next(iter(a.expert_weights))
    E = a.expert_weights[key][0].shape[0]
    experts = torch.randint(0, E, (11,), generator=g).to(DEVICE)
    inp = a.expert_weights[key][0].shape[-1]
    xs = torch.randn(11, inp, generator=g).to(torch.bfloat16).to(DEVICE)
    base = torch.zeros(11, a.expert_weights[key][1].shape[-2], dtype=torch.bfloat16, device=DEVICE)
    both = batch.apply_experts(key, xs, experts, slots, base)
    for slot, adapter in ((0, a), (1, b)):
        rows = torch.nonzero(slots == slot)[:, 0]
        alone = LoRABatch([adapter], torch.zeros(len(rows), dtype=torch.int64, device=DEVICE))
        assert torch.equal(alone.apply_experts(key, xs[rows], experts[rows], alone.row_slot, base[rows]), both[rows])
        A, B = adapter.expert_weights[key]
        want = torch.einsum("nr,nor->no", torch.einsum("nk,nrk->nr", xs[rows].float(), A.float()[experts[rows]]),
                            B.float()[experts[rows]]) * adapter.scaling
        torch.testing.assert_close(both[rows].float(), want, rtol=5e-2, atol=5e-2)
