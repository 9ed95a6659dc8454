"""Triton `topk_indices` against `reference.topk_reference` (causal_topk at query position
lengths - 1, -inf never selected), plus a timing report.

The selected SET must equal the reference's exactly (ties: earlier position wins; -inf never
selected; -1 padding); the kernel returns the selected positions in increasing order, then -1, which
is checked too. Outputs start as a sentinel (int64 has no NaN): a missing write shows up.

Interpreter smoke checks (CPU, small sizes): tests/test_triton_topk_interpret.py.
"""

import statistics
import time

import pytest
import torch

from kimiserve.ops.topk.reference import topk_reference
from kimiserve.utils.cuda_timing import cuda_time

pytestmark = pytest.mark.gpu

SENTINEL = 0x7EADBEEF


def make_scores(kind: str, B: int, S: int, device: str = "cuda") -> torch.Tensor:
    """fp32 [B, S] scores of one family: random normal, few distinct values, all equal, -inf holes,
    mixed-sign magnitudes 2^-120..2^120, values within 1% (one radix bucket), ReLU zeros, +-0 and inf,
    a noisy ramp (the best scores all in the last blocks: candidate slots overflow)."""
    g = torch.randn(B, S, device=device)
    if kind == "randn":
        return g
    if kind == "few":
        return torch.randint(-2, 3, (B, S), device=device).float()
    if kind == "equal":
        return torch.full((B, S), 0.75, device=device)
    if kind == "ninf":
        g[torch.rand(B, S, device=device) < 0.3] = float("-inf")
        g[0, : S // 2] = float("-inf")
        if B > 1:
            g[-1] = float("-inf")
        return g
    if kind == "wide":
        return g.sign() * torch.exp2(torch.empty(B, S, device=device).uniform_(-120, 120))
    if kind == "narrow":
        return 1.0 + 0.01 * torch.rand(B, S, device=device)
    if kind == "relu":
        return g.relu()
    if kind == "ramp":
        return torch.arange(S, device=device).float()[None, :] * 1e-3 + 0.1 * g
    if kind == "zeros_inf":
        x = torch.zeros(B, S, device=device)
        x[torch.rand(B, S, device=device) < 0.5] = -0.0
        x[:, ::97] = float("inf")
        return x
    raise ValueError(kind)


def check_topk(scores: torch.Tensor, k: int, lengths: torch.Tensor | None = None, **tuning) -> torch.Tensor:
    """topk_indices vs topk_reference: equal sets per row, increasing positions, -1 tail."""
    from kimiserve.ops.topk.triton import topk_indices

    B = scores.shape[0]
    out = torch.full((B, k), SENTINEL, dtype=torch.int64, device=scores.device)
    got = topk_indices(scores, k, lengths, out=out, **tuning)
    assert got.data_ptr() == out.data_ptr()
    want = topk_reference(scores, k, lengths)
    gs, ws = got.sort(dim=1).values, want.sort(dim=1).values
    if not torch.equal(gs, ws):
        bad = (gs != ws).any(dim=1).nonzero()[:, 0].tolist()
        b = bad[0]
        extra = sorted(set(got[b].tolist()) - set(want[b].tolist()))[:10]
        missing = sorted(set(want[b].tolist()) - set(got[b].tolist()))[:10]
        raise AssertionError(f"rows {bad[:8]} differ; row {b}: extra {extra}, missing {missing}")
    n = (got >= 0).sum(dim=1, keepdim=True)
    slot = torch.arange(k, device=got.device)[None, :]
    assert (got[slot >= n] == -1).all(), "padding not at the tail"
    inc = got[:, 1:] > got[:, :-1]
    assert inc[slot[:, 1:] < n].all(), "selected positions not increasing"
    return got


@pytest.mark.parametrize("B", [1, 3, 17])
@pytest.mark.parametrize("k", [1, 8, 2048])
@pytest.mark.parametrize("S", [1, 7, 2047, 2048, 2049, 100_003, 1_048_576])
def test_random(S, k, B):
    check_topk(make_scores("randn", B, S), k)


@pytest.mark.parametrize("kind", ["few", "equal", "ninf", "wide", "narrow", "relu", "zeros_inf", "ramp"])
@pytest.mark.parametrize("S", [7, 2049, 100_003, 1_048_576])
@pytest.mark.parametrize("k", [1, 8, 2048])
def test_families(kind, S, k):
    """Exact ties (few distinct values, all equal, +-0), -inf holes and whole -inf rows, extreme ranges."""
    check_topk(make_scores(kind, 3, S), k)


@pytest.mark.parametrize("kind", ["randn", "few", "ninf"])
@pytest.mark.parametrize("S", [7, 2049, 100_003])
@pytest.mark.parametrize("k", [8, 2048])
def test_lengths(kind, S, k):
    """lengths < S (0, 1, below k, at k, random, S, past S) in int64 and int32."""
    fixed = [0, 1, min(S, k - 1), min(S, k), S, S + 5]
    lens = torch.tensor(fixed + torch.randint(0, S + 1, (11,)).tolist(), device="cuda")
    scores = make_scores(kind, len(lens), S)
    check_topk(scores, k, lens)
    check_topk(scores, k, lens.int())


@pytest.mark.parametrize("tuning", [dict(block=256, window=32, sparse=4, group=4, cap=16),
                                    dict(block=1024, num_warps=4, window=64, sparse=16, group=1, cap=2048),
                                    dict(block=2048, num_warps=4, slot_warps=8, group=8, cap=1, maxnreg=None)])
@pytest.mark.parametrize("kind", ["randn", "few", "wide", "narrow", "relu", "ramp"])
def test_tuning_paths(kind, tuning):
    """Other tunings force the other paths: histogram windows, per-element atomics, no pass 0,
    candidate slots overflowing (cap=1) or never (cap=2048)."""
    lens = torch.tensor([100_003, 99_000, 5_000], device="cuda")
    check_topk(make_scores(kind, 3, 100_003), 2048, lens, **tuning)


def test_strided_rows_and_k_past_s():
    big = torch.randn(5, 3000, device="cuda")
    check_topk(big[:, 3 : 3 + 2049], 2048)  # row stride 3000, unaligned start
    check_topk(big[:, :100], 2048)  # k > S: -1 padded
    check_topk(big[:, :100], 100, torch.tensor([0, 50, 99, 100, 3], device="cuda"))


def test_cuda_graph():
    """Capture once, replay on new scores and lengths (no host sync inside)."""
    from kimiserve.ops.topk.triton import topk_indices

    B, S, k = 3, 100_003, 2048
    scores = make_scores("randn", B, S)
    lens = torch.tensor([S, 70_000, 1000], device="cuda")
    out = torch.empty(B, k, dtype=torch.int64, device="cuda")
    topk_indices(scores, k, lens, out=out)  # compile outside the capture
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        topk_indices(scores, k, lens, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    for kind in ("randn", "few", "ninf"):
        scores.copy_(make_scores(kind, B, S))
        lens.copy_(torch.randint(0, S + 1, (B,), device="cuda"))
        out.fill_(SENTINEL)
        graph.replay()
        want = topk_reference(scores, k, lens)
        assert torch.equal(out.sort(1).values, want.sort(1).values), kind


def _median_wall_ms(fn, reps: int = 20) -> float:
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def _graphed(fn):
    """fn captured in a CUDA graph (launch overhead gone): returns graph.replay."""
    fn()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph.replay


def _kernel_us(fn, reps: int = 20) -> tuple[float, str]:
    """GPU time of one fn() call summed over its kernels and memsets (profiler), in us, and the
    per-kernel breakdown."""
    from collections import defaultdict

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    per = defaultdict(float)
    for e in prof.events():
        if e.device_type == DeviceType.CUDA:
            per[e.name[:40]] += e.time_range.elapsed_us() / reps
    return sum(per.values()), ", ".join(f"{n} {t:.1f}" for n, t in per.items())


def time_topk(B: int, S: int, k: int, kind: str = "randn", **tuning) -> list[str]:
    """Timing lines for topk_indices (with `tuning` passed through) and torch.topk on one input."""
    from kimiserve.ops.topk.triton import topk_indices

    scores = make_scores(kind, B, S)
    out = torch.empty(B, k, dtype=torch.int64, device="cuda")
    ours = lambda: topk_indices(scores, k, out=out, **tuning)  # noqa: E731
    theirs = lambda: torch.topk(scores, k, dim=1)  # noqa: E731
    lines = [f"topk B={B} S={S} k={k} ({kind} scores{', ' + str(tuning) if tuning else ''}), medians of 20:"]
    for name, fn in (("topk_indices", ours), ("torch.topk", theirs)):
        ev, wall, (kernels, parts) = cuda_time(fn), _median_wall_ms(fn), _kernel_us(fn)
        try:
            graph = f"{cuda_time(_graphed(fn)) * 1e3:.1f} us"
        except RuntimeError as e:  # capture refused
            graph = f"n/a ({str(e).splitlines()[0][:60]})"
        lines.append(f"  {name:12s} kernels {kernels:.1f} us | CUDA graph replay {graph} | "
                     f"eager: events {ev * 1e3:.1f} us, wall {wall * 1e3:.1f} us")
        lines.append(f"    per kernel (us): {parts}")
    return lines


@pytest.mark.timing
@pytest.mark.parametrize("B, S", [(1, 1_048_576), (64, 131_072)])
def test_topk_timing(B, S, capsys):
    check_topk(make_scores("randn", B, S), 2048)
    with capsys.disabled():
        print("\n" + "\n".join(time_topk(B, S, 2048)))
        if B == 1:  # candidates clustered at the end of the row: slot overflow, full-block paths
            print("\n".join(time_topk(B, S, 2048, "ramp")))


def test_nan_ranks_above_inf():
    """NaN scores rank above +inf, ties among NaNs by position (torch.sort's order)."""
    x = make_scores("randn", 3, 50_000)
    x[:, ::1000] = float("nan")
    x[:, 5::999] = float("inf")
    for k in (8, 2048):
        check_topk(x, k)
