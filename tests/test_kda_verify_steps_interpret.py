"""The one-launch KDA verify op (`ops/kda/triton_verify.py`) under Triton's CPU interpreter: every position's
output and saved conv and recurrent states bit for bit those of the fused decode step run position by position
(on the pages, as plain decoding runs it), at odd sizes, ragged chunk lengths, NaN-filled outputs and slots,
fp32 and bf16; the pages it reads stay as they were.

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kda_verify_steps_interpret.py -q
"""

import functools

import pytest
import torch

import triton_interpreter_shims

device = triton_interpreter_shims.device_or_skip_module()

from kda_decode_step_cases import page_view  # noqa: E402
from kimiserve.ops.kda import paged, triton_decode, triton_verify  # noqa: E402

# (chunks, positions T, heads, head dim, conv taps, gate lower bound, chunk lengths (None: all T), conv page dtype
# (None: the model's))
CASES = [(1, 4, 2, 24, 4, -5.0, None, None), (3, 3, 3, 40, 3, None, (3, 1, 2), None),
         (2, 5, 1, 16, 2, -5.0, (5, 2), torch.float32), (2, 4, 1, 128, 4, None, (2, 4), None),
         (3, 2, 2, 16, 4, None, None, torch.bfloat16)]


def make_case(B, T, H, K, W, lower_bound, lengths, dtype, conv_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s, scale=1.0: (torch.randn(*s, generator=gen) * scale).to(device)  # noqa: E731
    P = H * K
    lengths = lengths or (T,) * B
    N = sum(lengths) + 3  # the chunks' rows scattered among other rows of the step
    order = torch.randperm(N, generator=gen)
    grid, at = torch.empty(B, T, dtype=torch.int64), 0
    for j, n in enumerate(lengths):
        grid[j, :n] = order[at : at + n]
        grid[j, n:] = grid[j, n - 1]  # as `ForwardBatch.build` pads a shorter chunk
        at += n
    # q, k, v, b and gate as row views of one merged projection's output (as `ops.linear.merged` gives them)
    q, k, v, b, gate, _ = rnd(N, 4 * P + H + 3).to(dtype).split([P, P, P, H, P, 3], dim=-1)
    xs = [q, k, v, rnd(N, P).to(dtype), b, gate]
    weights = paged.KDADecodeWeights(rnd(P, W, scale=0.5), rnd(P, W, scale=0.5), rnd(P, W, scale=0.5),
                                     rnd(H, scale=0.5), rnd(P), lower_bound, 1 + rnd(K, scale=0.1), 1e-5)
    pages = B + 3
    # page strides at 16-float multiples, as the pool's: the state's alignment is part of the kernel's
    # specialisation (see triton_decode._PER_CALL_ARGS), and the slots' are such multiples
    conv = page_view(pages, (3, P, W - 1), conv_dtype or dtype, device, gen, pad=48)
    states = page_view(pages, (H, K, K), torch.float32, device, gen, scale=0.1, pad=48)
    distinct = torch.randperm(pages, generator=gen)[:B]
    page_ids = torch.stack([distinct.flip(0), distinct], dim=1)[:, 1].to(device)  # a column, as the layer's pages
    return xs, weights, conv, states, page_ids, grid.to(device), lengths


def nan(*shape, dtype):
    return torch.full(shape, float("nan"), dtype=dtype, device=device)


def run_verify(op, xs, weights, conv, states, page_ids, grid, lengths, ragged):
    B, T = grid.shape
    H, K, V = states.shape[1:]
    active = [None if min(lengths) > t else torch.tensor([j for j, n in enumerate(lengths) if n > t], device=device)
              for t in range(T)]
    out = nan(xs[0].shape[0], H, V, dtype=xs[0].dtype)
    conv_slots, state_slots = nan(T, B, *conv.shape[1:], dtype=conv.dtype), nan(T, B, H, K, V, dtype=torch.float32)
    lens = torch.tensor(lengths, dtype=torch.int32, device=device) if ragged else None
    assert op(*xs, weights, conv, states, page_ids, grid, lens, active, out, conv_slots, state_slots) is out
    return out, conv_slots, state_slots


def check_against_decode_steps(op, decode_step, case, dtype, seed):
    B, T, H, K, W, lower_bound, lengths, conv_dtype = case
    xs, weights, conv, states, page_ids, grid, lengths = make_case(*case[:6], lengths, dtype, conv_dtype, seed)
    conv0, states0 = conv.clone(), states.clone()
    out, conv_slots, state_slots = run_verify(op, xs, weights, conv, states, page_ids, grid, lengths,
                                              ragged=case[6] is not None)
    assert torch.equal(conv, conv0) and torch.equal(states, states0), "the op wrote the pages it only reads"
    written = torch.zeros(out.shape[0], dtype=torch.bool)
    for t in range(T):  # plain decoding: token t of every chunk that has one, one decode step on the pages
        live = [j for j in range(B) if lengths[j] > t]
        rows = grid[live, t]
        want = decode_step(*(x[rows] for x in xs), weights, conv, states, page_ids[live])
        assert torch.equal(out[rows], want), f"position {t}: outputs differ from the decode step's"
        written[rows.cpu()] = True
        for j in live:
            assert torch.equal(conv_slots[t, j], conv[page_ids[j]]), f"position {t}, chunk {j}: conv slot differs"
            assert torch.equal(state_slots[t, j], states[page_ids[j]]), f"position {t}, chunk {j}: state slot differs"
    assert torch.isnan(out[~written.to(device)]).all(), "rows of no chunk position were written"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_one_launch_matches_decode_steps(case, dtype):
    launches = []
    kernel = triton_decode._kda_steps_kernel  # the decode step's single kernel, all positions in one launch
    run = kernel.run
    counting = [False]

    def counted(*a, **kw):
        launches.extend([1] if counting[0] else [])
        return run(*a, **kw)

    def verify(*a):
        counting[0] = True
        try:
            return triton_verify.kda_verify_steps(*a, fallback=paged.kda_decode)
        finally:
            counting[0] = False

    kernel.run = counted
    try:
        step = functools.partial(triton_decode.kda_decode_step, fallback=paged.kda_decode)
        check_against_decode_steps(verify, step, case, dtype, seed=sum(case[:5]))
    finally:
        kernel.run = run
    assert launches == [1], "the positions did not run as one launch"


def test_split_form_positions_loop_the_split_decode_step():
    """Where the decode step takes its V-split form, the op runs that form position by position (same bits)."""
    op = functools.partial(triton_verify.kda_verify_steps, fallback=paged.kda_decode, block_v=16)
    step = functools.partial(triton_decode.kda_decode_step, fallback=paged.kda_decode, block_v=16)
    check_against_decode_steps(op, step, (2, 3, 2, 40, 4, -5.0, (3, 2), None), torch.bfloat16, seed=7)


def test_reference_op_matches_reference_decode_steps():
    check_against_decode_steps(paged.kda_verify_steps, paged.kda_decode_step, (3, 4, 2, 24, 3, None, (4, 1, 3), None),
                               torch.float32, seed=5)


def test_slot_ops_pick_the_one_launch_op():
    from kimiserve.ops.backend import REFERENCE_OPS, kda_verify_slot_ops
    import dataclasses

    fused = dataclasses.replace(REFERENCE_OPS, kda_decode_step=functools.partial(triton_decode.kda_decode_step,
                                                                                 fallback=paged.kda_decode))
    op = kda_verify_slot_ops(fused).kda_verify_steps
    assert op.func is triton_verify.kda_verify_steps and op.keywords == {"fallback": paged.kda_decode}
    assert kda_verify_slot_ops(REFERENCE_OPS).kda_verify_steps.func is paged.kda_verify_steps
