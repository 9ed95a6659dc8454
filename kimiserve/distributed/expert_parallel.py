"""Expert parallelism (DESIGN.md section 4, issue 16 item 3): routed experts split over the ranks of the
expert-parallel (EP) group by a placement table, tokens dispatched to their experts and combined by
torch.distributed collectives (gloo on CPUs, NCCL on GPUs).

The EP group is the TP group when `enable_expert_parallel` (`ParallelContext.ep_rank`, `ep_size`):
`EPGroup.from_context(ctx)`.

Placement (`ExpertPlacement`): a table global expert -> (owner rank, local slot). Every rank holds the
same number of experts, E / ep (so every rank's stacked expert parameters have one shape); any
permutation of the experts over the ranks is allowed, so a load balancer can move experts later.
`contiguous(E, ep)` is the default (expert e on rank e // (E / ep), slot e % (E / ep)). A rank's weight
loader reads checkpoint expert `local_experts(rank)[slot]` into stacked slot `slot`
(`checkpoint_experts(rank)` lists the pairs).

The expert computation stays outside: `LocalExperts` wraps either a per-expert callable
`expert_fn(local_slot, rows [m, h]) -> [m, h]` (the model's bf16 / MXFP4 expert functions) or a rows
callable `rows_fn(rows [M, h], slots [M]) -> [M, h]` (each row through its own local expert: one
launch of the Triton fused MoE with k = 1 and weights 1), or the stacked local weights
(`LocalExperts.from_weights`, the math of `ops.moe.reference.fused_moe_reference`). Outputs are the
unweighted expert outputs in the expert's dtype; every scheme applies the routing weights in fp32.

Schemes (same results within fp32 rounding; `tests/test_expert_parallel.py`):

(a) replicated tokens, `ep_forward_replicated`: every rank of the group holds every token (our layout:
    TP attention leaves each token's hidden state on every TP rank) and the same routing (the router
    is replicated). Each rank runs its experts on the (token, slot) pairs routed to them, weighted, into
    an fp32 partial [N, h]; the partials are summed over the group: all-reduce ([N, h] everywhere),
    reduce-scatter (token chunk `token_chunk(N, ep, rank)`, when the next op wants the tokens split)
    or nothing ("partial": the caller folds the sum into an all-reduce it does anyway, e.g. with the
    shared experts' row-parallel partial). One collective. `ep_forward_gathered` is the same scheme
    for tokens split over the ranks: all-gather the tokens and their routing, compute, reduce-scatter.
(b) all-to-all, `ep_forward_all_to_all`: tokens split over the ranks (data-parallel attention,
    token-sharded prefill; any number per rank, zero included). Each rank sorts its (token, slot)
    pairs by (owner, local slot), exchanges the counts per (rank, local slot) (one all_to_all_single
    of ep x E/ep ints), sends each pair's row to its expert's owner (all_to_all_single, uneven
    splits), the owner runs its experts and sends the outputs back (all_to_all_single), and each token
    sums its k outputs in its own slot order, in fp32: no part of the combine depends on the rank
    count (only the expert GEMMs' row batches do, i.e. fp32 rounding). Three collectives.
    `ep_forward_all_to_all_replicated` runs it from the replicated layout: each rank takes its token
    chunk and the outputs are all-gathered back.

`CommStats` counts each rank's collectives and the bytes it sends to other ranks (ring model for
all-reduce: 2 (W-1)/W of the buffer; reduce-scatter (W-1)/W; all-gather (W-1) x the local part;
all-to-all: the rows addressed to other ranks); `benchmarks/ep_dispatch.py` checks the model against
the bytes the process wrote to its sockets.

Host syncs: scheme (b) must know its split sizes on the host (`all_to_all_single` takes lists), and
the pair selection of (a) with a `LocalExperts` uses `nonzero`; the static-shape path of (a) is
`local_forward` (+ `ExpertPlacement.localize`): other ranks' pairs point at local slot 0 with weight 0,
shapes fixed by N and k (CUDA graphs capture it).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from kimiserve.ops.moe.reference import fused_moe_reference

ExpertFn = Callable[[int, torch.Tensor], torch.Tensor]
"""(local slot, rows [m, h]) -> expert outputs [m, h] (unweighted)."""
RowsFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
"""(rows [M, h], local slots [M] int64) -> [M, h]: row i through local expert slots[i] (unweighted)."""
LocalForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""(x [N, h], local slots [N, k], weights [N, k]) -> sum_j weights[n, j] expert_{slots[n, j]}(x[n]) [N, h]
(the routed-experts forward of `RoutedExperts.forward` / the fused MoE, on this rank's stacked experts)."""


# ------------------------------------------------------------------------------------------------
# placement


class ExpertPlacement:
    """Where each of E routed experts lives in an EP group of `ep_size` ranks: rank r holds the experts
    `local_experts(r)` (E / ep of them, in the order of its stacked parameters: slot i holds expert
    local_experts(r)[i]). Immutable; build a new one to move experts.

        ExpertPlacement.contiguous(896, 8)              # expert e on rank e // 112, slot e % 112
        ExpertPlacement([[0, 5], [1, 4], [2, 3]])       # explicit: rank -> its experts in slot order
        ExpertPlacement.from_owners([0, 1, 2, 2, 1, 0]) # expert -> rank; slots in ascending expert order
    """

    def __init__(self, rank_experts: Sequence[Sequence[int]]):
        if isinstance(rank_experts, (str, bytes)) or not isinstance(rank_experts, Sequence) or not rank_experts:
            raise ValueError("an expert placement needs a non-empty list with one list of experts per rank")
        lists = []
        for r, experts in enumerate(rank_experts):
            if isinstance(experts, torch.Tensor):
                experts = experts.tolist()
            if isinstance(experts, (str, bytes)) or not isinstance(experts, Sequence):
                raise ValueError(f"rank {r}'s experts must be a list of expert ids, got {experts!r}")
            for e in experts:
                if isinstance(e, bool) or not isinstance(e, int):
                    raise ValueError(f"rank {r}: expert ids must be integers, got {e!r}")
            lists.append([int(e) for e in experts])
        counts = {len(x) for x in lists}
        if len(counts) != 1 or 0 in counts:
            raise ValueError("every rank must hold the same positive number of experts (E / ep, so that every "
                             f"rank's stacked expert parameters have one shape); got {[len(x) for x in lists]} "
                             "experts per rank")
        flat = [e for x in lists for e in x]
        E = len(flat)
        bad = sorted({e for e in flat if not 0 <= e < E})
        if bad:
            raise ValueError(f"expert ids must be in 0..{E - 1} (E = {E} experts placed in all), got {bad}")
        seen: dict[int, int] = {}
        twice = []
        for r, x in enumerate(lists):
            for e in x:
                if e in seen:
                    twice.append(f"{e} (ranks {seen[e]} and {r})")
                seen[e] = r
        if twice:
            missing = sorted(set(range(E)) - set(seen))
            raise ValueError(f"every expert must be placed exactly once: placed twice: {', '.join(twice)}; "
                             f"not placed: {missing}")
        self._lists = lists
        self.num_experts = E
        self.ep_size = len(lists)
        self.num_local = E // self.ep_size
        owner = torch.empty(E, dtype=torch.int64)
        slot = torch.empty(E, dtype=torch.int64)
        for r, x in enumerate(lists):
            owner[x] = r
            slot[x] = torch.arange(len(x))
        self._owner, self._slot = owner, slot
        self._tables: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    # constructors ------------------------------------------------------------------------------
    @classmethod
    def contiguous(cls, num_experts: int, ep_size: int) -> "ExpertPlacement":
        """The default: expert e on rank e // (E / ep), in slot e % (E / ep)."""
        _check_sizes(num_experts, ep_size)
        per = num_experts // ep_size
        return cls([list(range(r * per, (r + 1) * per)) for r in range(ep_size)])

    @classmethod
    def from_permutation(cls, order: Sequence[int], ep_size: int) -> "ExpertPlacement":
        """Rank r holds order[r L : (r + 1) L] (L = E / ep), in that slot order."""
        order = order.tolist() if isinstance(order, torch.Tensor) else list(order)
        _check_sizes(len(order), ep_size)
        per = len(order) // ep_size
        return cls([order[r * per:(r + 1) * per] for r in range(ep_size)])

    @classmethod
    def from_owners(cls, owners: Sequence[int], ep_size: int | None = None) -> "ExpertPlacement":
        """owners[e] = the rank holding expert e; each rank's slots in ascending expert order.
        ep_size defaults to max(owners) + 1 (pass it so that a rank holding nothing is an error)."""
        owners = owners.tolist() if isinstance(owners, torch.Tensor) else list(owners)
        if not owners:
            raise ValueError("from_owners needs one owner rank per expert, got none")
        for o in owners:
            if isinstance(o, bool) or not isinstance(o, int) or o < 0:
                raise ValueError(f"owner ranks must be non-negative integers, got {o!r}")
        size = max(owners) + 1 if ep_size is None else ep_size
        if any(o >= size for o in owners):
            raise ValueError(f"owner ranks must be < ep_size ({size}), got {sorted({o for o in owners if o >= size})}")
        return cls([[e for e, o in enumerate(owners) if o == r] for r in range(size)])

    @classmethod
    def for_context(cls, num_experts: int, ctx) -> "ExpertPlacement":
        """The default placement over a `ParallelContext`'s EP group (one rank without expert parallel)."""
        return cls.contiguous(num_experts, ctx.ep_size)

    def to_dict(self) -> dict:
        """JSON-friendly form (sent to workers when a balancer moves experts): `from_dict` reads it."""
        return {"num_experts": self.num_experts, "ep_size": self.ep_size,
                "rank_experts": [list(x) for x in self._lists]}

    @classmethod
    def from_dict(cls, d: dict) -> "ExpertPlacement":
        p = cls(d["rank_experts"])
        if p.num_experts != d.get("num_experts", p.num_experts) or p.ep_size != d.get("ep_size", p.ep_size):
            raise ValueError(f"placement dict says {d.get('num_experts')} experts over {d.get('ep_size')} ranks, its "
                             f"lists hold {p.num_experts} over {p.ep_size}")
        return p

    # queries ------------------------------------------------------------------------------------
    def local_experts(self, rank: int) -> list[int]:
        """Global ids of rank `rank`'s experts, in slot order."""
        self._check_rank(rank)
        return list(self._lists[rank])

    def owner(self, expert: int) -> int:
        return int(self._owner[self._check_expert(expert)])

    def local_index(self, expert: int) -> int:
        """The slot of `expert` among its owner's experts."""
        return int(self._slot[self._check_expert(expert)])

    def global_expert(self, rank: int, slot: int) -> int:
        self._check_rank(rank)
        if not 0 <= slot < self.num_local:
            raise ValueError(f"local slot must be in 0..{self.num_local - 1}, got {slot}")
        return self._lists[rank][slot]

    def checkpoint_experts(self, rank: int) -> list[tuple[int, int]]:
        """What rank `rank`'s weight loader reads: (local slot, checkpoint expert id) pairs, slot order.
        Checkpoint tensors of other experts are not read on this rank."""
        return list(enumerate(self.local_experts(rank)))

    def is_contiguous(self) -> bool:
        return self == ExpertPlacement.contiguous(self.num_experts, self.ep_size)

    def tables(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(owner [E], slot [E]) int64 on `device` (cached)."""
        device = torch.device(device)
        if device not in self._tables:
            self._tables[device] = (self._owner.to(device), self._slot.to(device))
        return self._tables[device]

    def local_index_table(self, rank: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[E] int64: the slot on `rank` of each global expert, -1 for other ranks' experts."""
        self._check_rank(rank)
        owner, slot = self.tables(device)
        return torch.where(owner == rank, slot, torch.full_like(slot, -1))

    def to_local(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Routed global ids [N, k] (any shape) -> (owner rank, local slot) int64 tensors of that shape.
        Out-of-range ids raise an IndexError from the lookup (torch checks the index)."""
        owner, slot = self.tables(ids.device)
        ids = ids.long()
        return owner[ids], slot[ids]

    def localize(self, ids: torch.Tensor, weights: torch.Tensor, rank: int,
                 fill: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Static-shape form for one rank's routed-experts forward: (slots [N, k], weights [N, k]) with
        other ranks' pairs pointed at local slot `fill` and weighted 0 (exactly 0 in the sum)."""
        owner, slot = self.to_local(ids)
        mine = owner == rank
        return torch.where(mine, slot, torch.full_like(slot, fill)), weights.masked_fill(~mine, 0)

    def __eq__(self, other) -> bool:
        return isinstance(other, ExpertPlacement) and self._lists == other._lists

    def __hash__(self) -> int:
        return hash(tuple(map(tuple, self._lists)))

    def __repr__(self) -> str:
        kind = "contiguous" if self.is_contiguous() else "permuted"
        return f"ExpertPlacement({self.num_experts} experts over {self.ep_size} ranks, {kind})"

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.ep_size:
            raise ValueError(f"rank must be in 0..{self.ep_size - 1} (the EP group), got {rank}")

    def _check_expert(self, expert: int) -> int:
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must be in 0..{self.num_experts - 1}, got {expert}")
        return expert


def _check_sizes(num_experts: int, ep_size: int) -> None:
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1:
        raise ValueError(f"the expert-parallel size must be a positive integer, got {ep_size!r}")
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
        raise ValueError(f"num_experts must be a positive integer, got {num_experts!r}")
    if num_experts % ep_size:
        raise ValueError(f"routed experts (num_experts = {num_experts}) are not divisible by the expert-parallel "
                         f"size ({ep_size}): every rank holds the same number of experts")


# ------------------------------------------------------------------------------------------------
# group and traffic accounting


@dataclass(frozen=True)
class EPGroup:
    """One rank's EP group: its rank in it, the group's size and the process group (None: the default
    group, or no torch.distributed at size 1; every collective is the identity at size 1)."""

    rank: int = 0
    size: int = 1
    group: object | None = None

    @classmethod
    def from_context(cls, ctx) -> "EPGroup":
        """The EP group of a `ParallelContext` (its TP group with enable_expert_parallel, else size 1)."""
        return cls(ctx.ep_rank, ctx.ep_size, ctx.tp_group if ctx.ep_size > 1 else None)

    @classmethod
    def world(cls) -> "EPGroup":
        """Every rank of the default process group."""
        return cls(dist.get_rank(), dist.get_world_size(), None)


@dataclass
class CommStats:
    """What one rank's collectives sent to other ranks (the algorithm's payload, not wire framing)."""

    collectives: int = 0
    bytes_sent: int = 0
    by_op: dict = field(default_factory=dict)
    seconds: float = 0.0
    """Wall time spent inside the collectives (the rest of a scheme's time is its bookkeeping)."""

    def add(self, op: str, nbytes: float, seconds: float = 0.0) -> None:
        nbytes = int(round(nbytes))
        self.seconds += seconds
        self.collectives += 1
        self.bytes_sent += nbytes
        calls, total = self.by_op.get(op, (0, 0))
        self.by_op[op] = (calls + 1, total + nbytes)


# torch >= 2.12 names them *_single (the *_tensor names warn)
_reduce_scatter_op = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather_op = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _all_reduce(t: torch.Tensor, g: EPGroup, stats: CommStats | None) -> torch.Tensor:
    if g.size > 1:
        t0 = time.perf_counter()
        dist.all_reduce(t, group=g.group)
        if stats is not None:
            stats.add("all_reduce", 2 * (g.size - 1) / g.size * _nbytes(t), time.perf_counter() - t0)
    return t


def _reduce_scatter(t: torch.Tensor, g: EPGroup, stats: CommStats | None) -> torch.Tensor:
    """t [size * c, ...] -> this rank's c rows of the sum."""
    if g.size == 1:
        return t
    out = t.new_empty((t.shape[0] // g.size, *t.shape[1:]))
    t = t.contiguous()
    t0 = time.perf_counter()
    _reduce_scatter_op(out, t, group=g.group)
    if stats is not None:
        stats.add("reduce_scatter", (g.size - 1) / g.size * _nbytes(t), time.perf_counter() - t0)
    return out


def _all_gather(t: torch.Tensor, g: EPGroup, stats: CommStats | None) -> torch.Tensor:
    """Concatenate the ranks' equal-shape t along dim 0, in rank order."""
    if g.size == 1:
        return t
    out = t.new_empty((g.size * t.shape[0], *t.shape[1:]))
    t = t.contiguous()
    t0 = time.perf_counter()
    _all_gather_op(out, t, group=g.group)
    if stats is not None:
        stats.add("all_gather", (g.size - 1) * _nbytes(t), time.perf_counter() - t0)
    return out


def _all_to_all(inp: torch.Tensor, send: list[int], recv: list[int], g: EPGroup, stats: CommStats | None,
                op: str) -> torch.Tensor:
    """Rows inp[sum(send[:r]) : sum(send[:r + 1])] go to rank r; returns the rows received, by source."""
    out = inp.new_empty((sum(recv), *inp.shape[1:]))
    if g.size == 1:
        return out.copy_(inp)
    inp = inp.contiguous()
    t0 = time.perf_counter()
    dist.all_to_all_single(out, inp, recv, send, group=g.group)
    if stats is not None:
        row = inp.element_size() * math.prod(inp.shape[1:])
        stats.add(op, (sum(send) - send[g.rank]) * row, time.perf_counter() - t0)
    return out


def token_chunk(num_tokens: int, size: int, rank: int) -> slice:
    """Rank `rank`'s contiguous token rows when N tokens are split over `size` ranks: chunks of
    ceil(N / size) rows, the last ones shorter or empty (so a reduce-scatter / all-gather pads to
    size x ceil(N / size) rows)."""
    c = -(-num_tokens // size)
    return slice(min(rank * c, num_tokens), min((rank + 1) * c, num_tokens))


# ------------------------------------------------------------------------------------------------
# the local expert computation


class LocalExperts:
    """A rank's experts as `rows(rows [M, h], slots [M]) -> [M, h]` (row i through local slot slots[i],
    unweighted, in the expert's output dtype). Build with `from_expert_fn`, `from_rows_fn` or
    `from_weights`; a plain callable passed to a scheme is taken as an `expert_fn`."""

    def __init__(self, rows_fn: RowsFn, num_local: int):
        self.rows_fn, self.num_local = rows_fn, num_local

    @classmethod
    def from_expert_fn(cls, expert_fn: ExpertFn, num_local: int) -> "LocalExperts":
        """expert_fn(local_slot, rows) per expert: each expert that has rows is called once."""

        def rows_fn(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            M = rows.shape[0]
            if M == 0:
                return rows.new_zeros(rows.shape)
            order = torch.argsort(slots, stable=True)
            counts = torch.bincount(slots, minlength=num_local).tolist()
            out, start = None, 0
            for slot, c in enumerate(counts):
                if not c:
                    continue
                idx = order[start:start + c]
                start += c
                y = expert_fn(slot, rows[idx])
                if out is None:
                    out = y.new_empty((M, *y.shape[1:]))
                out[idx] = y
            return out

        return cls(rows_fn, num_local)

    @classmethod
    def from_rows_fn(cls, rows_fn: RowsFn, num_local: int) -> "LocalExperts":
        return cls(rows_fn, num_local)

    @classmethod
    def from_weights(cls, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                     act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *,
                     w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                     w3_scale: torch.Tensor | None = None, fused: Callable | None = None) -> "LocalExperts":
        """The rank's stacked experts: w1 (gate) / w3 (up) [L, I, h], w2 (down) [L, h, I], float or MXFP4
        (uint8 packed with ue8m0 `w*_scale`), as `RoutedExperts` stores them. The rows run through
        `ops.moe.reference.fused_moe_reference` with ids = slots [M, 1] and weights 1 (the expert math
        of the single-device model), or through `fused(rows, w1, w2, w3, ids, weights, **scales)`
        when given (e.g. `functools.partial(ops.moe.triton.fused_moe, activation=..., situ_beta=...)`)."""
        scales = dict(w1_scale=w1_scale, w2_scale=w2_scale, w3_scale=w3_scale) if w1.dtype == torch.uint8 else {}

        def rows_fn(rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
            ids = slots.view(-1, 1)
            ones = torch.ones(ids.shape, dtype=torch.float32, device=rows.device)
            if fused is not None:
                return fused(rows, w1, w2, w3, ids, ones, **scales)
            return fused_moe_reference(rows, w1, w2, w3, ids, ones, act, **scales)

        return cls(rows_fn, w1.shape[0])

    def rows(self, rows: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return self.rows_fn(rows, slots)


def _as_local(experts, num_local: int) -> LocalExperts:
    if isinstance(experts, LocalExperts):
        if experts.num_local != num_local:
            raise ValueError(f"the local experts hold {experts.num_local} experts, the placement gives a rank "
                             f"{num_local}")
        return experts
    if callable(experts):
        return LocalExperts.from_expert_fn(experts, num_local)
    raise TypeError(f"experts must be a LocalExperts or an expert_fn(local_slot, rows), got {type(experts).__name__}")


def _check_inputs(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                  g: EPGroup) -> None:
    if x.dim() != 2 or ids.dim() != 2 or ids.shape != weights.shape or ids.shape[0] != x.shape[0]:
        raise ValueError(f"x must be [N, h] and ids / weights [N, k], got {tuple(x.shape)}, {tuple(ids.shape)}, "
                         f"{tuple(weights.shape)}")
    if placement.ep_size != g.size:
        raise ValueError(f"the placement spreads the experts over {placement.ep_size} ranks, the EP group has {g.size}")


# ------------------------------------------------------------------------------------------------
# (a) replicated tokens: local experts, partial sums reduced over the group


def local_partial(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                  rank: int, experts) -> torch.Tensor:
    """fp32 [N, h]: sum over the pairs (n, j) whose expert lives on `rank` of
    weights[n, j] * expert_{ids[n, j]}(x[n]) (added in token-then-slot order)."""
    experts = _as_local(experts, placement.num_local)
    owner, slot = placement.to_local(ids)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    tok, j = torch.nonzero(owner == rank, as_tuple=True)
    if tok.numel():
        y = experts.rows(x[tok], slot[tok, j])
        out.index_add_(0, tok, y.float() * weights[tok, j].float().unsqueeze(-1))
    return out


def ep_forward_replicated(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                          group: EPGroup, experts=None, *, local_forward: LocalForward | None = None,
                          output: str = "all_reduce", comm_dtype: torch.dtype = torch.float32,
                          out_dtype: torch.dtype | None = None, stats: CommStats | None = None) -> torch.Tensor:
    """Scheme (a). x [N, h], ids / weights [N, k]: the same on every rank of the group. Either `experts`
    (a `LocalExperts` or an expert_fn(local_slot, rows): only this rank's pairs are computed) or
    `local_forward(x, slots, weights)` (static shapes: other ranks' pairs at slot 0 with weight 0).

    output: "all_reduce" -> [N, h] on every rank; "reduce_scatter" -> this rank's rows
    `token_chunk(N, size, rank)`; "partial" -> this rank's own contribution [N, h] (the caller sums
    it over the group). The sum travels in `comm_dtype` (fp32: the single-device combine's precision;
    bf16 halves the bytes and rounds each rank's partial once). Returns out_dtype (default x's dtype;
    with "partial", pass out_dtype=torch.float32 unless the caller wants it rounded).

    `local_forward` should return its partial in fp32 (the torch forms before their final cast, the
    fused MoE with an fp32 `out`): a partial in bf16 is rounded once per rank before the sum; with
    bf16 tokens that moved the result by 2.4e-3 relative RMS on 2 ranks (76 of 224 values), against
    the single-device values themselves here for fp32 partials (tests/test_expert_parallel.py).
    """
    _check_inputs(x, ids, weights, placement, group)
    if (experts is None) == (local_forward is None):
        raise ValueError("pass exactly one of experts (per-expert or rows callables) and local_forward")
    if output not in ("all_reduce", "reduce_scatter", "partial"):
        raise ValueError(f"output must be 'all_reduce', 'reduce_scatter' or 'partial', got {output!r}")
    out_dtype = out_dtype or x.dtype
    if local_forward is not None:
        slots, w = placement.localize(ids, weights, group.rank)
        partial = local_forward(x, slots, w)
    else:
        partial = local_partial(x, ids, weights, placement, group.rank, experts)
    partial = partial.to(comm_dtype)
    if output == "partial":
        return partial.to(out_dtype)
    if output == "all_reduce":
        return _all_reduce(partial, group, stats).to(out_dtype)
    N = x.shape[0]
    c = -(-N // group.size)
    if c * group.size != N:
        partial = torch.cat([partial, partial.new_zeros((c * group.size - N, *partial.shape[1:]))])
    mine = _reduce_scatter(partial, group, stats)
    chunk = token_chunk(N, group.size, group.rank)
    return mine[:chunk.stop - chunk.start].to(out_dtype)


def ep_forward_gathered(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                        group: EPGroup, experts=None, *, local_forward: LocalForward | None = None,
                        token_counts: Sequence[int] | None = None, comm_dtype: torch.dtype = torch.float32,
                        stats: CommStats | None = None) -> torch.Tensor:
    """Scheme (a) for tokens split over the ranks: all-gather every rank's tokens and routing (padded to
    the largest count), run this rank's experts on all of them, reduce-scatter the fp32 partials back
    to their ranks. x [n_r, h] / ids, weights [n_r, k] this rank's tokens -> [n_r, h]. token_counts:
    every rank's n (else all-gathered first, one more collective)."""
    _check_inputs(x, ids, weights, placement, group)
    if group.size == 1:
        return ep_forward_replicated(x, ids, weights, placement, group, experts, local_forward=local_forward,
                                     output="partial", comm_dtype=comm_dtype)
    n, k = ids.shape
    if token_counts is None:
        token_counts = _all_gather(torch.tensor([n], device=x.device), group, stats).tolist()
    token_counts = [int(c) for c in token_counts]
    if len(token_counts) != group.size or token_counts[group.rank] != n:
        raise ValueError(f"token_counts {token_counts} must give each of the {group.size} ranks' token counts "
                         f"(this rank, {group.rank}, has {n})")
    c = max(token_counts)
    if c == 0:
        return x.new_zeros(x.shape)
    pad = c - n
    # ids travel with the weights in one fp32 tensor (exact below 2^24 experts)
    route = torch.cat([weights.float(), ids.float()], dim=1)
    x_all = _all_gather(torch.cat([x, x.new_zeros((pad, x.shape[1]))]), group, stats)
    route_all = _all_gather(torch.cat([route, route.new_zeros((pad, 2 * k))]), group, stats)
    keep = torch.cat([torch.arange(cnt, device=x.device) + r * c for r, cnt in enumerate(token_counts)])
    x_all, route_all = x_all[keep], route_all[keep]
    w_all, ids_all = route_all[:, :k], route_all[:, k:].long()
    partial = ep_forward_replicated(x_all, ids_all, w_all, placement, group, experts, local_forward=local_forward,
                                    output="partial", comm_dtype=comm_dtype, out_dtype=comm_dtype)
    padded = partial.new_zeros((group.size * c, partial.shape[1]))
    padded[keep] = partial
    return _reduce_scatter(padded, group, stats)[:n].to(x.dtype)


# ------------------------------------------------------------------------------------------------
# (b) all-to-all dispatch and combine


def ep_forward_all_to_all(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                          group: EPGroup, experts, *, stats: CommStats | None = None) -> torch.Tensor:
    """Scheme (b). x [n, h], ids / weights [n, k]: this rank's own tokens (n may differ between ranks,
    0 included). Pairs go to their experts' owners and back; each token's k outputs are summed in slot
    order in fp32. Returns [n, h] in x's dtype. Rows travel in x's dtype, outputs in the experts'."""
    _check_inputs(x, ids, weights, placement, group)
    experts = _as_local(experts, placement.num_local)
    W, L = group.size, placement.num_local
    n, k = ids.shape
    owner, slot = placement.to_local(ids)
    key = (owner * L + slot).reshape(-1)  # pairs p = t k + j
    order = torch.argsort(key, stable=True)  # by owner, then slot, then pair
    counts = torch.bincount(key, minlength=W * L)  # [W * L]: pairs per (destination rank, its slot)
    recv_counts = _all_to_all(counts, [L] * W, [L] * W, group, stats, "all_to_all_counts")
    send = counts.view(W, L).sum(1).tolist()
    recv = recv_counts.view(W, L).sum(1).tolist()
    rows = _all_to_all(x[order // k], send, recv, group, stats, "all_to_all_dispatch")
    slots = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), recv_counts)
    y = experts.rows(rows, slots)
    if y.shape[0] != rows.shape[0]:
        raise ValueError(f"the local experts returned {y.shape[0]} rows for {rows.shape[0]}")
    back = _all_to_all(y, recv, send, group, stats, "all_to_all_combine")
    pair_y = torch.empty_like(back)
    pair_y[order] = back
    pair_y = pair_y.view(n, k, *back.shape[1:])
    w = weights.float()
    out = torch.zeros((n, *back.shape[1:]), dtype=torch.float32, device=x.device)
    for j in range(k):  # each token's slots in order: the same sum at any rank count
        out += pair_y[:, j].float() * w[:, j:j + 1]
    return out.to(x.dtype)


def ep_forward_all_to_all_replicated(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                                     placement: ExpertPlacement, group: EPGroup, experts, *,
                                     stats: CommStats | None = None) -> torch.Tensor:
    """Scheme (b) from the replicated layout: rank r takes rows `token_chunk(N, size, r)`, runs
    `ep_forward_all_to_all`, and the outputs are all-gathered (x's dtype) so every rank has [N, h]."""
    _check_inputs(x, ids, weights, placement, group)
    N = x.shape[0]
    chunk = token_chunk(N, group.size, group.rank)
    mine = ep_forward_all_to_all(x[chunk], ids[chunk], weights[chunk], placement, group, experts, stats=stats)
    if group.size == 1:
        return mine
    c = -(-N // group.size)
    mine = torch.cat([mine, mine.new_zeros((c - mine.shape[0], *mine.shape[1:]))])
    return _all_gather(mine, group, stats)[:N]


# ------------------------------------------------------------------------------------------------
# convenience: a whole routed-experts forward from the stacked local weights


SCHEMES = ("replicated", "reduce_scatter", "all_to_all", "all_to_all_replicated", "gathered")


def routed_experts_forward(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, placement: ExpertPlacement,
                           group: EPGroup, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor,
                           act: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], *, scheme: str = "replicated",
                           w1_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
                           w3_scale: torch.Tensor | None = None, fused: Callable | None = None,
                           stats: CommStats | None = None, **kwargs) -> torch.Tensor:
    """The routed experts of one layer under expert parallelism, from this rank's stacked experts
    (w1 / w3 [L, I, h], w2 [L, h, I], float or MXFP4 with scales; `LocalExperts.from_weights`).
    scheme: "replicated" (a, all-reduce), "reduce_scatter" (a, token chunk out), "gathered" (a with
    split tokens), "all_to_all" (b, split tokens), "all_to_all_replicated" (b from replicated tokens).
    Equals `ops.moe.reference.fused_moe_reference` on all E experts within fp32 rounding."""
    if tuple(w1.shape[:1]) != (placement.num_local,):
        raise ValueError(f"the stacked local weights hold {w1.shape[0]} experts, the placement gives a rank "
                         f"{placement.num_local}")
    experts = LocalExperts.from_weights(w1, w2, w3, act, w1_scale=w1_scale, w2_scale=w2_scale, w3_scale=w3_scale,
                                        fused=fused)
    if scheme == "replicated":
        return ep_forward_replicated(x, ids, weights, placement, group, experts, stats=stats, **kwargs)
    if scheme == "reduce_scatter":
        return ep_forward_replicated(x, ids, weights, placement, group, experts, output="reduce_scatter",
                                     stats=stats, **kwargs)
    if scheme == "gathered":
        return ep_forward_gathered(x, ids, weights, placement, group, experts, stats=stats, **kwargs)
    if scheme == "all_to_all":
        return ep_forward_all_to_all(x, ids, weights, placement, group, experts, stats=stats, **kwargs)
    if scheme == "all_to_all_replicated":
        return ep_forward_all_to_all_replicated(x, ids, weights, placement, group, experts, stats=stats, **kwargs)
    raise ValueError(f"scheme must be one of {SCHEMES}, got {scheme!r}")
