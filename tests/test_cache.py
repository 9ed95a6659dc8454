"""FP8 cache quantisation, cache formats, the packed page layout and the page pool (DESIGN.md section 2)."""

import math

import pytest
import torch

from conftest import rel_rms
from kimiserve.cache import formats
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.model import inspect
from kimiserve.ops.quant.reference import (
    FP8_DTYPE,
    dequantize_fp8,
    dequantize_fp8_rowwise,
    dequantize_nvfp4,
    quantize_fp8,
    quantize_fp8_rowwise,
    quantize_nvfp4,
)

PRESETS = ("tiny", "small", "kimi-k3.1-pro")
STATE_DTYPES = (torch.bfloat16, torch.float32)


# FP8 e4m3 ---------------------------------------------------------------------------------------
def _in_range(n: int) -> torch.Tensor:
    """Signed values with magnitudes log-uniform over e4m3's normal range [2^-6, 448]."""
    mag = torch.exp2(torch.empty(n).uniform_(-6, math.log2(448)))
    return mag * torch.where(torch.rand(n) < 0.5, -1.0, 1.0)


@pytest.mark.parametrize("scale", [1.0, 0.01, 37.5])
def test_fp8_round_trip_within_half_ulp(scale):
    x = _in_range(4096) * scale
    q = quantize_fp8(x, scale)
    assert q.dtype == FP8_DTYPE
    d = dequantize_fp8(q, scale)
    rel = ((d - x).abs() / x.abs()).max().item()
    assert rel <= 2.0**-4 * (1 + 1e-6)  # 3 mantissa bits: half an ulp is <= 2^-4 relative
    assert rel > 2.0**-6  # sanity: it is lossy, so this really exercised rounding


def test_fp8_exact_codes_and_ties_to_even():
    codes = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
    finite = codes[torch.isfinite(codes)]
    assert finite.abs().max() == 448
    assert torch.equal(dequantize_fp8(quantize_fp8(finite, 1.0), 1.0), finite)  # representable: exact
    mid = torch.tensor([1.0625, 1.1875, -1.0625, 248.0])  # midpoints between neighbouring codes
    assert dequantize_fp8(quantize_fp8(mid, 1.0), 1.0).tolist() == [1.0, 1.25, -1.0, 256.0]


def test_fp8_saturates_without_nan_or_inf():
    x = torch.tensor([448.0, 449.0, 464.0, 500.0, 1e6, 3e38, float("inf"), -449.0, -1e6, -float("inf")])
    d = dequantize_fp8(quantize_fp8(x, 1.0), 1.0)
    assert torch.isfinite(d).all()
    assert d.tolist() == [448.0] * 7 + [-448.0] * 3
    d = dequantize_fp8(quantize_fp8(x[:6], 0.5), 0.5)  # saturation is at 448 * scale
    assert d.tolist() == [224.0] * 6


def test_fp8_rowwise_scale_maps_row_max_to_448():
    x = torch.randn(7, 33) * torch.exp2(torch.arange(-3.0, 4.0)).unsqueeze(1)
    q, s = quantize_fp8_rowwise(x)
    assert q.dtype == FP8_DTYPE and s.dtype == torch.float32 and s.shape == (7,)
    assert torch.equal(s, x.abs().amax(-1) / 448)
    qf = q.float()
    at_max = x.abs() == x.abs().amax(-1, keepdim=True)
    assert torch.equal(qf.abs()[at_max], torch.full((int(at_max.sum()),), 448.0))
    assert qf.abs().max() == 448
    d = dequantize_fp8_rowwise(q, s)
    assert ((d - x).abs() <= 2.0**-4 * x.abs() + s.unsqueeze(1) * 2.0**-10).all()  # half ulp, or subnormal step


def test_fp8_rowwise_zero_rows():
    x = torch.zeros(3, 16, dtype=torch.bfloat16)
    x[1, 3] = -2.5
    q, s = quantize_fp8_rowwise(x)
    assert torch.equal(s, torch.tensor([1.0, 2.5 / 448, 1.0], dtype=torch.float32))
    d = dequantize_fp8_rowwise(q, s, torch.bfloat16)
    assert d.dtype == torch.bfloat16
    assert torch.equal(d[0], torch.zeros(16, dtype=torch.bfloat16)) and torch.equal(d[2], d[0])
    assert d[1, 3] == -2.5 and d[1].abs().sum() == 2.5


def test_fp8_rowwise_tiny_nonzero_row_stays_finite():
    q, s = quantize_fp8_rowwise(torch.tensor([[1e-44, 0.0, -5e-45]]))
    assert (s > 0).all() and torch.isfinite(q.float()).all()
    assert torch.isfinite(dequantize_fp8_rowwise(q, s)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_fp8_dequantize_dtype(dtype):
    x = torch.randn(4, 8)
    assert dequantize_fp8(quantize_fp8(x, 0.1), 0.1, dtype).dtype == dtype
    assert dequantize_fp8_rowwise(*quantize_fp8_rowwise(x), dtype).dtype == dtype


@pytest.mark.parametrize("scale", [0.0, -1.0, -1e-9])
def test_fp8_rejects_non_positive_scale(scale):
    with pytest.raises(ValueError, match="scale"):
        quantize_fp8(torch.ones(3), scale)


# formats ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bf16_format_round_trip_is_a_cast(dtype):
    x = torch.randn(5, 40, dtype=dtype) * 100
    assert formats.store_latent(x, "bf16", 3.0).dtype == torch.bfloat16
    codes, scales = formats.store_index_key(x, "bf16")
    assert codes.dtype == torch.bfloat16 and scales is None
    expect = x.to(torch.bfloat16).to(dtype)
    assert torch.equal(formats.roundtrip_latent(x, "bf16", 3.0), expect)
    assert torch.equal(formats.roundtrip_index_key(x, "bf16"), expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_format_round_trip_equals_store_then_load(dtype):
    x = torch.randn(6, 40, dtype=dtype) * 3
    codes = formats.store_latent(x, "fp8", 0.02)
    assert codes.dtype == FP8_DTYPE
    loaded = formats.load_latent(codes, "fp8", 0.02, dtype)
    assert torch.equal(formats.roundtrip_latent(x, "fp8", 0.02), loaded) and loaded.dtype == dtype
    assert torch.equal(loaded, (quantize_fp8(x, 0.02).float() * 0.02).to(dtype))
    kc, ks = formats.store_index_key(x, "fp8")
    assert kc.dtype == FP8_DTYPE and ks.shape == (6,) and ks.dtype == torch.float32
    assert torch.equal(formats.roundtrip_index_key(x, "fp8"), formats.load_index_key(kc, ks, "fp8", dtype))
    assert not torch.equal(formats.roundtrip_index_key(x, "fp8"), x)  # lossy: really went through e4m3


@pytest.mark.parametrize("bad", ["fp16", "FP8", "nvfp4", ""])
def test_unknown_kv_cache_dtype(bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        formats.check_kv_cache_dtype(bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        CacheLayout.from_config(load_preset("tiny"), bad, torch.bfloat16)


# layout -----------------------------------------------------------------------------------------
def _state_bytes(cfg, state_dtype) -> int:
    H, K = cfg.kda_num_heads, cfg.kda_head_dim
    rec = -(-H * K * K * 4 // 16) * 16
    return rec + 3 * H * K * (cfg.kda_conv_size - 1) * state_dtype.itemsize


def _attn_regions(lay):
    return [*lay.latent, *lay.index_key, *lay.index_scale]


def _end(regions) -> int:
    return max(r.offset + r.nbytes for r in regions)


@pytest.mark.parametrize("state_dtype", STATE_DTYPES)
@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4", "fp8+fp4", "fp4+bf16"])
@pytest.mark.parametrize("preset", PRESETS)
def test_layout_block_size_and_regions(preset, kv, state_dtype):
    cfg = load_preset(preset)
    lay = CacheLayout.from_config(cfg, kv, state_dtype)
    n_mla, bs = len(cfg.full_attn_layers), lay.block_size
    per_layer = inspect.latent_bytes(cfg, kv) + inspect.index_key_bytes(cfg, kv)
    state = _state_bytes(cfg, state_dtype)
    if state_dtype == torch.bfloat16:
        assert state == inspect.kda_state_bytes_per_layer(cfg)
    assert lay.state_bytes == state
    # per-token bytes per MLA layer, from the regions themselves
    assert len(lay.latent) == len(lay.index_key) == n_mla
    key_fmt, latent_fmt = formats.index_key_format(kv), formats.latent_format(kv)
    assert len(lay.index_scale) == (n_mla if key_fmt != "bf16" else 0)
    for i in range(n_mla):
        regs = [lay.latent[i], lay.index_key[i], *lay.index_scale[i:i + 1]]
        assert sum(r.nbytes for r in regs) == bs * per_layer
        latent_width = 9 * -(-cfg.kv_latent_dim // 16) if latent_fmt == "fp4" else cfg.kv_latent_dim
        key_width = 16 * -(-cfg.index_head_dim // 32) if key_fmt == "fp4" else cfg.index_head_dim
        assert lay.latent[i].shape == (bs, latent_width) and lay.index_key[i].shape == (bs, key_width)
    assert lay.index_key_rotation == (key_fmt == "fp4")
    # block size: the smallest multiple of 64 whose attention page holds a state page
    attn = _end(_attn_regions(lay))
    assert bs % 64 == 0 and attn >= state
    assert bs == 64 * max(1, math.ceil(state / (64 * n_mla * per_layer)))
    if bs > 64:
        with pytest.raises(ValueError, match="block_size"):
            CacheLayout.from_config(cfg, kv, state_dtype, block_size=bs - 64)
    assert lay.page_bytes >= max(attn, state) and lay.page_bytes % 16 == 0
    # regions of one page kind do not overlap and lie inside the page; offsets are aligned
    for kind in (_attn_regions(lay), [lay.recurrent, lay.conv]):
        spans = sorted((r.offset, r.offset + r.nbytes) for r in kind)
        assert spans[0][0] >= 0 and spans[-1][1] <= lay.page_bytes
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
        assert all(r.offset % 16 == 0 and r.nbytes > 0 for r in kind)
    assert lay.recurrent.shape == (cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_head_dim)
    assert lay.recurrent.dtype == torch.float32 and lay.conv.dtype == state_dtype


@pytest.mark.parametrize("kv, expected", [("bf16", 1408), ("fp8", 708), ("fp4", 324 + 68), ("fp8+fp4", 576 + 68),
                                          ("fp4+fp8", 324 + 132)])
def test_k31_bytes_per_token_per_layer(kv, expected):
    cfg = load_preset("kimi-k3.1-pro")
    assert (cfg.kv_latent_dim, cfg.index_head_dim) == (576, 128)
    assert inspect.latent_bytes(cfg, kv) + inspect.index_key_bytes(cfg, kv) == expected
    lay = CacheLayout.from_config(cfg, kv, torch.bfloat16)
    assert sum(r.nbytes for r in (lay.latent[0], lay.index_key[0], *lay.index_scale[:1])) == expected * lay.block_size


def test_k31_fp4_holds_1_7x_the_tokens_of_fp8_per_page_byte():
    cfg = load_preset("kimi-k3.1-pro")
    fp8, fp4 = (CacheLayout.from_config(cfg, kv, torch.bfloat16) for kv in ("fp8", "fp4"))
    ratio = (fp4.block_size / fp4.page_bytes) / (fp8.block_size / fp8.page_bytes)
    assert ratio >= 1.7, ratio
    assert fp4.token_bytes == 24 * 392 and fp8.token_bytes == 24 * 708


@pytest.mark.parametrize("kv", ["fp4", "fp8+fp4", "fp4+bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp4_formats_round_trip_equals_store_then_load(kv, dtype):
    x = torch.randn(6, 40, dtype=dtype) * 3
    codes = formats.store_latent(x, kv, 0.5)
    loaded = formats.load_latent(codes, kv, 0.5, dtype, 40)
    assert torch.equal(formats.roundtrip_latent(x, kv, 0.5), loaded) and loaded.dtype == dtype
    if formats.latent_format(kv) == "fp4":
        assert codes.dtype == torch.uint8 and codes.shape == (6, 27)
        assert torch.equal(loaded, dequantize_nvfp4(quantize_nvfp4(x, 0.5), 0.5, dtype, 40))
    if formats.index_key_format(kv) != "fp4":
        return
    k = torch.randn(6, 16, dtype=dtype)
    kc, ks = formats.store_index_key(k, kv)
    assert kc.dtype == torch.uint8 and kc.shape == (6, 16) and ks.dtype == torch.uint8 and ks.shape == (6, 1)
    back = formats.load_index_key(kc, ks, kv, dtype, 16)
    assert torch.equal(formats.roundtrip_index_key(k, kv), back) and not torch.equal(back, k)
    rotated = formats.roundtrip_index_key(k, kv, rotate=True)
    assert not torch.equal(rotated, back) and rel_rms(rotated.float(), k.float()) < 0.25


def test_rotation_keeps_dot_products():
    q, k = torch.randn(5, 128, dtype=torch.float64), torch.randn(7, 128, dtype=torch.float64)
    rq, rk = formats.rotate_index_keys(q), formats.rotate_index_keys(k)
    assert torch.allclose(rq @ rk.T, q @ k.T) and torch.allclose(formats.rotate_index_keys(rk), k)


def test_k31_fp8_block_size():
    cfg = load_preset("kimi-k3.1-pro")
    H, K, W = cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    state = H * K * K * 4 + 3 * H * K * (W - 1) * 2  # fp32 recurrent + bf16 conv
    per_token = len(cfg.full_attn_layers) * (576 + 128 + 4)  # e4m3 latent + e4m3 key + fp32 key scale
    expected = 64 * math.ceil(state / per_token / 64)
    lay = CacheLayout.from_config(cfg, "fp8", torch.bfloat16)
    assert lay.block_size == expected == 384


@pytest.mark.parametrize("bad", [0, -64, 32, 100, 65])
def test_layout_rejects_bad_block_size(bad):
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout.from_config(load_preset("tiny"), "bf16", torch.bfloat16, block_size=bad)


def test_layout_explicit_block_size():
    cfg = load_preset("kimi-k3.1-pro")
    lay = CacheLayout.from_config(cfg, "fp8", torch.bfloat16, block_size=448)
    assert lay.block_size == 448 and lay.latent[3].shape == (448, 576)
    with pytest.raises(ValueError, match="block_size"):
        CacheLayout.from_config(cfg, "fp8", torch.bfloat16, block_size=320)


# pool -------------------------------------------------------------------------------------------
def _pool(kv, num_pages=7, scales=None) -> PagePool:
    lay = CacheLayout.from_config(load_preset("tiny"), kv, torch.bfloat16)
    pool = PagePool(lay, num_pages, latent_scales=scales)
    pool.data.copy_(torch.randint(0, 256, pool.data.shape, dtype=torch.uint8))
    return pool


def _slots(pool, n):
    flat = torch.randperm(pool.num_pages * pool.block_size)[:n]
    return flat // pool.block_size, flat % pool.block_size


def _raw(reg, data) -> torch.Tensor:
    return data[:, reg.offset : reg.offset + reg.nbytes]


def _layer_bytes(pool, layer, pages, offsets) -> torch.Tensor:
    """Bool [P, page_bytes]: the bytes of `layer`'s rows at the given slots."""
    mask = torch.zeros_like(pool.data, dtype=torch.bool)
    lay = pool.layout
    for reg in (lay.latent[layer], lay.index_key[layer], *lay.index_scale[layer:layer + 1]):
        row = reg.nbytes // reg.shape[0]
        for p, o in zip(pages.tolist(), offsets.tolist()):
            mask[p, reg.offset + o * row : reg.offset + (o + 1) * row] = True
    return mask


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4", "fp8+fp4"])
def test_pool_write_read_round_trip(kv):
    scales = [0.5, 0.03]
    pool = _pool(kv, scales=scales)
    cfg, n = load_preset("tiny"), 37
    written = []
    for layer in range(pool.layout.num_mla_layers):
        pages, offsets = _slots(pool, n)
        lat, key = torch.randn(n, cfg.kv_latent_dim) * 4, torch.randn(n, cfg.index_head_dim)
        pool.write_mla(layer, pages, offsets, lat, key)
        written.append((pages, offsets, lat, key))
    for layer, (pages, offsets, lat, key) in enumerate(written):
        got_l = pool.read_latents(layer, pages, offsets, torch.float32)
        got_k = pool.read_index_keys(layer, pages, offsets, torch.float32)
        if kv == "bf16":
            assert torch.equal(got_l, lat.bfloat16().float()) and torch.equal(got_k, key.bfloat16().float())
        else:
            assert torch.equal(got_l, formats.roundtrip_latent(lat, kv, scales[layer]))
            rotate = pool.layout.index_key_rotation
            assert torch.allclose(got_k, formats.roundtrip_index_key(key, kv, rotate), rtol=0, atol=1e-6)
        assert torch.equal(pool.read_latents(layer, pages, offsets, torch.bfloat16), got_l.bfloat16())


@pytest.mark.parametrize("kv", ["bf16", "fp8", "fp4"])
def test_pool_write_touches_only_its_layer_and_slots(kv):
    pool = _pool(kv)
    pages, offsets = _slots(pool, 11)
    before = pool.data.clone()
    pool.write_mla(0, pages, offsets, torch.randn(11, 40), torch.randn(11, 16))
    changed = pool.data != before
    allowed = _layer_bytes(pool, 0, pages, offsets)
    assert not (changed & ~allowed).any()
    assert changed.sum() > allowed.sum() // 2  # the write really landed
    for reg in (pool.layout.latent[1], pool.layout.index_key[1], *pool.layout.index_scale[1:]):
        assert torch.equal(_raw(reg, pool.data), _raw(reg, before))


def test_pool_copy_pages():
    pool = _pool("fp8")
    before = pool.data.clone()
    pool.copy_pages([3, 1], [0, 5])
    assert torch.equal(pool.data[0], before[3]) and torch.equal(pool.data[5], before[1])
    for p in (1, 2, 3, 4, 6):
        assert torch.equal(pool.data[p], before[p])
    lay = pool.layout
    for reg in (*lay.latent, *lay.index_key, *lay.index_scale, lay.recurrent, lay.conv):  # all layers + state
        assert torch.equal(_raw(reg, pool.data)[[0, 5]], _raw(reg, before)[[3, 1]])
    assert torch.equal(pool.latent[1][0].view(torch.uint8), lay.latent[1].view(before)[3].view(torch.uint8))
    pool.copy_pages([0, 2], [2, 4])  # in list order: page 4 gets page 2's new contents
    assert torch.equal(pool.data[4], before[3])


def test_pool_zero_state():
    pool = _pool("bf16")
    before = pool.data.clone()
    pool.zero_state(torch.tensor([4, 1]))
    assert not pool.recurrent[[1, 4]].any() and not pool.conv[[1, 4]].float().any()
    allowed = torch.zeros_like(pool.data, dtype=torch.bool)
    allowed[[1, 4], : pool.layout.state_bytes] = True
    assert not pool.data[allowed].any()
    assert torch.equal(pool.data[~allowed], before[~allowed])
    assert pool.recurrent[[0, 2, 3, 5, 6]].view(torch.int32).any()


def test_pool_rejects_bad_arguments():
    lay = CacheLayout.from_config(load_preset("tiny"), "fp8", torch.bfloat16)
    for n in (0, -1):
        with pytest.raises(ValueError, match="num_pages"):
            PagePool(lay, n)
    for scales in ([1.0], [1.0, 2.0, 3.0], [1.0, 0.0], [1.0, -2.0]):
        with pytest.raises(ValueError, match="latent_scales"):
            PagePool(lay, 2, latent_scales=scales)


def test_pool_rejects_empty_latent_scales():
    lay = CacheLayout.from_config(load_preset("tiny"), "fp8", torch.bfloat16)
    with pytest.raises(ValueError, match="latent_scales"):
        PagePool(lay, 2, latent_scales=[])
