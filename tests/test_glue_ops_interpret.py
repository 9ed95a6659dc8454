"""The decode step's glue kernels (RMSNorm, residual add + attention-residual read + RMSNorm, the router's
selection, SiTU) under Triton's CPU interpreter (no GPU needed), and the tiny engine running them.

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_glue_ops_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

import glue_ops_cases as cases  # noqa: E402
from kimiserve.ops.activation import triton as activation_tt  # noqa: E402
from kimiserve.ops.attn_res import triton as attn_res_tt  # noqa: E402
from kimiserve.ops.mla import head_matmul_triton  # noqa: E402
from kimiserve.ops.moe import route_triton  # noqa: E402
from kimiserve.ops.norm import triton as norm_tt  # noqa: E402


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden", cases.RMS_CASES)
def test_rms_norm(rows, hidden, dtype):
    cases.check_rms_norm(norm_tt.rms_norm, "cpu", dtype, rows, hidden, seed=rows + hidden)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 128), (17, 200)])
def test_layer_norm(rows, hidden, dtype):
    cases.check_layer_norm(norm_tt.layer_norm, "cpu", dtype, rows, hidden, seed=rows)


def test_rms_norm_fp32_weight_on_bf16():
    cases.check_rms_norm(norm_tt.rms_norm, "cpu", torch.bfloat16, 3, 200, weight_dtype=torch.float32)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden, blocks, add, one_buffer", cases.ARN_CASES)
def test_add_read_norm(rows, hidden, blocks, add, one_buffer, dtype):
    cases.check_add_read_norm(attn_res_tt.add_read_norm, "cpu", dtype, rows, hidden, blocks, add, one_buffer,
                              seed=rows * 7 + blocks)


@pytest.mark.parametrize("case", cases.ROUTE_CASES)
def test_route(case):
    cases.check_route(route_triton.route, "cpu", *case, seed=case[0] + case[1])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, width, linear_beta", cases.SITU_CASES)
def test_situ_and_mul(rows, width, linear_beta, dtype):
    cases.check_situ(activation_tt.situ_and_mul, "cpu", dtype, rows, width, linear_beta, seed=rows)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, width, gated, o_fp32, strided_gate", cases.GATE_OUTPUT_CASES)
def test_gate_output(rows, width, gated, o_fp32, strided_gate, dtype):
    cases.check_gate_output(activation_tt.gate_output, "cpu", dtype, rows, width, gated, o_fp32, strided_gate, seed=rows)


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, heads, head_dim, latent", cases.HEAD_MATMUL_CASES)
def test_head_matmul(rows, heads, head_dim, latent, dtype):
    cases.check_head_matmul(head_matmul_triton.head_matmul, "cpu", dtype, rows, heads, head_dim, latent, seed=rows)


def test_engine_with_glue_kernels_matches_reference_ops():
    """The tiny engine (attention residuals, latent MoE, MLA and KDA layers) with the glue kernels and the
    prefill kernels (`backend.prefill_kernels`, the CUDA default: KDA's short conv and gated norm, the
    query-tiled index scan, sparse MLA rounding in the kernel): the reference-ops engine's greedy tokens,
    and its logits at every step within fp32 rounding."""
    import dataclasses

    from engine_utils import assert_ops_match_reference_ops, random_prompts
    from kimiserve.ops.backend import REFERENCE_OPS, fused_glue_ops, prefill_kernels

    ops = dataclasses.replace(prefill_kernels(fused_glue_ops(REFERENCE_OPS)), name="glue-kernels-interpreted")
    assert_ops_match_reference_ops(ops, "bf16", random_prompts([40, 90, 7], seed=5))


def test_engine_with_fewer_kernel_ops_matches_reference_ops():
    """The tiny engine with `backend.fewer_kernel_ops` (stacked projections, addmm and the Triton output gate of
    MLA's decode rows) gives the reference-ops engine's tokens, logits up to near-tie selections."""
    import dataclasses

    from engine_utils import assert_ops_match_up_to_ties, random_prompts
    from kimiserve.ops.backend import REFERENCE_OPS, fewer_kernel_ops

    ops, gated = fewer_kernel_ops(REFERENCE_OPS), []
    assert ops.gate_output is activation_tt.gate_output
    counted = lambda o, gate, dtype: gated.append(gate is not None) or activation_tt.gate_output(o, gate, dtype)  # noqa: E731
    assert_ops_match_up_to_ties(dataclasses.replace(ops, gate_output=counted), random_prompts([40, 90, 7], seed=6))
    assert len(gated) >= 10 and all(gated)  # the tiny MLA layers' decode rows, with their output gate


def test_cases_outside_the_kernels_run_the_references():
    """Shapes the kernels do not take (a broadcast weight or addend, fp64) give the references' results."""
    from kimiserve.ops.attn_res import reference as attn_res_ref
    from kimiserve.ops.norm import reference as norm_ref

    x = torch.randn(3, 40)
    w1 = torch.tensor([1.5])
    assert torch.equal(norm_tt.rms_norm(x, w1, 1e-5), norm_ref.rms_norm(x, w1, 1e-5))
    assert torch.equal(norm_tt.rms_norm(x.double(), w1.double(), 1e-5), norm_ref.rms_norm(x.double(), w1.double(), 1e-5))
    running, addend, w = torch.randn(1, 3, 40), torch.randn(1, 1, 40), torch.randn(40)
    blocks = [torch.randn(1, 3, 40)]
    got = attn_res_tt.add_read_norm(running, addend, blocks, w, w[None], w, 1e-5)
    want = attn_res_ref.add_read_norm(running, addend, blocks, w, w[None], w, 1e-5)
    assert got[1].shape == (1, 3, 40) and torch.equal(got[1], running + addend)
    assert torch.equal(got[0], want[0])


@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("tokens, heads, dim", cases.GATED_NORM_CASES)
def test_gated_rms_norm(tokens, heads, dim, dtype):
    cases.check_gated_rms_norm(norm_tt.gated_rms_norm, "cpu", dtype, tokens, heads, dim, seed=tokens)
