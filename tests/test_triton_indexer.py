"""Triton `paged_indexer_scores` against the reference, plus a bandwidth report for the lead.

Keys live in page-strided views of a real page pool (the K3.1 layout for 32 heads x 128, a
custom Region-based pool for other head dims), pages are scattered in random order, and every byte
no sequence owns is 0xFF (NaN for e4m3 and bf16) and the output starts as NaN: a stray read or a
missing write shows up as NaN. Scores must match within rel RMS 1e-4 (the operands of the dot are
the reference's bf16 values; only the summation order differs; the measured error is printed, it
is ~1e-7 under the interpreter) and be -inf exactly at s >= context_len.

Interpreter smoke check without a GPU (small sizes, CPU tensors):
    python tests/test_triton_indexer.py
"""

import os

if __name__ == "__main__":  # must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import statistics

import pytest
import torch

from conftest import rel_rms
from kimiserve.cache.formats import store_index_key
from kimiserve.cache.layout import CacheLayout, Region
from kimiserve.config import load_preset
from kimiserve.ops.indexer.reference import paged_indexer_scores as reference_scores
from kimiserve.ops.quant.reference import FP8_DTYPE

pytestmark = pytest.mark.gpu

TOL = 1e-4


def _key_views(kv: str, num_pages: int, block_size: int | None, D: int, device: str, preset: str = "kimi-k3.1-pro",
               scale_offset: int = 0):
    """(key_cache, key_scales) as strided views of a 0xFF-filled pool: bf16 / e4m3 keys [P, bs, D]
    with fp32 scales [P, bs] (e4m3), or MXFP4 codes [P, bs, 16 * groups] with ue8m0 scales [P, bs,
    groups] (fp4). block_size None: a real layout's last indexed layer (the preset's block size),
    else one custom region; scale_offset shifts the custom scale region off its alignment."""
    if block_size is None:
        layout = CacheLayout.from_config(load_preset(preset), kv, torch.bfloat16)
        key, page_bytes = layout.index_key[-1], layout.page_bytes
        scale = layout.index_scale[-1] if layout.index_scale else None
    else:
        groups = -(-D // 32)
        if kv == "fp4":
            key = Region(48, torch.uint8, (block_size, 16 * groups))
            scale = Region(-(-(48 + key.nbytes) // 16) * 16 + scale_offset, torch.uint8, (block_size, groups))
        else:
            key = Region(48, FP8_DTYPE if kv == "fp8" else torch.bfloat16, (block_size, D))
            scale = Region(-(-(48 + key.nbytes) // 16) * 16, torch.float32, (block_size,)) if kv == "fp8" else None
        page_bytes = -(-(scale.offset + scale.nbytes if scale else 48 + key.nbytes) // 16) * 16 + 112
    pool = torch.full((num_pages, page_bytes), 0xFF, dtype=torch.uint8, device=device)
    return key.view(pool), scale.view(pool) if scale is not None else None


def realistic_keys(n: int, D: int, device: str) -> torch.Tensor:
    """Gaussian keys with per-token magnitudes over 2^-3..2^3 and a few outlier channels (x8 .. x30),
    as index keys have: what MXFP4's shared group scales must cope with."""
    keys = torch.randn(n, D, device=device) * torch.exp2(torch.randint(-3, 4, (n, 1), device=device).float())
    outliers = torch.arange(3, D, max(4, D // 5), device=device)
    keys[:, outliers] *= torch.linspace(8, 30, len(outliers), device=device)
    return keys


def make_case(kv: str, lens: list[int], H: int, D: int, device: str, block_size: int | None = None,
              q_dtype: torch.dtype = torch.bfloat16, spare_pages: int = 3, preset: str = "kimi-k3.1-pro",
              scale_offset: int = 0):
    """Random q, weights and a paged index-key cache holding len(lens) sequences in scattered pages."""
    bs = block_size or CacheLayout.from_config(load_preset(preset), kv, torch.bfloat16).block_size
    need = [-(-n // bs) for n in lens]
    P = sum(need) + spare_pages
    key_cache, key_scales = _key_views(kv, P, block_size, D, device, preset, scale_offset)
    perm = torch.randperm(P, device=device)
    tables = torch.full((len(lens), max(need) + 1), int(perm[-1]), dtype=torch.int32, device=device)
    used = 0
    for b, n in enumerate(lens):
        tables[b, : need[b]] = perm[used : used + need[b]]
        used += need[b]
        pos = torch.arange(n, device=device)
        pages, offsets = tables[b, pos // bs].long(), pos % bs
        keys = realistic_keys(n, D, device)
        if key_scales is not None:
            codes, scales = store_index_key(keys, kv)
            key_cache[pages, offsets] = codes
            key_scales[pages, offsets] = scales
        else:
            key_cache[pages, offsets] = keys.bfloat16()
    q = torch.randn(len(lens), H, D, device=device).to(q_dtype)
    w = torch.randn(len(lens), H, device=device) * D**-0.5
    return q, w, key_cache, key_scales, tables, torch.tensor(lens, device=device)


def check_scores(kv: str, lens: list[int], H: int, D: int, device: str = "cuda", block_size: int | None = None,
                 dtype: torch.dtype = torch.bfloat16, q_dtype: torch.dtype = torch.bfloat16, extra: int = 0,
                 preset: str = "kimi-k3.1-pro", scale_offset: int = 0, **launch) -> float:
    """Triton vs reference on one random case; returns the rel RMS error of the finite scores. The
    output is a NaN-filled view of a wider buffer: columns past max_context must stay NaN."""
    from kimiserve.ops.indexer.triton import paged_indexer_scores

    q, w, kc, ks, tables, ctx = make_case(kv, lens, H, D, device, block_size, q_dtype, preset=preset,
                                          scale_offset=scale_offset)
    ref = reference_scores(q, w, kc, ks, tables, ctx, dtype)
    S = max(lens) + extra
    wide = torch.full((len(lens), S + 7), float("nan"), device=device)
    out = wide[:, :S]
    got = paged_indexer_scores(q, w, kc, ks, tables, ctx, dtype, max_context=S, out=out, **launch)
    assert got.data_ptr() == out.data_ptr() and got.shape == (len(lens), S)
    assert wide[:, S:].isnan().all(), "a column past max_context was written"
    visible = torch.arange(S, device=device)[None, :] < ctx[:, None]
    assert torch.isfinite(got[visible]).all(), "a visible score is not finite (stray read of a NaN slot?)"
    assert (got[~visible] == float("-inf")).all(), "a score past context_len is not -inf"
    err = rel_rms(got[:, : max(lens)][visible[:, : max(lens)]], ref[visible[:, : max(lens)]])
    assert err < TOL, f"rel RMS {err:.3g}"
    return err


def _report(capsys, msg: str) -> None:
    with capsys.disabled():
        print(f"\n{msg}", end="")


@pytest.mark.parametrize("kv", ["fp8", "bf16", "fp4", "fp8+fp4"])
@pytest.mark.parametrize("lens", [[1], [383, 1, 2049], [1, 384, 385, 2100, 3001, 17, 64, 65, 767, 768, 769, 1000,
                                                        2047, 2048, 2500, 129, 5]])
def test_k31_layout_32_heads(kv, lens, capsys):
    """Real K3.1 pages (fp8: 384 tokens/page, bf16: 256, fp4: 704, fp8+fp4: 448), 32 heads x 128, batch 1 / 3 / 17."""
    err = check_scores(kv, lens, 32, 128)
    _report(capsys, f"indexer {kv} K3.1 layout B={len(lens)}: rel RMS {err:.2e}")


@pytest.mark.parametrize("kv", ["fp8", "bf16", "fp4"])
@pytest.mark.parametrize("H, D", [(3, 64), (3, 128), (32, 64)])
def test_other_shapes_block_64(kv, H, D):
    check_scores(kv, [1, 65, 130, 2049], H, D, block_size=64)


@pytest.mark.parametrize("kv", ["fp8", "bf16", "fp4"])
def test_large_context(kv, capsys):
    err = check_scores(kv, [200_003], 32, 128)
    _report(capsys, f"indexer {kv} context 200003: rel RMS {err:.2e}")


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
@pytest.mark.parametrize("block_s, tiles, num_warps, num_stages", [(64, 1, 4, 1), (128, 3, 8, 3), (32, 5, 4, 2)])
def test_launch_configs_and_wider_output(kv, block_s, tiles, num_warps, num_stages):
    """Tuning knobs do not change results; columns past max(context_lens) come out -inf. fp4 pages
    hold 704 tokens: its tiles of 128 and 32 span pages."""
    check_scores(kv, [1, 700, 2049], 32, 128, extra=300, block_s=block_s, tiles=tiles, num_warps=num_warps,
                 num_stages=num_stages)


@pytest.mark.parametrize("dtype, q_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                             (torch.float16, torch.float16)])
@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_other_dtypes(kv, dtype, q_dtype):
    """fp32 q with a bf16 dtype (q split in two fp16 parts), an fp32 dot, fp16 throughout."""
    check_scores(kv, [5, 1000], 32, 128, block_size=128, dtype=dtype, q_dtype=q_dtype)


def check_rotated_query(B: int, H: int, D: int, q_dtype: torch.dtype, device: str) -> None:
    """`rotate_query` (one launch) against the reference's fp32 GEMM and cast: within one ulp of q's
    dtype element by element (only the fp32 summation order differs); and a scan given the rotation
    against the reference scan given it (fp4 keys, which the cache stores rotated)."""
    from kimiserve.ops.indexer.reference import rotate_query as reference_rotate
    from kimiserve.ops.indexer.triton import paged_indexer_scores, rotate_query
    from kimiserve.ops.quant.reference import hadamard

    rotation = hadamard(D, torch.float32, device)
    q = (torch.randn(B, H, D, device=device) * 3).to(q_dtype)
    got, want = rotate_query(q, rotation), reference_rotate(q, rotation)
    assert got.dtype == q_dtype and got.shape == q.shape
    # one ulp of q's dtype, plus the fp32 sums' own rounding (relative to the row's norm, for cancellations)
    bound = want.float().abs() * torch.finfo(q_dtype).eps + 2.0**-20 * q.float().norm(dim=-1, keepdim=True)
    assert ((got.float() - want.float()).abs() <= bound).all()
    assert rel_rms(got.float(), want.float()) < max(1e-6, 0.05 * torch.finfo(q_dtype).eps)  # rare 1-ulp flips
    # the scan given the rotation: a one-ulp difference in a rotated query value moves the scores by ~1e-4
    q, w, kc, ks, tables, ctx = make_case("fp4", [300, 1, 2049][:B], H, D, device, block_size=64)
    want = reference_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, rotation=rotation)
    got = paged_indexer_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, rotation=rotation)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(got)) and rel_rms(got[finite], want[finite]) < 1e-3
    with pytest.raises(ValueError, match="rotation"):
        paged_indexer_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, rotation=rotation[:-1])


@pytest.mark.parametrize("B, H, D", [(1, 32, 128), (3, 17, 64), (2, 3, 32)])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_rotated_query(B, H, D, q_dtype):
    check_rotated_query(B, H, D, q_dtype, "cuda")


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_cuda_graph_capture(kv):
    """With max_context and out given there is no host sync: the call captures and replays (fp4:
    with the query rotated by the scan, as the engine calls it)."""
    from kimiserve.ops.indexer.triton import paged_indexer_scores
    from kimiserve.ops.quant.reference import hadamard

    q, w, kc, ks, tables, ctx = make_case(kv, [100, 1500], 32, 128, "cuda")
    rotation = hadamard(128, torch.float32, "cuda") if kv == "fp4" else None
    out = torch.empty(2, 2048, device="cuda")
    call = lambda: paged_indexer_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, max_context=2048, out=out,
                                        rotation=rotation)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    ref = reference_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, rotation=rotation)
    assert (out[:, 1500:] == float("-inf")).all()
    assert rel_rms(out[:, :1500][torch.isfinite(ref)], ref[torch.isfinite(ref)]) < TOL


# timing (printed, not asserted) -------------------------------------------------------------------
CONFIGS = [  # (block_s, tiles, num_warps, num_stages)
    (64, 4, 4, 2), (64, 1, 4, 1), (64, 8, 4, 3), (64, 6, 4, 3), (128, 3, 8, 3), (128, 1, 8, 1), (128, 4, 4, 2),
]
FP4_CONFIGS = [(64, 1, 4, 2), (64, 2, 4, 2), (64, 4, 4, 3), (32, 1, 4, 1)]  # fp4 K3.1 pages hold 704 tokens


def gpu_time(fn, iters: int = 20, warmup: int = 3) -> float:
    """Median seconds of GPU time per call of fn, each call timed alone with torch.cuda.Event. A
    sleep kernel is queued before each timed call so the CPU launch cost is not counted."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)  # ~1 ms: the GPU is still busy when start, fn and end are queued
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e-3)
    return statistics.median(times)


def time_indexer(B: int, context: int, kv: str = "fp8", configs=CONFIGS) -> list[str]:
    """Per-call time and GB/s on the bytes read (keys + scales) for each launch config, on the real
    K3.1 layout (one layer's keys in every 6.5 MB page), next to a device copy of as many bytes."""
    from kimiserve.ops.indexer.triton import paged_indexer_scores

    q, w, kc, ks, tables, ctx = make_case(kv, [context] * B, 32, 128, "cuda", spare_pages=0)
    scale_bytes = 0 if ks is None else ks.element_size() * (ks.shape[-1] if ks.dim() == 3 else 1)
    read = B * context * (kc.shape[-1] * kc.element_size() + scale_bytes)
    written = B * context * 4
    t = _copy_time(read)
    lines = [f"device copy of {read / 1e6:.0f} MB: {t * 1e6:8.1f} us, {2 * read / t / 1e9:7.0f} GB/s read+write"]
    for block_s, tiles, warps, stages in configs:
        t = gpu_time(lambda: paged_indexer_scores(q, w, kc, ks, tables, ctx, torch.bfloat16, max_context=context,
                                                  block_s=block_s, tiles=tiles, num_warps=warps, num_stages=stages))
        lines.append(f"indexer {kv} B={B} ctx={context} block_s={block_s} tiles={tiles} warps={warps} "
                     f"stages={stages}: {t * 1e6:8.1f} us, {read / t / 1e9:7.0f} GB/s read, "
                     f"{(read + written) / t / 1e9:7.0f} GB/s read+write")
    return lines


def _copy_time(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return gpu_time(lambda: dst.copy_(src))


@pytest.mark.timing
@pytest.mark.parametrize("B, context, kv", [(1, 1_048_576, "fp8"), (1, 1_048_576, "fp4"), (16, 131_072, "fp8")])
def test_indexer_timing(B, context, kv, capsys):
    for line in time_indexer(B, context, kv, FP4_CONFIGS if kv == "fp4" else CONFIGS):
        _report(capsys, line)
    torch.cuda.empty_cache()


def _interpreter_smoke() -> None:
    """Small CPU cases under TRITON_INTERPRET=1."""
    torch.manual_seed(0)
    for kv in ("fp8", "bf16", "fp4"):
        for H, D in ((3, 64), (32, 128)):
            err = check_scores(kv, [1, 65, 130], H, D, "cpu", block_size=64, extra=40, block_s=32, tiles=3)
            print(f"{kv} Hi={H} D={D}: rel RMS {err:.2e}")
    check_scores("fp8", [70], 3, 64, "cpu", block_size=64, dtype=torch.float32, q_dtype=torch.float32)
    check_scores("fp8", [70], 3, 64, "cpu", block_size=64, q_dtype=torch.float32)
    print("paged_indexer_scores interpreter smoke check passed")


if __name__ == "__main__":
    _interpreter_smoke()
