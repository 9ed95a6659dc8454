"""Split-K in the batch-invariant matmul (`ops.batch_invariant.triton.split_k`, off unless
`SPLIT_K_PROGRAMS` > 0), under Triton's CPU interpreter or on CUDA:

- the chunks are a function of the weight's shape alone;
- the kernel's sum is the fixed order (each chunk from zero, the chunk sums added in chunk order):
  under the interpreter (ordered tl.dot) bit for bit that order computed in torch, on CUDA close to fp64;
- a row's bits are the same alone or among others, whether the chunks run in programs of their own
  (fp32 partials added by a second kernel) or all in one program per tile;
- the tiny engine with split-K on every linear: a sequence alone == in a batch, engine == trainer.

The small-K cases run on small tiles (`SMALL_TILES`) on CUDA too: with the real tiles a K of a few hundred
is one chunk (`split_k` wants at least `SPLIT_K_MIN_STEPS` BK steps a chunk).

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_split_k_interpret.py -q
"""

import pytest
import torch
import torch.nn.functional as F

import triton_interpreter_shims
from triton_interpreter_shims import ordered_dots_when_interpreted  # noqa: F401 (an autouse fixture)

DEVICE = triton_interpreter_shims.device_or_skip_module()
INTERPRET = DEVICE == "cpu"

from kimiserve.ops.batch_invariant import triton as bi_triton  # noqa: E402

SMALL_TILES = {"BM": 64, "BN": 32, "BK": 16, "num_warps": 4, "num_stages": 3}


@pytest.fixture
def split(monkeypatch):
    """Split-K at 64 programs, with tiles small enough that K of a few hundred makes several chunks."""
    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 64)
    monkeypatch.setattr(bi_triton, "tile_config", lambda N, K: SMALL_TILES)


def chunked_order(x: torch.Tensor, w: torch.Tensor, chunk_k: int) -> torch.Tensor:
    """x @ w.T in fp32 in the kernel's order under ordered dots: per chunk of `chunk_k` columns, from zero,
    one product and add per k in increasing k; the chunk sums added in chunk order from zero."""
    xf, wf = x.float(), w.float()
    total = torch.zeros(x.shape[0], w.shape[0])
    for k0 in range(0, x.shape[1], chunk_k):
        acc = torch.zeros_like(total)
        for k in range(k0, min(k0 + chunk_k, x.shape[1])):
            acc = acc + xf[:, k : k + 1] * wf[:, k][None, :]
        total = total + acc
    return total


def test_split_k_chunks_are_a_function_of_the_weight_shape(monkeypatch):
    c = {"BM": 64, "BN": 128, "BK": 64, "num_warps": 8, "num_stages": 4}
    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 0)
    assert bi_triton.split_k(7168, 12288, c) == (1, 192)  # off at 0
    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 264)
    for N, K in [(12288, 7168), (7168, 12288), (6144, 7168), (3584, 7168), (1536, 7168), (96, 7168), (33792, 7168),
                 (18432, 1536), (4096, 1536), (512, 128), (16, 100)]:
        chunks, chunk = bi_triton.split_k(N, K, c)
        steps = -(-K // c["BK"])
        assert 1 <= chunks <= bi_triton.SPLIT_K_MAX and -(-steps // chunk) == chunks
        if chunks > 1:
            assert chunk >= bi_triton.SPLIT_K_MIN_STEPS
            assert -(-N // c["BN"]) * chunks <= 264  # at most the target
    assert bi_triton.split_k(33792, 7168, c) == (1, 112)  # 264 tiles already
    assert bi_triton.split_k(18432, 1536, c) == (1, 24)  # 144 tiles: a second chunk would pass the target
    assert bi_triton.split_k(12288, 7168, c) == (2, 56)
    assert bi_triton.split_k(96, 7168, c)[0] == bi_triton.SPLIT_K_MAX


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("M,K,N,nested", [(70, 200, 40, False), (3, 161, 33, False), (70, 200, 40, True)])
def test_split_k_matmul_is_the_chunked_order_and_rows_do_not_depend_on_the_batch(split, monkeypatch, dtype, M, K, N,
                                                                                 nested):
    monkeypatch.setattr(bi_triton, "SPLIT_K_NESTED", nested)
    c = bi_triton.tile_config(N, K)
    chunks, chunk = bi_triton.split_k(N, K, c)
    assert chunks > 1
    g = torch.Generator().manual_seed(K + N)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(M, K, generator=g).to(dtype).to(DEVICE)
    y = bi_triton.matmul(x, w, spread=False)  # every chunk of a tile in one program
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-4, atol=1e-4)
    if INTERPRET:
        assert torch.equal(y, chunked_order(x, w, chunk * c["BK"]))
    monkeypatch.setattr(bi_triton, "SPLIT_K_NESTED", not nested)  # the other loop form: the same bits
    for spread in (True, False):
        assert torch.equal(bi_triton.matmul(x, w, spread=spread), y), spread
    monkeypatch.setattr(bi_triton, "SPLIT_K_NESTED", nested)
    assert torch.equal(bi_triton.matmul(x, w, spread=True), y)  # one program per chunk, partials summed
    assert torch.equal(bi_triton.matmul(x, w), y)
    for lo, hi in [(0, 1), (M - 1, M), (1, M)]:
        for spread in (True, False):
            assert torch.equal(bi_triton.matmul(x[lo:hi], w, spread=spread), y[lo:hi]), (lo, hi, spread)
    others = torch.randn(2 * M + 11, K, generator=g).to(dtype).to(DEVICE)
    others[::3] = float("nan")
    mixed = torch.cat([others[: M + 5], x, others[M + 5 :]])
    assert torch.equal(bi_triton.matmul(mixed, w, spread=True)[M + 5 : 2 * M + 5], y)
    assert torch.equal(bi_triton.matmul(torch.stack([x, x], 1)[:, 1], w, spread=True), y)  # strided rows
    assert torch.equal(bi_triton.matmul(x, w, out_dtype=dtype, spread=True), y.to(dtype))  # rounded once


def test_split_k_batched_matmul_is_each_batch_alone(split):
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 3, 170, generator=g).to(torch.bfloat16).to(DEVICE)  # [N, H, K] as the MLA heads
    w = torch.randn(3, 21, 170, generator=g).to(torch.bfloat16).to(DEVICE)
    assert bi_triton.split_k(21, 170, bi_triton.tile_config(21, 170))[0] > 1
    for spread in (True, False):
        y = bi_triton.matmul(x.transpose(0, 1), w, spread=spread)
        for h in range(3):
            assert torch.equal(y[h], bi_triton.matmul(x[:, h].contiguous(), w[h], spread=not spread))


@pytest.mark.skipif(INTERPRET, reason="real widths: CUDA only")
@pytest.mark.parametrize("N,K", [(12288, 7168), (1536, 7168), (96, 7168), (16, 7168)])
def test_split_k_rows_alone_equal_rows_among_2048_on_cuda(monkeypatch, N, K):
    """The `small` preset's shapes: a decode row (chunks spread over programs) == the same row in a
    prefill of 2,048 rows (every chunk of a tile in one program), bf16 and the fp32 router."""
    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 264)
    monkeypatch.setattr(bi_triton, "SPLIT_K_NESTED", False)
    dtype = torch.float32 if N == 16 else torch.bfloat16
    g = torch.Generator().manual_seed(N)
    w = torch.randn(N, K, generator=g).to(dtype).to(DEVICE)
    x = torch.randn(2048, K, generator=g).to(dtype).to(DEVICE)
    assert bi_triton.split_k(N, K, bi_triton.tile_config(N, K))[0] > 1
    big = bi_triton.matmul(x, w, spread=False)
    for M in (1, 4, 64):
        assert torch.equal(bi_triton.matmul(x[:M], w), big[:M]), M
    monkeypatch.setattr(bi_triton, "SPLIT_K_NESTED", True)  # the other loop form of the chunks: the same bits
    assert torch.equal(bi_triton.matmul(x, w, spread=False), big)
    assert torch.equal(bi_triton.matmul(x[:4], w), big[:4])
    torch.testing.assert_close(big[:64], F.linear(x[:64].double(), w.double()).float(), rtol=1e-3, atol=1e-2)


def test_invariant_engine_with_split_k_is_batch_invariant_and_equals_the_trainer(monkeypatch):
    """The tiny model (bf16 weights) in batch-invariant mode, every op on its Triton form and every linear
    of more than one K step split along K, with 16-row tiles and 2 "SMs": a weight of one column tile
    spreads its chunks over programs for the engine's rows (decode rows, prefill chunks of 8) and runs them
    in one program for the trainer's 26 packed rows: alone == in a batch, engine == trainer."""
    import test_batch_invariant_triton_interpret as base

    tiles = {"BM": 16, "BN": 32, "BK": 32, "num_warps": 4, "num_stages": 3}
    monkeypatch.setattr(bi_triton, "tile_config", lambda N, K: tiles)
    monkeypatch.setitem(bi_triton.CONFIG, "BM", 16)  # the grouped matmul's plan tiles rows by it
    monkeypatch.setattr(bi_triton, "SPLIT_K_PROGRAMS", 256)
    monkeypatch.setattr(bi_triton, "SPLIT_K_MIN_STEPS", 1)
    monkeypatch.setattr(bi_triton, "_sm_count", lambda device: 2)
    forms: dict[tuple, set] = {}
    matmul = bi_triton.matmul

    def recorded(x, w, out_dtype=torch.float32, spread=None):
        plan = bi_triton.matmul_plan(x.shape[0] if x.dim() == 3 else 1, x.shape[-2], *w.shape[-2:], x.device, spread)
        if plan.chunks > 1:
            forms.setdefault(tuple(w.shape), set()).add(plan.spread)
        return matmul(x, w, out_dtype, spread)

    monkeypatch.setattr(bi_triton, "matmul", recorded)
    base.check_engine_alone_batched_and_trainer(monkeypatch, [11, 3, 6], seed=3, max_tokens=2)  # 11 > index_topk 8
    assert any(len(f) == 2 for f in forms.values()), forms  # some weights ran in both forms
