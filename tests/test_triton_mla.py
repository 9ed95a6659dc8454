"""Triton paged MLA decode (kimiserve/ops/mla/triton.py) against the reference ops, on CUDA.

Caches are built through the real page layout (K3.1: fp8 block_size 384, bf16 block_size 256, fp4
(NVFP4 rows of 324 B) block_size 704, 24 MLA layers per page; tiny for fp32) and written with the
pool's own write path; the tested layer is the last one (a large byte offset inside each page).
Pages no sequence owns, slots past a sequence's length and the block-table padding are NaN;
outputs (and the allocator's free memory, where the scratch buffers come from) are NaN before each
kernel runs. Accuracy is the relative RMS error of the whole [B, H, L] output vs the reference (fp32
math on the same dequantised latents); bf16 runs differ from it by the bf16 rounding of q_latent,
q_pe and the probabilities, and the summation order.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import rel_rms
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.ops.mla import reference as ref
from kimiserve.ops.quant.reference import dequantize_nvfp4
from kimiserve.utils.cuda_timing import cuda_time, graph_time

pytestmark = pytest.mark.gpu

CONTEXTS = [1, 63, 385, 2049, 5000]
TOPK = 2048


def build_case(preset: str, kv: str, lens: list[int], heads: int | None, device, latent_scale: float = 0.05,
               q_scale: float = 1.0):
    """A NaN-poisoned pool holding len(lens) sequences of random N(0, 1) latents in scattered pages.

    Returns (latent view [P, bs, L + R] (fp4: uint8 NVFP4 rows [P, bs, 9 * ceil((L + R) / 16)]), latent_scale
    (fp8's scale, fp4's global scale) or None, block tables [B, M], q_latent fp32, q_pe bf16, softmax
    scale). With q_scale 1 the logits have std ~1.7; larger is more peaked. NaN poison: 0xFF bytes are
    NaN in bf16 and e4m3 (an fp4 row's scale bytes: NaN values)."""
    config = load_preset(preset)
    layout = CacheLayout.from_config(config, kv, torch.bfloat16)
    bs, layer = layout.block_size, layout.num_mla_layers - 1
    need = [-(-n // bs) for n in lens]
    num_pages = sum(need) + 2  # + one unowned page + the padding page
    pool = PagePool(layout, num_pages, device, latent_scales=[latent_scale] * layout.num_mla_layers)
    pool.data.fill_(0xFF)  # NaN in e4m3 and bf16
    perm = torch.randperm(num_pages).tolist()
    tables = torch.full((len(lens), max(need) + 1), perm.pop(), dtype=torch.int32)
    for b, n in enumerate(lens):
        tables[b, : need[b]] = torch.tensor([perm.pop() for _ in range(need[b])])
        pos = torch.arange(n)
        latent = torch.randn(n, config.kv_latent_dim, device=device)
        pool.write_mla(layer, tables[b, pos // bs].to(device), (pos % bs).to(device), latent, None)
    H = heads or config.num_attention_heads
    L = config.kv_lora_rank
    q_latent = torch.randn(len(lens), H, L, device=device) * q_scale
    q_pe = (torch.randn(len(lens), H, config.qk_rope_head_dim, device=device) * q_scale).bfloat16()
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    return pool.latent[layer], (None if kv == "bf16" else latent_scale), tables.to(device), q_latent, q_pe, scale


def make_indices(lens: list[int], k: int, device, holes: float = 0.05) -> torch.Tensor:
    """Distinct positions per row at random slots, -1 elsewhere: all positions when the context fits
    (less a few holes), else k * (1 - holes) of them; the last position always selected."""
    idx = torch.full((len(lens), k), -1, dtype=torch.int64)
    for b, n in enumerate(lens):
        count = max(1, min(n, int(k * (1 - holes))) - (1 if n > 8 else 0))
        sel = torch.cat([torch.tensor([n - 1]), torch.randperm(n - 1)[: count - 1]])
        idx[b, torch.randperm(k)[: len(sel)]] = sel
    return idx.to(device)


def poisoned_out(B: int, H: int, L: int) -> torch.Tensor:
    """A NaN output, after leaving NaN in the allocator's free blocks for the scratch buffers."""
    junk = torch.full((64 * 2**20,), float("nan"), device="cuda")
    del junk
    return torch.full((B, H, L), float("nan"), device="cuda")


def _lens(B: int) -> list[int]:
    return {1: [5000], 3: [1, 385, 2049]}.get(B) or [CONTEXTS[b % len(CONTEXTS)] for b in range(B)]


@pytest.fixture(scope="module")
def tt():
    from kimiserve.ops.mla import triton as tt
    return tt


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("H", [96, 16])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_sparse_matches_reference(tt, B, H, kv):
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, _lens(B), H, "cuda")
    idx = make_indices(_lens(B), TOPK, "cuda")
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16,
                                     out=poisoned_out(*q_lat.shape))
    err = rel_rms(got, want)
    print(f"sparse B={B} H={H} {kv}: rel RMS {err:.2e}")
    assert torch.isfinite(got).all() and err < 1e-2


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
@pytest.mark.parametrize("H", [96, 16])
@pytest.mark.parametrize("B", [1, 3, 17])
def test_dense_matches_reference(tt, B, H, kv):
    lens = _lens(B)
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, lens, H, "cuda")
    ctx = torch.tensor(lens, device="cuda")
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16,
                                    out=poisoned_out(*q_lat.shape))
    err = rel_rms(got, want)
    print(f"dense B={B} H={H} {kv}: rel RMS {err:.2e}")
    assert torch.isfinite(got).all() and err < 1e-2


def test_dense_200k_matches_reference(tt):
    """One long sequence: 521 pages of 6.5 MB, so page offsets pass 2^31 bytes."""
    lens = [200_001]
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", "fp8", lens, 96, "cuda")
    ctx = torch.tensor(lens, device="cuda")
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16, max_context=lens[0],
                                    out=poisoned_out(*q_lat.shape))
    err = rel_rms(got, want)
    print(f"dense 200K fp8: rel RMS {err:.2e}")
    assert torch.isfinite(got).all() and err < 1e-2


# tilings and split policies: each is checked here and timed in test_timing
CONFIGS = {
    "default": {},
    "h16 w4": dict(block_h=16, num_warps=4, reload=False),
    "h16 w4 reload": dict(block_h=16, num_warps=4),
    "h64 wgmma": dict(block_h=64),
    "n64": dict(block_n=64),
    "no reload": dict(reload=False),
    "stages 3": dict(num_stages=3),
    "waves 4": dict(waves=4),
    "split>=256": dict(min_split_tokens=256),
    "one split": dict(num_splits=1),
    "40 splits": dict(num_splits=40),
}


def check_k31_config(tt, kv: str, config, scale_l: float) -> None:
    """Sparse and dense decode over K3.1 pages in format kv (96 heads; contexts 1, 63, 5000) under one
    tiling (None: the default) against the references; sharper softmax (q_scale 2)."""
    lens = [1, 63, 5000]
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, lens, 96, "cuda", scale_l, q_scale=2.0)
    idx = make_indices(lens, TOPK, "cuda")
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16,
                                     out=poisoned_out(*q_lat.shape), config=config)
    assert torch.isfinite(got).all() and rel_rms(got, want) < 1e-2
    ctx = torch.tensor(lens, device="cuda")
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.bfloat16,
                                    out=poisoned_out(*q_lat.shape), config=config)
    assert torch.isfinite(got).all() and rel_rms(got, want) < 1e-2


@pytest.mark.parametrize("scale_l", [0.05, 2.0**-4])
@pytest.mark.parametrize("cfg", list(CONFIGS))
def test_configs_and_scales(tt, cfg, scale_l):
    """Every tiling and split policy (one split writes the output directly; 40 splits leave most of
    a short row's splits empty); a non-power-of-two latent scale (applied per element) and a
    power-of-two one (folded out of the loop); sharper softmax (logit std ~3.5)."""
    check_k31_config(tt, "fp8", tt.DecodeConfig(**CONFIGS[cfg]), scale_l)


# NVFP4 latents: changes to the batch-1 fp4 default (`fp4_config`) for both the K3.1 checks and
# test_timing_fp4 (reload does not apply)
FP4_CONFIGS = {
    "default": {},
    "h32 w8": dict(block_h=32, num_warps=8, reload=False),
    "h16 n64 w8": dict(block_h=16, block_n=64, num_warps=8, reload=False),
    "h64 w8 s2": dict(block_h=64, num_warps=8, num_stages=2),  # = default_fp4_config(bf16, batch >= 32)
    "one split": dict(num_splits=1),
    "40 splits": dict(num_splits=40),
    "split>=32": dict(min_split_tokens=32),  # batch 1: 64 splits of one 32-token tile (a shorter chain)
    "n64": dict(block_n=64),  # batch 1: one 64-token tile per split, as fp8's default
}


def fp4_config(tt, overrides: dict):
    """The batch-1 fp4 default tiling with `overrides` (so "one split" changes only the split)."""
    return dataclasses.replace(tt.default_fp4_config(torch.bfloat16), **overrides)


def fp4_rows(n: int, L: int, R: int, device) -> torch.Tensor:
    """Random NVFP4 rows: every code, and scale bytes of every kind (zero, subnormal, normal, NaN)."""
    return torch.randint(0, 256, (n, 9 * -(-(L + R) // 16)), dtype=torch.uint8, device=device)


def assert_same_values(got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit, NaN where the reference has NaN (any payload)."""
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan)
    bits = {4: torch.int32, 2: torch.int16}[want.element_size()]
    assert torch.equal(got.view(bits)[~nan], want.view(bits)[~nan])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("L, R", [(512, 64), (32, 8), (48, 5)])
def test_fp4_dequantisation_is_bit_exact(tt, L, R, dtype):
    """The decode kernel's in-register NVFP4 dequantisation equals the reference's on every code and
    scale byte, for global scales around the ones latents use."""
    rows = fp4_rows(4099, L, R, "cuda")
    for g in [1.0, 0.05, 2.0**-10, 3e-3]:
        assert_same_values(tt.dequantize_fp4_rows(rows, g, L, R, dtype), dequantize_nvfp4(rows, g, dtype, L + R))


@pytest.mark.parametrize("scale_l", [0.05, 1.0])
@pytest.mark.parametrize("cfg", list(FP4_CONFIGS))
def test_fp4_configs(tt, cfg, scale_l):
    """NVFP4 latents at K3.1 widths under each tiling and split policy; sharper softmax (q_scale 2)."""
    check_k31_config(tt, "fp4", fp4_config(tt, FP4_CONFIGS[cfg]) if FP4_CONFIGS[cfg] else None, scale_l)


@pytest.mark.parametrize("kv", ["fp8", "fp4"])
def test_poisoning_is_seen(tt, kv):
    """Sanity of the NaN poisoning: a table entry pointing at an unowned page turns that row NaN."""
    lens = [385, 2049]
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, lens, 96, "cuda")
    bad = tables.clone()
    bad[1, 2] = tables[0, -1]
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, bad, torch.tensor(lens, device="cuda"), scale,
                                    torch.bfloat16)
    assert got[1].isnan().all() and torch.isfinite(got[0]).all()


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
def test_fp32_tiny_dims_close_to_reference(tt, kv):
    """The tiny model (L=32, R=8, 4 heads, 64-token pages) in fp32, as the engine's fp32 GPU tests run it:
    IEEE fp32 dots, so only the summation order differs."""
    lens = [1, 63, 130]
    cache, ls, tables, q_lat, q_pe, scale = build_case("tiny", kv, lens, None, "cuda", 2.0**-3)
    idx = make_indices(lens, 70, "cuda")
    want = ref.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.float32)
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.float32)
    assert rel_rms(got, want) < 1e-5
    ctx = torch.tensor(lens, device="cuda")
    want = ref.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.float32)
    got = tt.paged_dense_mla_decode(q_lat, q_pe, cache, ls, tables, ctx, scale, torch.float32)
    assert rel_rms(got, want) < 1e-5


def test_row_without_tokens_is_nan_and_leaves_others_alone(tt):
    lens = [385, 2049]
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", "fp8", lens, 96, "cuda")
    idx = make_indices(lens, TOPK, "cuda")
    idx[0] = -1
    got = tt.paged_sparse_mla_decode(q_lat, q_pe, cache, ls, tables, idx, scale, torch.bfloat16)
    want = ref.paged_sparse_mla_decode(q_lat[1:], q_pe[1:], cache, ls, tables[1:], idx[1:], scale, torch.bfloat16)
    assert got[0].isnan().all() and rel_rms(got[1:], want) < 1e-2


# timing (printed, not asserted) ------------------------------------------------------------------
def _time_case(tt, kind: str, B: int, ctx: int, sms: int, kv: str = "fp8", configs: dict = CONFIGS) -> list[str]:
    cache, ls, tables, q_lat, q_pe, scale = build_case("kimi-k3.1-pro", kv, [ctx] * B, 96, "cuda", 1.0)
    row_bytes = cache.shape[-1] * cache.element_size()
    per_row = TOPK if kind == "sparse" else ctx
    if kind == "sparse":
        sel = make_indices([ctx] * B, TOPK, "cuda", holes=0.0)
        op = tt.paged_sparse_mla_decode
        extra = {}
    else:
        sel = torch.full((B,), ctx, device="cuda")
        op = tt.paged_dense_mla_decode
        extra = dict(max_context=ctx)
    lines = []
    for name, overrides in configs.items():
        cfg = fp4_config(tt, overrides) if kv == "fp4" else tt.DecodeConfig(**overrides)

        def fn():
            return op(q_lat, q_pe, cache, ls, tables, sel, scale, torch.bfloat16, config=cfg, **extra)

        splits = tt.plan_splits(B, -(-q_lat.shape[1] // cfg.block_h), per_row, cfg, sms)[0]
        head = f"{kv} {kind:6} B={B:<3} ctx={ctx:<6} {name:13}"
        try:
            eager, graphed = cuda_time(fn), graph_time(fn, calls=10)
        except Exception as e:  # e.g. out of shared memory for a tiling
            lines.append(f"{head} failed: {type(e).__name__}: {str(e)[:100]}")
            continue
        gbps = B * per_row * row_bytes / (graphed * 1e-3) / 1e9
        lines.append(f"{head} splits={splits:<3} eager {eager * 1e3:8.1f} us  graph {graphed * 1e3:8.1f} us "
                     f"{gbps:6.0f} GB/s")
    return lines


@pytest.mark.timing
def test_timing(tt, capsys):
    """Sparse top-2048 at B=1 and 64 and dense over 8K/32K/128K at B=1 (K3.1 fp8 pages, 96 heads, bf16)
    for every config: median of 20 by CUDA events per call (eager: includes the host's launch cost when
    that is longer than the kernels) and per call inside a CUDA graph; GB/s on the graph time counts only
    the latent bytes read (576 B per selected token for fp8)."""
    sms = tt._num_sms(torch.device("cuda"))
    lines = [f"MLA decode timings ({torch.cuda.get_device_name()}, {sms} SMs)"]
    for kind, B, ctx in [("sparse", 1, 4096), ("sparse", 64, 4096), ("dense", 1, 8192), ("dense", 1, 32768),
                         ("dense", 1, 131072)]:
        lines += _time_case(tt, kind, B, ctx, sms)
        torch.cuda.empty_cache()
    with capsys.disabled():
        print("\n" + "\n".join(lines))


@pytest.mark.timing
def test_timing_fp4(tt, capsys):
    """NVFP4 latents (324 B per token) under FP4_CONFIGS next to fp8's default tiling (576 B per token),
    as test_timing measures them."""
    sms = tt._num_sms(torch.device("cuda"))
    lines = [f"MLA decode timings, fp4 vs fp8 ({torch.cuda.get_device_name()}, {sms} SMs)"]
    fp8_default = {"default": dict(block_n=64, num_stages=1)}  # default_config(bf16)
    for kind, B, ctx in [("sparse", 1, 4096), ("sparse", 64, 4096), ("dense", 1, 32768)]:
        lines += _time_case(tt, kind, B, ctx, sms, "fp8", fp8_default)
        lines += _time_case(tt, kind, B, ctx, sms, "fp4", FP4_CONFIGS)
        torch.cuda.empty_cache()
    with capsys.disabled():
        print("\n" + "\n".join(lines))
