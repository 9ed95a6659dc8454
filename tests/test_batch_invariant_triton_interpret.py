"""The Triton batch-invariant matmul under Triton's CPU interpreter (no GPU needed), and on CUDA.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (or CUDA is present); run in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_batch_invariant_triton_interpret.py -q
"""

import os

import pytest
import torch
import torch.nn.functional as F

INTERPRET = os.environ.get("KIMISERVE_TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 (or run on CUDA) for the Triton batch-invariant matmul",
                allow_module_level=True)
if INTERPRET:
    import triton_interpreter_shims  # noqa: E402

    triton_interpreter_shims.enable()

from kimiserve.ops.batch_invariant import triton as bi_triton  # noqa: E402

DEVICE = "cpu" if INTERPRET else "cuda"


@pytest.mark.parametrize("K,N", [(64, 96), (37, 5), (160, 130)])
def test_rows_do_not_depend_on_the_batch(K, N):
    g = torch.Generator().manual_seed(K)
    w = torch.randn(N, K, generator=g).to(DEVICE)
    x = torch.randn(70, K, generator=g).to(DEVICE)
    y = bi_triton.matmul(x, w)
    torch.testing.assert_close(y, F.linear(x.double(), w.double()).float(), rtol=1e-5, atol=1e-5)
    for lo, hi in ((0, 1), (5, 6), (31, 33), (3, 40), (69, 70), (0, 70)):
        assert torch.equal(bi_triton.matmul(x[lo:hi], w), y[lo:hi])
    assert torch.equal(bi_triton.matmul(torch.stack([x, x], 1)[:, 1], w), y)  # strided rows
    poisoned = torch.full((70, N), float("nan"), device=DEVICE)
    assert torch.isfinite(bi_triton.matmul(x, w)).all() and not torch.isfinite(poisoned).any()
