"""The KDA verify path of speculative decoding has a decode step's numerics, bit for bit: verify outputs
and the state the replay leaves equal decoding the same tokens one step at a time (reference ops on
the CPU; the fused Triton kernel on CUDA; the interpreter run is test_spec_verify_kda_interpret.py)."""

import pytest
import torch

from kimiserve.ops.backend import REFERENCE_OPS, select_decode_ops
from spec_verify_cases import check_verify_matches_decode


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_verify_matches_decode_reference_ops(dtype, lower_bound):
    check_verify_matches_decode(REFERENCE_OPS, "cpu", dtype, lower_bound=lower_bound)
    check_verify_matches_decode(REFERENCE_OPS, "cpu", dtype, lengths=(6, 6), accepted=(6, 4), seed=1,
                                lower_bound=lower_bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_slots_match_decode_reference_ops(dtype):
    """The per-position slot path (`kda_verify_slot_ops`: the reference loop on the CPU) and its commit by copy."""
    from kimiserve.ops.backend import kda_verify_slot_ops

    ops = kda_verify_slot_ops(REFERENCE_OPS)
    check_verify_matches_decode(ops, "cpu", dtype, slots=True)
    check_verify_matches_decode(ops, "cpu", dtype, lengths=(6, 6, 2), accepted=(6, 4, 1), seed=1, lower_bound=None,
                                slots=True)


def test_chunked_form_verify_is_caught(monkeypatch):
    """The check can fail: a verify path through the chunked form (the same maths, summed in another
    order; what a prefill chunk runs) gives other bits than the decode step."""
    from kimiserve.model.kda import KimiDeltaAttention
    from kimiserve.ops.kda.reference import kda_gate
    from kimiserve.ops.norm.reference import gated_rms_norm

    def chunked_verify(self, q, k, v, f, b, gate, batch, o):
        i, grid = self.cache_index, batch.verify_grid
        xs = tuple(t[0][grid] for t in (q, k, v, f, b, gate))
        batch.verify_inputs[i] = tuple(x.transpose(0, 1) for x in xs[:5])  # position-major, as the layer keeps them
        pages = batch.verify_state_pages[:, i]
        B, T = grid.shape
        g = kda_gate(xs[3].view(B, T, self.num_heads, -1), self.A_log, self.dt_bias, self.lower_bound)
        out, _, _ = self.mix(*xs[:3], g, torch.sigmoid(xs[4].float()), batch.pool.conv[pages],
                             batch.pool.recurrent[pages])
        o[0, grid] = gated_rms_norm(out, xs[5].view(B, T, self.num_heads, -1), self.o_norm.weight, self.eps)

    monkeypatch.setattr(KimiDeltaAttention, "verify_steps", chunked_verify)
    with pytest.raises(AssertionError, match="verify outputs differ"):
        check_verify_matches_decode(REFERENCE_OPS, "cpu", torch.float32, lengths=(6, 6), accepted=(6, 4))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the fused Triton decode kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_matches_decode_cuda(dtype):
    check_verify_matches_decode(select_decode_ops(torch.device("cuda")), "cuda", dtype)
    check_verify_matches_decode(select_decode_ops(torch.device("cuda")), "cuda", dtype, lengths=(6, 6, 2),
                                accepted=(6, 4, 1), seed=2, lower_bound=None)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the one-launch Triton verify kernel)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_slots_match_decode_cuda(dtype):
    from kimiserve.ops.backend import kda_verify_slot_ops

    ops = kda_verify_slot_ops(select_decode_ops(torch.device("cuda")))
    check_verify_matches_decode(ops, "cuda", dtype, slots=True)
    check_verify_matches_decode(ops, "cuda", dtype, lengths=(6, 6, 2), accepted=(6, 4, 1), seed=2, lower_bound=None,
                                slots=True)
