"""KDA's prefill short conv kernel (`ops.conv.triton.short_conv`) against the reference on CUDA, at the
interpreter's sizes and the `small` preset's widths (96 heads x 128, an 8192-token chunk)."""

import pytest
import torch

from short_conv_cases import check_short_conv

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T, heads, head_dim", [(1, 3, 24), (2, 3, 24), (37, 3, 24), (8192, 96, 128), (1000, 96, 128)])
def test_matches_reference(T, heads, head_dim, dtype):
    check_short_conv(T, heads=heads, head_dim=head_dim, dtype=dtype, device="cuda")


def test_no_state_and_batch_of_two():
    check_short_conv(5, heads=2, head_dim=16, dtype=torch.bfloat16, device="cuda", state=False)
    check_short_conv(9, heads=2, head_dim=16, dtype=torch.float32, device="cuda", batch=2)
