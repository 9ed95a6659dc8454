"""Expert parallelism (`kimiserve.distributed.expert_parallel`): the placement table, and both schemes on
2, 3 and 4 gloo ranks (one process each, conftest's `ranks`) against the single-process routed-experts forward
(`ops.moe.reference.experts_forward` over all E experts).

Bound (fp32). Both paths run the same expert math on the same fp32 values; what may differ is (i) the
row batch each expert GEMM sees (a BLAS may block, hence round, [m, h] @ [h, I] differently for
another m) and (ii) the order of the fp32 sum of a token's k weighted outputs (and, for scheme (a),
of the ranks' partials in the all-reduce). Each is a few units of fp32 rounding u = 2^-24 ~ 6e-8 per
dot of length <= 32 and per sum of <= 4 terms: rounding differences of O(10 u) ~ 1e-6 relative (seen
here: <= 2.6e-7 on 2-4 ranks; bf16: identical values). The bound 1e-5 (~170 u) leaves margin for any
CPU / BLAS / thread count, and is three orders of magnitude below the smallest real bug (a pair lost,
doubled, sent to the wrong expert or given the wrong weight moves the output by 1e-2 to 1: k <= 4
outputs per token of similar size; two such mutations of the module gave 0.3 and 0.5).
bf16 tokens: the outputs are rounded to bf16 (ulp 2^-8 relative) and a rounding difference above may
flip the last bit of some elements: 8e-3 relative RMS (about two bf16 ulps).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from kimiserve.distributed.expert_parallel import (
    CommStats,
    EPGroup,
    ExpertPlacement,
    LocalExperts,
    ep_forward_all_to_all,
    ep_forward_all_to_all_replicated,
    ep_forward_gathered,
    ep_forward_replicated,
    routed_experts_forward,
    token_chunk,
)
from kimiserve.ops.activation.reference import situ_and_mul
from kimiserve.ops.moe.reference import experts_forward, fused_moe_reference
from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4

E, H, INTER = 12, 32, 32  # 12 experts: divisible by 2, 3 and 4
FP32_BOUND, BF16_BOUND = 1e-5, 8e-3
CASES = ("random", "permuted", "one_rank", "idle_experts", "k1", "n1", "odd_n", "lopsided", "mxfp4", "bf16")


def act(gate, up):
    return situ_and_mul(gate, up, 4.0, 25.0)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def make_case(name: str, world: int, seed: int = 0) -> dict:
    """Deterministic inputs (every rank and the parent build the same ones)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{world}/{seed}".encode()))  # same in every process
    N, k = {"k1": (6, 1), "n1": (1, 4), "odd_n": (2 * world + 1, 3), "lopsided": (5, 3)}.get(name, (7, 3))
    dtype = torch.bfloat16 if name == "bf16" else torch.float32
    x = torch.randn(N, H, generator=g).to(dtype)
    weights = torch.rand(N, k, generator=g) + 0.1
    weights = weights / weights.sum(-1, keepdim=True)
    if name in ("permuted", "odd_n", "lopsided"):
        placement = ExpertPlacement.from_permutation(torch.randperm(E, generator=g), world)
    else:
        placement = ExpertPlacement.contiguous(E, world)
    if name == "one_rank":  # every token's experts live on the last rank
        pool = torch.tensor(placement.local_experts(world - 1))
    elif name == "idle_experts":  # two experts take every token; the others (and whole ranks) get none
        pool = torch.tensor([1, 2]) if k <= 2 else torch.tensor([1, 2, 5])
    else:
        pool = torch.arange(E)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(N)])
    w1 = torch.randn(E, INTER, H, generator=g) * H**-0.5
    w3 = torch.randn(E, INTER, H, generator=g) * H**-0.5
    w2 = torch.randn(E, H, INTER, generator=g) * INTER**-0.5
    case = dict(name=name, x=x, ids=ids, weights=weights, placement=placement, w1=w1, w2=w2, w3=w3, scales={})
    if name == "mxfp4":
        packed = {n: quantize_mxfp4(w) for n, w in (("w1", w1), ("w2", w2), ("w3", w3))}
        for n, (q, s) in packed.items():
            case[n] = q
            case["scales"][f"{n}_scale"] = s
    # tokens split over the ranks for the split-token schemes: contiguous chunks, or all on the last rank
    if name == "lopsided":
        case["split"] = [slice(0, 0)] * (world - 1) + [slice(0, N)]
    else:
        case["split"] = [token_chunk(N, world, r) for r in range(world)]
    return case


def reference(case: dict) -> torch.Tensor:
    """The single-process routed experts: `experts_forward` over all E experts, each run as the model's
    `RoutedExperts.run_expert` does (weights dequantised to the tokens' dtype)."""

    def weight(name: str, e: int, dtype: torch.dtype) -> torch.Tensor:
        if case["scales"]:
            return dequantize_mxfp4(case[name][e], case["scales"][f"{name}_scale"][e], dtype)
        return case[name][e].to(dtype)

    def expert(e: int, rows: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (weight(n, e, rows.dtype) for n in ("w1", "w2", "w3"))
        return act(rows @ w1.T, rows @ w3.T) @ w2.T

    return experts_forward(case["x"], case["ids"], case["weights"], expert, E)


def local_weights(case: dict, rank: int) -> dict:
    """What rank `rank` holds: its experts' stacked weights in slot order (the loader's view)."""
    experts = torch.tensor([e for _, e in case["placement"].checkpoint_experts(rank)])
    out = {n: case[n][experts] for n in ("w1", "w2", "w3")}
    out.update({n: s[experts] for n, s in case["scales"].items()})
    return out


def expert_fn_for(case: dict, rank: int):
    w = local_weights(case, rank)

    def expert_fn(slot, rows):  # one expert at a time, as the model's run_expert
        ids = torch.zeros(rows.shape[0], 1, dtype=torch.int64)
        one = {n: w[n][slot:slot + 1] for n in w}
        scales = {n: one[n] for n in case["scales"]}
        return fused_moe_reference(rows, one["w1"], one["w2"], one["w3"], ids, torch.ones(ids.shape), act, **scales)

    return expert_fn


def run_case(case: dict, group: EPGroup) -> dict:
    """Every scheme on one rank; tensors back to the parent, plus the traffic of each scheme."""
    r = group.rank
    x, ids, weights, placement = case["x"], case["ids"], case["weights"], case["placement"]
    w = local_weights(case, r)
    scales = {n: w[n] for n in case["scales"]}
    expert_fn = expert_fn_for(case, r)
    stacked = LocalExperts.from_weights(w["w1"], w["w2"], w["w3"], act, **scales)
    mine = case["split"][r]
    out, traffic = {}, {}

    def timed(label, fn):
        stats = CommStats()
        out[label] = fn(stats)
        traffic[label] = (stats.collectives, stats.bytes_sent, dict(stats.by_op))

    timed("a_all_reduce", lambda s: ep_forward_replicated(x, ids, weights, placement, group, expert_fn, stats=s))
    timed("a_reduce_scatter", lambda s: ep_forward_replicated(x, ids, weights, placement, group, stacked,
                                                             output="reduce_scatter", stats=s))

    def static_forward(xx, slots, ww):  # shapes fixed by N and k; an fp32 partial (other ranks' pairs weigh 0)
        y = torch.zeros(xx.shape, dtype=torch.float32)
        for j in range(slots.shape[1]):
            yj = fused_moe_reference(xx, w["w1"], w["w2"], w["w3"], slots[:, j:j + 1], torch.ones(len(xx), 1), act,
                                     **scales)
            y += yj.float() * ww[:, j:j + 1]
        return y

    timed("a_static", lambda s: ep_forward_replicated(x, ids, weights, placement, group, stats=s,
                                                      local_forward=static_forward))
    partial = ep_forward_replicated(x, ids, weights, placement, group, stacked, output="partial",
                                    out_dtype=torch.float32)
    torch.distributed.all_reduce(partial)  # the caller's own sum (the model folds in the shared experts)
    out["a_partial"] = partial.to(x.dtype)
    # token counts given (as a scheduler knows them) in some cases, all-gathered in the others
    counts = [s.stop - s.start for s in case["split"]] if case["name"] in ("k1", "odd_n", "lopsided") else None
    timed("a_gathered", lambda s: ep_forward_gathered(x[mine], ids[mine], weights[mine], placement, group, stacked,
                                                      token_counts=counts, stats=s))
    timed("b_all_to_all", lambda s: ep_forward_all_to_all(x[mine], ids[mine], weights[mine], placement, group,
                                                          expert_fn, stats=s))
    timed("b_replicated", lambda s: ep_forward_all_to_all_replicated(x, ids, weights, placement, group, stacked,
                                                                     stats=s))
    out["convenience_a2a"] = routed_experts_forward(x[mine], ids[mine], weights[mine], placement, group, w["w1"],
                                                    w["w2"], w["w3"], act, scheme="all_to_all", **scales)
    out["convenience_rs"] = routed_experts_forward(x, ids, weights, placement, group, w["w1"], w["w2"], w["w3"], act,
                                                   scheme="reduce_scatter", **scales)
    # what each rank computed itself under (b): the pairs it received (for the traffic check)
    owner, _ = placement.to_local(ids[mine])
    sent_off_rank = int((owner != r).sum())
    return dict(out=out, traffic=traffic, sent_off_rank=sent_off_rank)


def ranks_check(rank, world_size, names):
    torch.manual_seed(rank)
    group = EPGroup.world()
    return {name: run_case(make_case(name, world_size), group) for name in names}


SPLIT_OUTPUTS = ("a_gathered", "b_all_to_all", "convenience_a2a")  # rows case["split"][r] on rank r
CHUNK_OUTPUTS = ("a_reduce_scatter", "convenience_rs")  # rows token_chunk(N, W, r) on rank r
FULL_OUTPUTS = ("a_all_reduce", "a_static", "a_partial", "b_replicated")  # every token on every rank


def assemble(results: list, name: str, label: str, case: dict, world: int) -> torch.Tensor:
    x = case["x"]
    if label in FULL_OUTPUTS:
        outs = [res[name]["out"][label] for res in results]
        for o in outs[1:]:  # every rank holds the same sum (one all-reduce / all-gather)
            assert torch.equal(o, outs[0]), (name, label)
        return outs[0]
    rows = case["split"] if label in SPLIT_OUTPUTS else [token_chunk(x.shape[0], world, r) for r in range(world)]
    full = torch.full(x.shape, float("nan"), dtype=x.dtype)
    for r, res in enumerate(results):
        got = res[name]["out"][label]
        assert got.shape == (rows[r].stop - rows[r].start, x.shape[1]), (name, label, r, tuple(got.shape))
        full[rows[r]] = got
    return full


@pytest.mark.parametrize("world", [2, 3, 4])
def test_schemes_equal_single_process(ranks, world):
    results = ranks.run(world, ranks_check, CASES, timeout=150)
    for name in CASES:
        case = make_case(name, world)
        ref = reference(case)
        assert ref.abs().max() > 0
        bound = BF16_BOUND if name == "bf16" else FP32_BOUND
        for label in (*FULL_OUTPUTS, *CHUNK_OUTPUTS, *SPLIT_OUTPUTS):
            got = assemble(results, name, label, case, world)
            assert got.dtype == ref.dtype and not got.isnan().any(), (name, label)
            err = rel_rms(got, ref)
            assert err <= bound, f"{name} / {label} on {world} ranks: relative RMS {err:.2e} > {bound:.0e}"
        # traffic: one collective for (a) replicated, three for (b) (+ an all-gather from replicated tokens)
        for r, res in enumerate(results):
            t = res[name]["traffic"]
            assert t["a_all_reduce"][0] == 1 and t["a_reduce_scatter"][0] == 1 and t["b_all_to_all"][0] == 3
            assert t["b_replicated"][0] == 4
            row = case["x"].element_size() * H
            assert t["b_all_to_all"][2]["all_to_all_dispatch"] == (1, res[name]["sent_off_rank"] * row)
            n = case["x"].shape[0]
            assert t["a_all_reduce"][1] == round(2 * (world - 1) / world * n * H * 4)


def test_one_rank_is_the_identity_layout():
    """EP size 1 (no torch.distributed): every scheme is the single-process forward."""
    case = make_case("permuted", 1)
    ref = reference(case)
    group = EPGroup()
    assert not case["placement"].is_contiguous()  # the stacked weights are in the placement's slot order
    lw = local_weights(case, 0)
    experts = LocalExperts.from_weights(lw["w1"], lw["w2"], lw["w3"], act)
    x, ids, w, p = case["x"], case["ids"], case["weights"], case["placement"]
    for got in (ep_forward_replicated(x, ids, w, p, group, experts),
                ep_forward_replicated(x, ids, w, p, group, experts, output="reduce_scatter"),
                ep_forward_gathered(x, ids, w, p, group, experts),
                ep_forward_all_to_all(x, ids, w, p, group, experts),
                ep_forward_all_to_all_replicated(x, ids, w, p, group, experts)):
        assert rel_rms(got, ref) <= FP32_BOUND


# ------------------------------------------------------------------------------------------------
# the placement table


def test_contiguous_placement():
    p = ExpertPlacement.contiguous(896, 8)
    assert p.num_local == 112 and p.local_experts(3) == list(range(336, 448)) and p.is_contiguous()
    assert (p.owner(500), p.local_index(500), p.global_expert(4, 52)) == (4, 52, 500)
    ids = torch.tensor([[0, 111, 112], [895, 448, 7]])
    owner, slot = p.to_local(ids)
    assert owner.tolist() == [[0, 0, 1], [7, 4, 0]] and slot.tolist() == [[0, 111, 0], [111, 0, 7]]
    assert ExpertPlacement.for_context(8, type("Ctx", (), {"ep_size": 2})()) == ExpertPlacement.contiguous(8, 2)


def test_permuted_placement_and_loader_view():
    p = ExpertPlacement([[5, 0], [3, 1], [2, 4]])
    assert not p.is_contiguous() and p.num_local == 2
    assert [p.owner(e) for e in range(6)] == [0, 1, 2, 1, 2, 0]
    assert [p.local_index(e) for e in range(6)] == [1, 1, 0, 0, 1, 0]
    assert p.checkpoint_experts(0) == [(0, 5), (1, 0)]  # rank 0 reads checkpoint experts 5 and 0 only
    assert p.local_index_table(1).tolist() == [-1, 1, -1, 0, -1, -1]
    ids = torch.tensor([[5, 3, 4], [0, 1, 2]])
    owner, slot = p.to_local(ids)
    assert owner.tolist() == [[0, 1, 2], [0, 1, 2]] and slot.tolist() == [[0, 0, 1], [1, 1, 0]]
    slots, w = p.localize(ids, torch.full((2, 3), 0.5), rank=2)
    assert slots.tolist() == [[0, 0, 1], [0, 0, 0]] and w.tolist() == [[0, 0, 0.5], [0, 0, 0.5]]
    assert ExpertPlacement.from_dict(p.to_dict()) == p and hash(p) == hash(ExpertPlacement(p.to_dict()["rank_experts"]))
    assert ExpertPlacement.from_owners([0, 1, 2, 1, 2, 0]) == ExpertPlacement([[0, 5], [1, 3], [2, 4]])
    assert ExpertPlacement.from_permutation([5, 0, 3, 1, 2, 4], 3) == p


@pytest.mark.parametrize("build, message", [
    (lambda: ExpertPlacement([[0, 1], [1, 2]]),
     r"placed exactly once: placed twice: 1 \(ranks 0 and 1\); not placed: \[3\]"),
    (lambda: ExpertPlacement([[0, 1], [2, 4]]), r"expert ids must be in 0\.\.3 .* got \[4\]"),
    (lambda: ExpertPlacement([[0, 1, 2], [3]]), r"same positive number of experts .* \[3, 1\]"),
    (lambda: ExpertPlacement([[0, 1], []]), r"same positive number of experts"),
    (lambda: ExpertPlacement([]), r"non-empty list"),
    (lambda: ExpertPlacement([[0, 1.0]]), r"must be integers"),
    (lambda: ExpertPlacement.contiguous(12, 5),
     r"num_experts = 12\) are not divisible by the expert-parallel size \(5\)"),
    (lambda: ExpertPlacement.contiguous(12, 0), r"positive integer"),
    (lambda: ExpertPlacement.from_permutation([0, 1, 2, 2], 2), r"placed twice: 2"),
    (lambda: ExpertPlacement.from_owners([0, 0, 2, 2], 3), r"same positive number .* \[2, 0, 2\]"),
    (lambda: ExpertPlacement.from_owners([0, 3], 2), r"must be < ep_size \(2\)"),
    (lambda: ExpertPlacement.from_dict({"num_experts": 6, "ep_size": 2, "rank_experts": [[0], [1]]}), r"says 6"),
    (lambda: ExpertPlacement.contiguous(4, 2).owner(4), r"expert must be in 0\.\.3"),
    (lambda: ExpertPlacement.contiguous(4, 2).local_experts(2), r"rank must be in 0\.\.1"),
])
def test_bad_placements_raise(build, message):
    with pytest.raises(ValueError, match=message):
        build()


def test_mismatched_group_and_experts_raise_before_any_collective():
    case = make_case("random", 3)
    x, ids, w, p = case["x"], case["ids"], case["weights"], case["placement"]
    experts = LocalExperts.from_weights(*(case[n][:4] for n in ("w1", "w2", "w3")), act)
    with pytest.raises(ValueError, match="over 3 ranks, the EP group has 2"):
        ep_forward_all_to_all(x, ids, w, p, EPGroup(0, 2), experts)
    with pytest.raises(ValueError, match="hold 4 experts, the placement gives a rank 6"):
        routed_experts_forward(x, ids, w, ExpertPlacement.contiguous(E, 2), EPGroup(0, 2),
                               *(case[n][:4] for n in ("w1", "w2", "w3")), act)
    with pytest.raises(ValueError, match="exactly one of experts"):
        ep_forward_replicated(x, ids, w, p, EPGroup(0, 3))
    with pytest.raises(ValueError, match="output must be"):
        ep_forward_replicated(x, ids, w, p, EPGroup(0, 3), experts, output="scatter")
