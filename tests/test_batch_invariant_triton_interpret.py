"""The Triton batch-invariant kernels under Triton's CPU interpreter (no GPU needed), and on CUDA.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_triton_interpret.py -q

Under the interpreter tl.dot runs as a fixed per-element order of products and adds
(`triton_interpreter_shims.ordered_dots`: numpy's BLAS is not row-invariant inside a tile); on CUDA the
same tests check the tensor cores themselves.
"""

import contextlib
import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("KIMISERVE_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 (or run on CUDA) for the Triton batch-invariant kernels",
                allow_module_level=True)
if INTERPRET:
    import triton_interpreter_shims  # noqa: E402

    triton_interpreter_shims.enable()

from kimiserve.ops.batch_invariant import triton as bi_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.fixture(autouse=True)
def ordered_dots():
    with triton_interpreter_shims.ordered_dots() if INTERPRET else contextlib.nullcontext():
        yield


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
