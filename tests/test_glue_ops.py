"""The decode step's glue kernels on CUDA against their references (the cases of glue_ops_cases.py at
the interpreter's sizes and the `small` preset's widths), and the serving forward's use of them (CPU)."""

import pytest
import torch

import glue_ops_cases as cases

gpu = pytest.mark.gpu


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden", cases.RMS_CASES + [(64, 7168), (64, 1536), (300, 512)])
def test_rms_norm(rows, hidden, dtype):
    from kimiserve.ops.norm import triton as norm_tt

    cases.check_rms_norm(norm_tt.rms_norm, "cuda", dtype, rows, hidden, seed=rows + hidden)


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden", [(1, 128), (17, 200), (64, 128), (300, 7168)])
def test_layer_norm(rows, hidden, dtype):
    from kimiserve.ops.norm import triton as norm_tt

    cases.check_layer_norm(norm_tt.layer_norm, "cuda", dtype, rows, hidden, seed=rows)


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, hidden, blocks, add, one_buffer", cases.ARN_CASES + [(64, 7168, 9, True, True)])
def test_add_read_norm(rows, hidden, blocks, add, one_buffer, dtype):
    from kimiserve.ops.attn_res import triton as attn_res_tt

    cases.check_add_read_norm(attn_res_tt.add_read_norm, "cuda", dtype, rows, hidden, blocks, add, one_buffer,
                              seed=rows * 7 + blocks)


@gpu
@pytest.mark.parametrize("case", cases.ROUTE_CASES + [(64, 896, 16, 1, 1, "sigmoid", True, True, 1.0)])
def test_route(case):
    from kimiserve.ops.moe import route_triton

    cases.check_route(route_triton.route, "cuda", *case, seed=case[0] + case[1])


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, width, linear_beta", cases.SITU_CASES + [(64, 6144, 25.0)])
def test_situ_and_mul(rows, width, linear_beta, dtype):
    from kimiserve.ops.activation import triton as activation_tt

    cases.check_situ(activation_tt.situ_and_mul, "cuda", dtype, rows, width, linear_beta, seed=rows)


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, width, gated, o_fp32, strided_gate",
                         cases.GATE_OUTPUT_CASES + [(64, 12288, True, True, True), (256, 1536, True, True, False)])
def test_gate_output(rows, width, gated, o_fp32, strided_gate, dtype):
    from kimiserve.ops.activation import triton as activation_tt

    cases.check_gate_output(activation_tt.gate_output, "cuda", dtype, rows, width, gated, o_fp32, strided_gate,
                            seed=rows)


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("rows, heads, head_dim, latent", cases.HEAD_MATMUL_CASES + [(64, 96, 128, 512)])
def test_head_matmul(rows, heads, head_dim, latent, dtype):
    from kimiserve.ops.mla import head_matmul_triton

    cases.check_head_matmul(head_matmul_triton.head_matmul, "cuda", dtype, rows, heads, head_dim, latent, seed=rows)


@gpu
def test_cuda_decode_ops_run_the_glue_kernels():
    from kimiserve.ops.backend import select_decode_ops
    from kimiserve.ops.norm import triton as norm_tt

    from kimiserve.ops.linear import merged

    ops = select_decode_ops(torch.device("cuda"))
    assert ops.rms_norm is norm_tt.rms_norm and ops.linears is merged.merged_linears  # fewer_kernel_ops: the default


def test_reference_add_read_norm_is_the_layers_composition():
    """The reference op is the residual add, `attn_res_read` and `rms_norm` as the full forward runs them."""
    from kimiserve.ops.attn_res.reference import add_read_norm, attn_res_read
    from kimiserve.ops.norm.reference import rms_norm

    g = torch.Generator().manual_seed(3)
    r, a, *blocks = (torch.randn(2, 5, 24, generator=g).bfloat16() for _ in range(5))
    rn, rp, w = torch.randn(24, generator=g).bfloat16(), torch.randn(1, 24, generator=g).bfloat16(), torch.randn(24).bfloat16()
    x, live = add_read_norm(r, a, blocks, rn, rp, w, 1e-5)
    assert torch.equal(live, r + a)
    assert torch.equal(x, rms_norm(attn_res_read(r + a, blocks, rn, rp, 1e-5), w, 1e-5))
    x, live = add_read_norm(r, None, [], None, None, w, 1e-5)
    assert live is r and torch.equal(x, rms_norm(r, w, 1e-5))


def test_block_store_seals_equally_spaced_views():
    """The serving forward's sealed blocks are views of one buffer (the fused read takes them uncopied)."""
    from kimiserve.model.attn_res import block_store, seal
    from kimiserve.ops.attn_res.blocks import block_layout

    class Config:
        num_hidden_layers, attn_res_block_size = 7, 3

    h = torch.randn(1, 4, 8)
    store = block_store(h, Config)
    assert store.shape == (3, 1, 4, 8)
    blocks = []
    for _ in range(3):
        blocks = seal(blocks, h, store)
    assert all(torch.equal(b, h) for b in blocks)
    base, stride, row_stride = block_layout(blocks, h)
    assert base.data_ptr() == store.data_ptr() and stride == 32 and row_stride == 8
    assert seal([], h) == [h]


def test_decode_glue_ops_counts_a_decode_step():
    """benchmarks/decode_glue_ops.py runs on the CPU and counts the step's kernels by group."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "decode_glue_ops.py"), "--dtype", "float32"],
                          cwd=repo, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one decode step of forward_batch" in proc.stdout
    for group in ("RMSNorm", "attn-res read", "router (route)", "ops.kda_decode_step"):
        assert group in proc.stdout, group


@gpu
@pytest.mark.parametrize("dtype", cases.DTYPES)
@pytest.mark.parametrize("tokens, heads, dim", cases.GATED_NORM_CASES + [(8192, 96, 128)])
def test_gated_rms_norm(tokens, heads, dim, dtype):
    from kimiserve.ops.norm import triton as norm_tt

    cases.check_gated_rms_norm(norm_tt.gated_rms_norm, "cuda", dtype, tokens, heads, dim, seed=tokens)
