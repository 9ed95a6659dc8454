"""Several LoRA adapters (and the base model) in one batch: grouped LoRA matmuls.

Each row of a batch has an adapter slot (-1: the base model). For a projection y = W x, the adapters'
A and B of that projection are stacked once per batch (zeros for the base and for adapters that do not
cover it; ranks zero-padded to the largest) and the rows run grouped by adapter (by adapter and expert
for the experts): one grouped invariant matmul for A and one for B (`ops.batch_invariant.reference.
stacked_linear`: on CUDA one launch planned on the device, no host sync), so a row's result depends
only on its own adapter. `lora_reference` is the oracle: one F.linear per adapter on its rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kimiserve.ops.batch_invariant import reference as bi
from kimiserve.utils.host_copy import queue_device_copy


def _stack(pairs: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[slots + 1, ..., rank, in] and [slots + 1, ..., out, rank]; row 0 (the base) and missing pairs zero."""
    ref_a, ref_b = next((a, b) for a, b in (p for p in pairs if p is not None))
    zero_a = ref_a.new_zeros(*ref_a.shape[:-2], rank, ref_a.shape[-1])
    zero_b = ref_b.new_zeros(*ref_b.shape[:-1], rank)
    As, Bs = [zero_a], [zero_b]
    for p in pairs:
        if p is None:
            As.append(zero_a)
            Bs.append(zero_b)
            continue
        a, b = p
        r = a.shape[-2]
        As.append(a if r == rank else torch.cat([a, a.new_zeros(*a.shape[:-2], rank - r, a.shape[-1])], -2))
        Bs.append(b if r == rank else torch.cat([b, b.new_zeros(*b.shape[:-1], rank - r)], -1))
    return torch.stack(As), torch.stack(Bs)


def small_tensor(values, dtype: torch.dtype, device) -> torch.Tensor:
    """A small host list as a tensor on `device`, without making the host wait for the device (pinned on CUDA)."""
    return queue_device_copy(torch.tensor(values, dtype=dtype), device)


class LoRABatch:
    """`adapters` (slot i = adapters[i]) and `row_slot` int64 [N] (-1: base) of the batch's packed rows."""

    def __init__(self, adapters: list, row_slot: torch.Tensor):
        self.adapters, self.row_slot = adapters, row_slot
        self.rank = max((a.rank for a in adapters), default=0)
        self.scales = small_tensor([0.0] + [a.scaling for a in adapters], torch.float32, row_slot.device)
        self._plans: dict[tuple, tuple[torch.Tensor, object]] = {}
        """Per (row count, which adapters cover a projection): the rows' coverage and their groups."""

    def _delta(self, key: str, table: str, x: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor | None = None):
        pairs = [getattr(a, table).get(key) for a in self.adapters]
        if all(p is None for p in pairs):
            return None, None
        A, B = _stack(pairs, self.rank)
        index = slots + 1
        coverage = (len(slots), *(p is not None for p in pairs))
        if experts is None and coverage in self._plans:  # the same rows as an earlier projection's
            covered, groups = self._plans[coverage]
        else:
            covered = small_tensor((False, *coverage[1:]), torch.bool, x.device)[index]
            key = index if experts is None else index * A.shape[1] + experts  # experts: (adapter, expert)
            num_groups = A.shape[0] if experts is None else A.shape[0] * A.shape[1]
            groups = bi.group_rows(x, torch.where(covered, key, -1), num_groups)
            if experts is None:
                self._plans[coverage] = covered, groups
        A, B = A.reshape(-1, *A.shape[-2:]), B.reshape(-1, *B.shape[-2:])  # [groups, rank, in], [groups, out, rank]
        h = bi.stacked_linear(x, groups, A)
        d = bi.stacked_linear(h, groups, B)
        return d.float() * self.scales[index].unsqueeze(1), covered

    def apply(self, name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (= W x of projection `name`, rows [N]) plus each row's adapter delta."""
        if x.dim() != 2:
            raise ValueError(f"LoRA rows must be [N, in], got {tuple(x.shape)}")
        d, covered = self._delta(name, "weights", x, self.row_slot)
        if d is None:
            return y
        return torch.where(covered.unsqueeze(1), (y.float() + d).to(y.dtype), y)

    def apply_experts(self, key: str, xs: torch.Tensor, experts: torch.Tensor, pair_slot: torch.Tensor,
                      y: torch.Tensor) -> torch.Tensor:
        """The routed experts' `key` ("<experts module>.<w1|w2|w3>") for (token, slot) pairs: xs [P, in],
        their experts [P], their rows' adapter slots [P], y [P, out]."""
        d, covered = self._delta(key, "expert_weights", xs, pair_slot, experts)
        if d is None:
            return y
        return torch.where(covered.unsqueeze(1), (y.float() + d).to(y.dtype), y)


def lora_reference(x: torch.Tensor, weight: torch.Tensor, adapters: list, row_slot: torch.Tensor, name: str) -> torch.Tensor:
    """The oracle of `LoRABatch.apply` on top of F.linear: rows grouped by adapter, one plain matmul each."""
    y = F.linear(x, weight)
    out = y.clone()
    for slot, adapter in enumerate(adapters):
        rows = torch.nonzero(row_slot == slot)[:, 0]
        if rows.numel() and name in adapter.weights:
            a, b = adapter.weights[name]
            out[rows] = y[rows] + adapter.scaling * F.linear(F.linear(x[rows], a), b)
    return out
