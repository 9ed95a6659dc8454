"""The parallel layout: validation against the model, and the process groups on gloo ranks."""

from __future__ import annotations

import pytest
import torch

from kimiserve.config import load_preset
from kimiserve.distributed.parallel_state import ParallelConfig, ParallelContext

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing


def test_layout_checks_name_what_does_not_divide():
    tiny = load_preset("tiny")  # 4 KDA and MLA heads, 8 experts
    ParallelConfig(2, enable_expert_parallel=True).check_model(tiny)
    with pytest.raises(ValueError, match=r"KDA heads .* \(4\) is not divisible by tensor_parallel_size \(3\)"):
        ParallelConfig(3).check_model(tiny)
    with pytest.raises(ValueError, match="must divide tensor_parallel_size"):
        ParallelConfig(2, decode_context_parallel_size=4).validate()
    with pytest.raises(ValueError, match="tensor_parallel_size must be a positive integer"):
        ParallelConfig(0).validate()


def groups_of_rank(rank, world_size, tp, dcp, pcp):
    import torch.distributed as dist

    ctx = ParallelContext.create(ParallelConfig(tp, False, dcp, pcp), rank, "cpu")
    seen = {}
    for name, group in (("tp", ctx.tp_group), ("dcp", ctx.dcp_group), ("pcp", ctx.pcp_group)):
        t = torch.tensor([rank])
        parts = [torch.zeros(1, dtype=torch.int64) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, t, group=group)
        seen[name] = [int(p) for p in parts]
    x = torch.full((2,), float(rank))
    ctx.tp_all_reduce(x)
    return seen, (ctx.tp_rank, ctx.dcp_rank, ctx.pcp_rank), x.tolist()


def test_groups_on_four_ranks(ranks):
    results = ranks.run(4, groups_of_rank, 2, 2, 2)  # tp 2 (dcp 2 inside it) x pcp 2
    assert [r[0]["tp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0]["dcp"] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]
    assert [r[0]["pcp"] for r in results] == [[0, 2], [1, 3], [0, 2], [1, 3]]
    assert [r[1] for r in results] == [(0, 0, 0), (1, 1, 0), (0, 0, 1), (1, 1, 1)]
    assert [r[2] for r in results] == [[1.0, 1.0], [1.0, 1.0], [5.0, 5.0], [5.0, 5.0]]
