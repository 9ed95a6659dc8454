"""The fused KDA decode step (`ops/kda/triton_decode.py`) on CUDA against the reference composition,
and the reference against the layer's own ops (on the CPU)."""

import pytest
import torch

from kda_decode_step_cases import CASES, SPLIT_CASES, check_decode_step, nan_filled_empty
from kimiserve.ops.kda import paged


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound", CASES + [(64, 12, 128, 4, -5.0)])
def test_kernel_matches_reference(rows, H, K, W, lower_bound, dtype):
    from kimiserve.ops.kda import triton_decode

    check_decode_step(triton_decode.kda_decode_step, "cuda", dtype, rows, H, K, W, lower_bound, seed=rows + K)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound, block_v", SPLIT_CASES + [
    (64, 12, 128, 4, -5.0, 32), (64, 12, 128, 4, None, 64), (8, 96, 128, 4, -5.0, 32), (5, 4, 40, 2, None, 128)])
def test_split_form_matches_reference(rows, H, K, W, lower_bound, block_v, dtype, monkeypatch):
    """The V-split form against the reference and the single kernel, its allocations NaN-filled."""
    import functools

    from kimiserve.ops.kda import triton_decode

    nan_filled_empty(monkeypatch)
    split = functools.partial(triton_decode.kda_decode_step, block_v=block_v)
    single = functools.partial(triton_decode.kda_decode_step, block_v=None)
    check_decode_step(split, "cuda", dtype, rows, H, K, W, lower_bound, seed=rows * 17 + K, same_as=single)


@pytest.mark.parametrize("rows, H, K, W, lower_bound", CASES[:2])
def test_reference_is_the_layers_recurrent_form(rows, H, K, W, lower_bound):
    """The reference step equals one step of the full-sequence recurrent form from the same states."""
    from kimiserve.ops.conv.reference import causal_conv1d
    from kimiserve.ops.kda.reference import kda_gate, recurrent_kda
    from kimiserve.ops.norm.reference import gated_rms_norm, l2_normalize

    def with_recurrent(q, k, v, f, b, gate, w, conv, states, page_ids):
        x = lambda t: t.unsqueeze(1)  # noqa: E731
        outs = [causal_conv1d(x(t), wt, conv[page_ids, j]) for j, (t, wt) in enumerate(
            ((q, w.q_conv), (k, w.k_conv), (v, w.v_conv)))]
        hq, hk, hv = (o.view(rows, 1, H, K) for o, _ in outs)
        g = kda_gate(x(f).view(rows, 1, H, K), w.A_log, w.dt_bias, w.lower_bound)
        o, s = recurrent_kda(l2_normalize(hq), l2_normalize(hk), hv, g, torch.sigmoid(x(b).float()),
                             initial_state=states[page_ids])
        states[page_ids] = s
        conv[page_ids] = torch.stack([c for _, c in outs], dim=1)
        return gated_rms_norm(o[:, 0], gate.view(rows, H, K), w.norm_weight, w.eps)

    check_decode_step(with_recurrent, "cpu", torch.float32, rows, H, K, W, lower_bound)
    assert paged.kda_decode_step is not None
