"""LoRA adapters in the default (fast) forward: the loaded adapters' weights in per-projection device
buffers of fixed shapes, and the adapter of each packed row of a step.

Every loaded adapter owns a slot 1..max_loras (slot 0 is the base model: zeros). A projection an adapter
covers gets `A` [S + 1, R, in] and `B` [out, S + 1, R] (S = max_loras, R = max_lora_rank; ranks below R
zero-padded, B pre-multiplied by alpha / r), the routed experts one A [S + 1, E, R, in] and B
[S + 1, E, out, R] per weight w1 / w2 / w3. The buffers of a projection are made when the first adapter
covering it is loaded (a model pays only for what its adapters cover); that changes `version`, which makes
the CUDA decode graphs capture again.

The row-to-slot map of a step (`LoRARows`) is set on the `ServingLoRA` around the model's forward
(`active`); each covered projection adds its rows' deltas:

- eager steps know their groups on the host (`LoRARows.groups`: the rows of each adapter present) and run
  one pair of matmuls per adapter present (segments), at the adapter's own rank; past STATIC_MOE_TOKENS
  tokens the routed experts run one group per (adapter, expert) present, base rows through the same
  expert matmul without a delta;
- a captured decode graph knows only the slots tensor (a graph input: shapes do not depend on which
  adapters are in the batch): x times every slot's A at once, masked to the row's slot, times every
  slot's B (`masked_delta`); the experts (and eager steps of up to STATIC_MOE_TOKENS tokens: no host
  sync, a fixed number of ops) gather each (token, expert) pair's A and B (`gathered_delta`) next to the
  every-expert dense form of `RoutedExperts`.

A base row's delta is exactly zero in every form (slot 0's weights are zero, or the row takes no group),
so base rows give the bits they give without LoRA. Outside `active` (full-sequence forwards, training)
the buffers do nothing.

Not covered here: the indexer's wq_b / weights_proj (the MLA layer runs them on row subsets), tensor,
expert and context parallelism, speculative decoding.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kimiserve.lora.adapter import lora_targets
from kimiserve.model.moe import STATIC_MOE_TOKENS, RoutedExperts

ROW_SUBSET_PROJECTIONS = (".indexer.wq_b", ".indexer.weights_proj")
"""Projections the default forward runs on subsets of a step's rows: LoRA on them is batch-invariant only."""


@dataclass
class LoRARows:
    """The adapter of each packed row of a step: `slots` int64 [N] on the device (0: the base model), and
    for an eager step `groups`, the (slot, rank, rows) of every adapter present (rows: a slice when
    contiguous, else an int64 device tensor); None in a captured graph."""

    slots: torch.Tensor
    groups: list[tuple[int, int, slice | torch.Tensor]] | None = None

    @classmethod
    def of(cls, row_slots: list[int], ranks: dict[int, int], device) -> "LoRARows":
        """From each row's slot on the host (`ranks`: slot -> the adapter's rank)."""
        groups = []
        for slot in sorted(set(row_slots) - {0}):
            idx = [i for i, s in enumerate(row_slots) if s == slot]
            rows = (slice(idx[0], idx[-1] + 1) if idx[-1] - idx[0] + 1 == len(idx)
                    else torch.tensor(idx, dtype=torch.int64, device=device))
            groups.append((slot, ranks[slot], rows))
        return cls(torch.tensor(row_slots, dtype=torch.int64, device=device), groups)


def segment_delta(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, groups) -> torch.Tensor:
    """y [N, out] plus, for each group (slot, rank, rows), B_slot A_slot x on its rows; in place."""
    for slot, rank, rows in groups:
        d = F.linear(F.linear(x[rows], A[slot, :rank]), B[:, slot, :rank])
        if isinstance(rows, slice):
            y[rows] += d
        else:
            y.index_add_(0, rows, d)
    return y


def masked_delta(x: torch.Tensor, y: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """y [N, out] plus B_{slots[n]} A_{slots[n]} x[n] for every row, in fixed shapes: x against every slot's
    A at once ([N, (S + 1) R]), the other slots' columns zeroed, against every slot's B. In place."""
    N, S1, R = x.shape[0], A.shape[0], A.shape[1]
    h = F.linear(x, A.view(S1 * R, -1)).view(N, S1, R)
    mask = slots.unsqueeze(1) == torch.arange(S1, device=slots.device)
    h = (h * mask.unsqueeze(-1).to(h.dtype)).view(N, S1 * R)
    y += F.linear(h, B.view(B.shape[0], S1 * R))
    return y


def gathered_delta(x: torch.Tensor, A: torch.Tensor, B: torch.Tensor, slots: torch.Tensor,
                   experts: torch.Tensor) -> torch.Tensor:
    """B[slot, expert] A[slot, expert] x of each (token, expert) pair, x [P, in] -> [P, out] (fixed shapes)."""
    h = torch.bmm(A[slots, experts], x.unsqueeze(-1))
    return torch.bmm(B[slots, experts], h)[..., 0]


class LoRALinear:
    """One projection's slots (see the module doc); called by the projection on its output."""

    def __init__(self, owner: "ServingLoRA", out_features: int, in_features: int, dtype, device):
        S1, R = owner.max_loras + 1, owner.max_rank
        self.owner = owner
        self.A = torch.zeros(S1, R, in_features, dtype=dtype, device=device)
        self.B = torch.zeros(out_features, S1, R, dtype=dtype, device=device)

    def write(self, slot: int, pair, scaling: float) -> None:
        self.A[slot].zero_()
        self.B[:, slot].zero_()
        if pair is not None:
            a, b = pair
            r = a.shape[0]
            self.A[slot, :r] = a.to(self.A.dtype)
            self.B[:, slot, :r] = (b.float() * scaling).to(self.B.dtype)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        rows = self.owner.rows
        if rows is None:
            return y
        x2, y2 = x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1])
        if x2.shape[0] != rows.slots.shape[0]:
            raise RuntimeError(f"a LoRA projection got {x2.shape[0]} rows in a step of {rows.slots.shape[0]}")
        A, B = self.A.to(x.dtype), self.B.to(x.dtype)
        if rows.groups is None:
            masked_delta(x2, y2, A, B, rows.slots)
        else:
            segment_delta(x2, y2, A, B, rows.groups)
        return y2.view(y.shape)  # y itself when it is contiguous (reshape made a view)


class LoRAExperts:
    """The routed experts' slots: per weight w1 / w2 / w3, A [S + 1, E, R, in] and B [S + 1, E, out, R]."""

    def __init__(self, owner: "ServingLoRA", shapes: dict[str, tuple[int, int, int]], dtype, device):
        S1, R = owner.max_loras + 1, owner.max_rank
        self.owner = owner
        self.A = {w: torch.zeros(S1, E, R, inp, dtype=dtype, device=device) for w, (E, out, inp) in shapes.items()}
        self.B = {w: torch.zeros(S1, E, out, R, dtype=dtype, device=device) for w, (E, out, inp) in shapes.items()}
        self.covered: set[int] = set()
        """Slots whose adapter covers these experts."""

    def write(self, slot: int, pairs: dict, scaling: float) -> None:
        for w in self.A:
            self.A[w][slot].zero_()
            self.B[w][slot].zero_()
            if w in pairs:
                a, b = pairs[w]
                r = a.shape[1]
                self.A[w][slot, :, :r] = a.to(self.A[w].dtype)
                self.B[w][slot, :, :, :r] = (b.float() * scaling).to(self.B[w].dtype)
        (self.covered.add if pairs else self.covered.discard)(slot)

    def applies(self) -> bool:
        """Whether the step running now takes these experts' LoRA form: always in a graph (shapes fixed),
        in an eager step when an adapter present covers them."""
        rows = self.owner.rows
        return rows is not None and (rows.groups is None or any(g[0] in self.covered for g in rows.groups))

    def delta(self, w: str, x: torch.Tensor, slots: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        return gathered_delta(x, self.A[w].to(x.dtype), self.B[w].to(x.dtype), slots, experts)

    def forward(self, module: RoutedExperts, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype) -> torch.Tensor:
        """`RoutedExperts.forward` with each token's adapter on its experts (x [N, h], ids / weights [N, k])."""
        rows = self.owner.rows
        N, k = ids.shape
        pair_experts, pair_slots = ids.reshape(-1), rows.slots.repeat_interleave(k)
        xs = x.repeat_interleave(k, dim=0)
        if rows.groups is None or N <= STATIC_MOE_TOKENS:
            y = self._dense(module, x, xs, pair_experts, pair_slots)
        else:
            y = self._segments(module, xs, pair_experts, pair_slots)
        return (y.float().view(N, k, -1) * weights.float().unsqueeze(-1)).sum(1).to(out_dtype)

    def _segments(self, module, xs, pair_experts, pair_slots) -> torch.Tensor:
        """One group per (slot, expert) present: the expert's matmuls on its rows, plus the adapter's."""
        E, ranks = module.num_experts, self.owner.ranks
        key = torch.where(torch.isin(pair_slots, torch.tensor(sorted(self.covered), device=xs.device)),
                          pair_slots, 0) * E + pair_experts
        out = None
        for group in torch.unique(key).tolist():
            slot, e = divmod(group, E)
            rows = torch.nonzero(key == group)[:, 0]
            xe = xs[rows]
            proj = {w: module.expert_weight(w, e).to(xs.dtype) for w in module.NAMES}

            def linear(w, inp):
                y = F.linear(inp, proj[w])
                if slot and w in self.A:
                    r = ranks[slot]
                    y = y + F.linear(F.linear(inp, self.A[w][slot, e, :r].to(inp.dtype)),
                                     self.B[w][slot, e, :, :r].to(inp.dtype))
                return y

            y = linear("w2", module.act(linear("w1", xe), linear("w3", xe)))
            if out is None:
                out = y.new_empty(xs.shape[0], y.shape[-1])
            out[rows] = y
        return out

    def _dense(self, module, x, xs, pair_experts, pair_slots) -> torch.Tensor:
        """Fixed shapes (a captured graph): every expert on every token as in `RoutedExperts`' dense form,
        each pair's gate / up / down picked from it plus its gathered LoRA delta."""
        N, P = x.shape[0], xs.shape[0]
        every = torch.arange(module.num_experts, device=x.device)
        w1, w2, w3 = (module.stacked_weight(n, every).to(x.dtype) for n in module.NAMES)
        token = torch.arange(N, device=x.device).repeat_interleave(P // N)

        def up_linear(w, weight):
            y = torch.einsum("nh,eih->eni", x, weight)[pair_experts, token]
            return y + self.delta(w, xs, pair_slots, pair_experts) if w in self.A else y

        act = module.act(up_linear("w1", w1), up_linear("w3", w3))  # [P, I]
        dense = act.new_zeros(module.num_experts, N, act.shape[-1])
        dense[pair_experts, token] = act  # a token's k experts are distinct
        y = torch.einsum("eni,ehi->enh", dense, w2)[pair_experts, token]
        return y + self.delta("w2", act, pair_slots, pair_experts) if "w2" in self.A else y


class ServingLoRA:
    """The default forward's LoRA slots of one model (see the module doc)."""

    def __init__(self, model, max_loras: int, max_rank: int):
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.rows: LoRARows | None = None
        """The adapter of each row of the step running now (None outside `active`)."""
        self.ranks: dict[int, int] = {}
        self.version = 0
        """Changes when a projection gets buffers (captured graphs that do not read them are stale)."""
        self._modules = dict(model.named_modules())
        self._expert_shapes = lora_targets(model)[1]
        self._dtype = model.dtype
        self._device = model.lm_head_weight.device

    @contextmanager
    def active(self, rows: LoRARows | None):
        previous, self.rows = self.rows, rows
        try:
            yield
        finally:
            self.rows = previous

    def check(self, adapter) -> None:
        for name in adapter.weights:
            if name.endswith(ROW_SUBSET_PROJECTIONS):
                raise ValueError(f"LoRA adapter {adapter.name!r} covers {name}: LoRA on the indexer's wq_b and "
                                 f"weights_proj runs in the batch-invariant forward only (batch_invariant=True)")

    def write(self, slot: int, adapter) -> None:
        """Put `adapter` in `slot` (1..max_loras); every projection with buffers and not covered by it gets zeros."""
        self.check(adapter)
        for name, pair in adapter.weights.items():
            module = self._modules[name]
            if getattr(module, "lora", None) is None:
                module.lora = LoRALinear(self, *module.weight.shape, self._dtype, self._device)
                self.version += 1
        per_experts: dict[str, dict] = {}
        for key, pair in adapter.expert_weights.items():
            base, w = key.rsplit(".", 1)
            per_experts.setdefault(base, {})[w] = pair
        for base in per_experts:
            module = self._modules[base]
            if getattr(module, "lora", None) is None:
                shapes = {w: self._expert_shapes[f"{base}.{w}"] for w in RoutedExperts.NAMES}
                module.lora = LoRAExperts(self, shapes, self._dtype, self._device)
                self.version += 1
        for name, module in self._modules.items():
            lora = getattr(module, "lora", None)
            if isinstance(lora, LoRALinear):
                lora.write(slot, adapter.weights.get(name), adapter.scaling)
            elif isinstance(lora, LoRAExperts):
                lora.write(slot, per_experts.get(name, {}), adapter.scaling)
        self.ranks[slot] = adapter.rank

    def clear(self, slot: int) -> None:
        for module in self._modules.values():
            lora = getattr(module, "lora", None)
            if isinstance(lora, LoRALinear):
                lora.write(slot, None, 1.0)
            elif isinstance(lora, LoRAExperts):
                lora.write(slot, {}, 1.0)
        self.ranks.pop(slot, None)
