"""Smoke checks of the Triton top-k kernels under Triton's CPU interpreter (no GPU needed).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run them in their own process (the variable turns on
TRITON_INTERPRET before the kernels are defined, which a process that already imported them misses):

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_triton_topk_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from test_triton_topk import check_topk, make_scores  # noqa: E402

# block 256 puts several programs on a row at small S; the others force the other histogram / slot paths
TUNINGS = [dict(block=256), dict(block=256, window=32, sparse=4, group=4, cap=16), dict(block=512, group=2, cap=1)]


@pytest.mark.parametrize("tuning", TUNINGS)
@pytest.mark.parametrize("kind", ["randn", "few", "equal", "ninf", "wide", "narrow", "relu", "zeros_inf", "ramp"])
@pytest.mark.parametrize("S, k", [(1, 1), (7, 8), (7, 3), (700, 1), (1500, 8), (1500, 300), (2049, 2048)])
def test_small(kind, S, k, tuning):
    check_topk(make_scores(kind, 3, S, "cpu"), k, **tuning)


@pytest.mark.parametrize("kind", ["randn", "few", "ninf"])
def test_lengths(kind):
    lens = torch.tensor([0, 1, 7, 299, 300, 301, 1200, 1500, 1600])
    scores = make_scores(kind, len(lens), 1500, "cpu")
    check_topk(scores, 300, lens, block=256)
    check_topk(scores, 300, lens.int(), block=256)


def test_default_block_and_strided():
    big = torch.randn(2, 9000)
    check_topk(big[:, 1 : 1 + 8200], 2048)  # two programs of 4096, row stride 9000
    check_topk(big[:, :100], 2048)
