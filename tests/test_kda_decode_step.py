"""The fused KDA decode step (`ops/kda/triton_decode.py`) on CUDA against the reference composition,
and the reference against the layer's own ops (on the CPU)."""

import pytest
import torch

from kda_decode_step_cases import CASES, ONE_LAUNCH_CASES, SPLIT_CASES, check_decode_step, nan_filled_empty, page_view
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
    # bf16: q and k are rounded to bf16 after their L2 norms, whose sums over K the two forms run in other thread
    # orders, so a rounding can flip by an ulp (session 10's H200 run: state pages 1.4e-6 to 5.3e-6 apart)
    check_decode_step(split, "cuda", dtype, rows, H, K, W, lower_bound, seed=rows * 17 + K, same_as=single,
                      states_close=1e-6 if dtype == torch.float32 else 1e-4)


# K3.1's heads (96 on one GPU, 12 on a TP8 rank) at the small batches the one-launch form is for
ONE_LAUNCH_GPU_CASES = [(1, 96, 128, 4, -5.0, 32), (1, 96, 128, 4, None, 16), (2, 12, 128, 4, -5.0, 16),
                        (8, 96, 128, 4, -5.0, 64), (64, 12, 128, 4, None, 32)]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound, block_v", ONE_LAUNCH_CASES[:3] + ONE_LAUNCH_GPU_CASES)
def test_one_launch_form_matches_reference(rows, H, K, W, lower_bound, block_v, dtype, monkeypatch):
    """The one-launch split form (counters) over two steps on the same pages and counters against the
    reference and the three-kernel split form; outputs and scratch NaN-filled; counters zero after."""
    import functools

    from kimiserve.ops.kda import triton_decode

    nan_filled_empty(monkeypatch)
    counters = triton_decode.StepCounters()
    one = functools.partial(triton_decode.kda_decode_step, block_v=block_v, counters=counters)
    split = functools.partial(triton_decode.kda_decode_step, block_v=block_v)
    # its norms run in another thread order than the split's: in bf16 state pages that flips ulps (session 7's H200
    # run: over 1e-6 at 96 heads x 8 rows)
    check_decode_step(one, "cuda", dtype, rows, H, K, W, lower_bound, seed=rows * 13 + K, same_as=split, steps=2,
                      states_close=1e-6 if dtype == torch.float32 else 1e-2)
    (buffer,) = counters.buffers[torch.device("cuda", torch.cuda.current_device())]
    assert buffer.numel() >= rows * H and not buffer.any(), "counters not reset to zero"


@pytest.mark.gpu
@pytest.mark.parametrize("rows, H, block_v", [(1, 96, 32), (3, 12, 16)])
def test_one_launch_form_replays_in_a_cuda_graph(rows, H, block_v):
    """The one-launch step captured once and replayed for three decode steps (fresh inputs copied into the
    captured buffers) equals three eager reference steps: the counters come back to zero at every replay."""
    from conftest import rel_rms
    from kimiserve.ops.kda import triton_decode

    K, W, dtype, device = 128, 4, torch.bfloat16, "cuda"
    gen = torch.Generator().manual_seed(rows * 7 + H)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device)  # noqa: E731
    P = H * K
    inputs = lambda: [*(rnd(rows, P).to(dtype) for _ in range(5)), rnd(rows, H).to(dtype)]  # noqa: E731
    weights = paged.KDADecodeWeights(rnd(P, W, scale=0.5), rnd(P, W, scale=0.5), rnd(P, W, scale=0.5),
                                     rnd(H, scale=0.5), rnd(P), -5.0, 1 + rnd(K, scale=0.1), 1e-5)
    conv = page_view(rows + 2, (3, P, W - 1), dtype, device, gen)
    states = page_view(rows + 2, (H, K, K), torch.float32, device, gen, scale=0.1)
    page_ids = torch.randperm(rows + 2, generator=gen)[:rows].to(device)
    conv_ref, states_ref = conv.clone(), states.clone()
    counters = triton_decode.StepCounters(capacity=rows * H)
    static = inputs()
    q, k, v, f, gate, b = static
    step = lambda c, s: triton_decode.kda_decode_step(q, k, v, f, b, gate, weights, c, s, page_ids,  # noqa: E731
                                                      block_v=block_v, counters=counters)
    step(conv.clone(), states.clone())  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(conv, states)
    for n in range(3):
        fresh = inputs()
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        fq, fk, fv, ff, fgate, fb = fresh
        want = paged.kda_decode_step(fq, fk, fv, ff, fb, fgate, weights, conv_ref, states_ref, page_ids)
        assert rel_rms(out, want) < 2e-2, f"replay {n}: output rel RMS {rel_rms(out, want):.2e}"
        assert torch.equal(conv, conv_ref), f"replay {n}: conv pages differ"
        assert rel_rms(states[page_ids], states_ref[page_ids]) < 2e-2, f"replay {n}: state pages differ"
    (buffer,) = counters.buffers[torch.device("cuda", torch.cuda.current_device())]
    assert not buffer.any()


def test_one_launch_kernel_compiles_for_the_h200():
    """The one-launch kernel (not yet run on a GPU) through Triton's whole compiler for sm_90, on the CPU:
    it builds, its arrival is one acq_rel atomic at GPU scope, and the last block reads the o row from L2."""
    import os

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton interpreter is on in this process")
    triton = pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kimiserve.ops.kda import triton_decode

    fn = triton_decode._kda_one_launch_kernel
    consts = dict(H=96, K=128, V=128, W=4, BK=128, BV=32, BV_ROW=128, BW=4, HAS_LOWER_BOUND=True)
    names = list(fn.arg_names)
    pointers = {"pages_ptr": "*i32", "counters_ptr": "*i32", **{n: "*bf16" for n in (
        "q_ptr", "k_ptr", "v_ptr", "f_ptr", "b_ptr", "gate_ptr", "out_ptr", "conv_ptr")}}
    sig = {n: "constexpr" if n in consts else pointers.get(n, "*fp32") if n.endswith("_ptr")
           else "fp32" if n in ("lower_bound", "scale", "norm_eps") else "i32" for n in names}
    try:
        kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                                options=dict(num_warps=4))
    except RuntimeError as e:  # no ptxas in this Triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise
    ptx = kernel.asm["ptx"]
    assert ptx.count("atom.global.gpu.acq_rel.add") == 1
    assert "ld.global.cg" in ptx and "cubin" in kernel.asm


def launch_specializations(monkeypatch, calls):
    """Run each of `calls` (functions of no arguments that launch `_kda_steps_kernel` on CPU tensors) with the
    launch intercepted; return each launch's (specialization, options) as Triton's binder for sm_90 makes them:
    equal ones compile to one kernel."""
    if __import__("os").environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the Triton interpreter is on in this process")
    pytest.importorskip("triton")
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from kimiserve.ops.kda import triton_decode

    kernel = triton_decode._kda_steps_kernel
    seen = []
    monkeypatch.setattr(kernel, "run", lambda *args, grid, warmup, **kwargs: seen.append((args, kwargs)))
    binder = create_function_from_signature(kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32)))
    keys = []
    for call in calls:
        del seen[:]
        call()
        assert len(seen) == 1, f"{len(seen)} launches of the steps kernel"
        args, kwargs = seen[0]
        _, specialization, options = binder(*args, **kwargs)
        keys.append((specialization, options))
    return keys


@pytest.mark.parametrize("H, K, batch", [(2, 24, 1), (3, 40, 3)])
def test_decode_and_verify_launch_one_compiled_kernel(H, K, batch, monkeypatch):
    """A decode step (gathered contiguous rows, a page-id column) and a verify step (row views of one merged
    projection at an odd stride, a [B, T] grid, ragged lengths, slots) specialise `_kda_steps_kernel` alike, so on
    the GPU they run one compiled kernel: the same thread layouts and summation orders, so a verify position's
    bits are a decode step's. (Session 7's separate verify kernel differed from the decode kernel's bits on the
    H200 at position 0.)"""
    pytest.importorskip("triton")
    from kimiserve.ops.kda import triton_decode, triton_verify

    W, T, P = 4, 4, H * K
    gen = torch.Generator().manual_seed(H * K)
    dtype = torch.bfloat16
    N = batch * T + 3
    merged = torch.randn(N, 4 * P + H + 3, generator=gen).to(dtype)
    q, k, v, b, gate, _ = merged.split([P, P, P, H, P, 3], dim=-1)
    f = torch.randn(N, P, generator=gen).to(dtype)
    weights = paged.KDADecodeWeights(*(torch.randn(P, W, generator=gen) for _ in range(3)), torch.randn(H),
                                     torch.randn(P), -5.0, torch.ones(K), 1e-5)
    conv = page_view(batch + 4, (3, P, W - 1), dtype, "cpu", gen)
    states = page_view(batch + 4, (H, K, K), torch.float32, "cpu", gen, pad=48)  # the pool's 16-float alignment
    table = torch.arange(2 * (batch + 4), dtype=torch.int64).view(-1, 2)[: batch, :] % (batch + 4)
    grid = torch.arange(batch * T, dtype=torch.int64).view(batch, T)
    lengths = torch.full((batch,), T, dtype=torch.int64)
    lengths[0] = 2
    conv_slots = torch.empty(T, batch, 3, P, W - 1, dtype=dtype)
    state_slots = torch.empty(T, batch, H, K, K)
    rows = torch.arange(batch)

    def decode():
        triton_decode.kda_decode_step(q[rows], k[rows], v[rows], f[rows], b[rows], gate[rows], weights, conv, states,
                                      table[:, 1], block_v=None)

    def verify():
        out = torch.empty(N, H, K, dtype=dtype)
        triton_verify.kda_verify_steps(q, k, v, f, b, gate, weights, conv, states, table[:, 0], grid, lengths, None,
                                       out, conv_slots, state_slots, block_v=None)

    def decode_views():  # a decode graph's rows: the merged projection's views themselves
        triton_decode.kda_decode_step(q[:batch], k[:batch], v[:batch], f[:batch], b[:batch], gate[:batch], weights,
                                      conv, states, table[:, 0].contiguous(), block_v=None)

    first, *others = launch_specializations(monkeypatch, [decode, verify, decode_views])
    for other in others:
        assert other == first


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
