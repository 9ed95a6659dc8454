"""The fused KDA decode step's Triton kernel under Triton's CPU interpreter (no GPU needed).

Skipped unless KIMISERVE_TRITON_INTERPRET=1; run it in its own process:

    KIMISERVE_TRITON_INTERPRET=1 .venv/bin/python -m pytest tests/test_kda_decode_step_interpret.py -q
"""

import pytest
import torch

import triton_interpreter_shims

triton_interpreter_shims.enable_or_skip_module()

from kda_decode_step_cases import CASES, ONE_LAUNCH_CASES, SPLIT_CASES, check_decode_step, nan_filled_empty  # noqa: E402
from kimiserve.ops.kda import triton_decode  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound", CASES)
def test_kernel_matches_reference(rows, H, K, W, lower_bound, dtype):
    check_decode_step(triton_decode.kda_decode_step, "cpu", dtype, rows, H, K, W, lower_bound, seed=rows * 31 + K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound, block_v", SPLIT_CASES)
def test_split_form_matches_reference(rows, H, K, W, lower_bound, block_v, dtype, monkeypatch):
    """The V-split form (three kernels) against the reference, and against the single kernel, with the
    output and scratch it allocates NaN-filled."""
    import functools

    nan_filled_empty(monkeypatch)
    split = functools.partial(triton_decode.kda_decode_step, block_v=block_v)
    single = functools.partial(triton_decode.kda_decode_step, block_v=None)
    check_decode_step(split, "cpu", dtype, rows, H, K, W, lower_bound, seed=rows * 17 + K, same_as=single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows, H, K, W, lower_bound, block_v", ONE_LAUNCH_CASES)
def test_one_launch_form_matches_reference(rows, H, K, W, lower_bound, block_v, dtype, monkeypatch):
    """The one-launch split form (counters) over two steps on the same pages and counters (the second
    launch finds them reset) against the reference, and bit-equal to the three-kernel split form (the
    interpreter sums in one fixed order), outputs and the split form's scratch NaN-filled."""
    import functools

    nan_filled_empty(monkeypatch)
    counters = triton_decode.StepCounters()
    one = functools.partial(triton_decode.kda_decode_step, block_v=block_v, counters=counters)
    split = functools.partial(triton_decode.kda_decode_step, block_v=block_v)
    check_decode_step(one, "cpu", dtype, rows, H, K, W, lower_bound, seed=rows * 13 + K, same_as=split, steps=2,
                      exact=True)
    (buffer,) = counters.buffers[torch.device("cpu")]
    assert buffer.numel() >= rows * H and not buffer.any(), "counters not reset to zero"


def test_one_launch_form_any_block_may_arrive_last(monkeypatch):
    """The interpreter runs a head's V blocks in increasing order; run them in decreasing order instead
    (block 0 arrives last and normalises the row the others wrote): the same values."""
    import functools

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    in_order, reversed_blocks = builder.set_grid_idx, []

    def set_grid_idx(x, y, z):
        reversed_blocks.append(builder.grid_dim[2] - 1 - z)
        in_order(x, y, reversed_blocks[-1])

    monkeypatch.setattr(builder, "set_grid_idx", set_grid_idx)
    one = functools.partial(triton_decode.kda_decode_step, block_v=16, counters=triton_decode.StepCounters())
    split = functools.partial(triton_decode.kda_decode_step, block_v=16)
    check_decode_step(one, "cpu", torch.bfloat16, 3, 2, 40, 4, -5.0, seed=3, same_as=split, steps=2, exact=True)
    assert reversed_blocks[:3] == [2, 1, 0], "the interpreter no longer sets program ids through set_grid_idx"


def test_step_counters_grow_and_keep_what_they_outgrew():
    counters = triton_decode.StepCounters(capacity=4)
    cpu = torch.device("cpu")
    small = counters.get(3, cpu)
    assert small.numel() == 4 and small.dtype == torch.int32 and not small.any()
    assert counters.get(4, cpu) is small
    big = counters.get(5, cpu)
    assert big.numel() == 8 and len(counters.buffers[cpu]) == 2  # graphs captured on `small` keep it
    assert counters.buffers[cpu][0] is small and counters.buffers[cpu][1] is big


def test_step_counters_do_not_grow_while_a_graph_captures(monkeypatch):
    """Growing during a capture would allocate counters whose zero fill never ran: a clear error instead
    (checked on the CPU with the capture query faked; the buffer is never allocated)."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ValueError, match="capacity"):
        triton_decode.StepCounters().get(96, torch.device("cuda", 0))


def test_one_launch_form_needs_a_power_of_two_block():
    args = [torch.zeros(1, 16)] * 3
    for bad in (None, "auto", 24, 0, True):
        with pytest.raises(ValueError, match="one-launch form"):
            triton_decode.kda_decode_step(*args, None, None, None, None, None, torch.zeros(2, 1, 16, 16), None,
                                          block_v=bad, counters=triton_decode.StepCounters())


def test_block_v_must_be_a_power_of_two():
    args = [torch.zeros(1, 16)] * 3
    for bad in (0, 24, -16, 32.0, True, "32"):
        with pytest.raises(ValueError, match="block_v"):
            triton_decode.kda_decode_step(*args, None, None, None, None, None, torch.zeros(2, 1, 16, 16), None,
                                          block_v=bad)


@pytest.mark.parametrize("kv, block_v", [("bf16", None), ("fp8", None), ("bf16", 8), ("bf16", "one8")])
def test_engine_with_fused_kda_decode_matches_reference_ops(kv, block_v):
    """The tiny engine with the kernel (block_v None: the single kernel; 8: the split form, the tiny
    preset's V = 16 in two blocks; one8: the one-launch form in those blocks, one set of counters for
    every layer and step) as its KDA decode step: the reference-ops engine's greedy tokens, and its logits
    at every step within fp32 rounding."""
    import dataclasses
    import functools

    from engine_utils import assert_ops_match_reference_ops, random_prompts
    from kimiserve.ops.backend import REFERENCE_OPS
    from kimiserve.ops.kda import paged

    one = block_v == "one8"
    fused = dataclasses.replace(REFERENCE_OPS, name="fused-kda-interpreted", kda_decode_step=functools.partial(
        triton_decode.kda_decode_step, fallback=paged.kda_decode, block_v=8 if one else block_v,
        counters=triton_decode.StepCounters() if one else None))
    assert_ops_match_reference_ops(fused, kv, random_prompts([40, 90, 7], seed=11))
