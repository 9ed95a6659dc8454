"""Triton `write_mla_tokens` against the reference: the whole page pool must come out BIT-EQUAL.

Both run on the same device, into two pools of the real layout that start as all-0xFF bytes (NaN
for e4m3 and bf16), so any stray or missing byte shows. Inputs cover e4m3's rounding ties (also a
few ulps either side of tie * latent_scale, where x / s and x * (1 / s) round apart), subnormals,
saturation, zero / subnormal / inf / NaN key rows, and bf16 ties for the bf16 cache. For the 4-bit
formats (finite inputs only, as the reference requires): NVFP4 block-scale ties (amax / (6 g) on and
around e4m3 midpoints), e2m1 ties within a block, saturated (1e6) and vanishing (1e-30) blocks, zero
and -0 groups, fp32 subnormals, a last partial group; MXFP4 groups whose amax significand is 1.75
or just below, e2m1 ties, zero / subnormal / huge groups. The interpreter variants of these checks
are tests/test_triton_cache_write_interpret.py.

Interpreter smoke check without a GPU (small sizes, CPU tensors):
    python tests/test_triton_cache_write.py
"""

import os

if __name__ == "__main__":  # must precede any triton import
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from kimiserve.cache import formats
from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.ops.cache_write.reference import write_mla_tokens as reference_write

pytestmark = pytest.mark.gpu

_INF = torch.tensor(float("inf"))


def _e4m3_ties() -> torch.Tensor:
    """Midpoints between neighbouring finite e4m3 values (both signs): where rounding is a tie."""
    grid = torch.arange(0, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mid = (grid[1:] + grid[:-1]) / 2
    return torch.cat([mid, -mid])


def _near(x: torch.Tensor, ulps: int = 2) -> torch.Tensor:
    """x and its fp32 neighbours up to `ulps` steps either side."""
    out, up, down = [x], x, x
    for _ in range(ulps):
        up, down = torch.nextafter(up, _INF), torch.nextafter(down, -_INF)
        out += [up, down]
    return torch.cat(out)


def _fill_rows(values: torch.Tensor, n: int, width: int) -> torch.Tensor:
    """`values` laid out over rows of `width` (cycled to fill n rows)."""
    reps = -(-n * width // values.numel())
    return values.repeat(reps)[: n * width].view(n, width)


def _latents(N: int, L: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Random latents over e4m3's range relative to `scale` (subnormal to saturated), every 3rd row
    adversarial (e4m3 ties times the scale, +-2 ulps; bf16 ties), as a non-contiguous slice."""
    x = torch.randn(N, L) * torch.exp2(torch.randint(-14, 10, (N, 1)).float()) * scale
    ties = _near((_e4m3_ties().double() * scale).float())
    bits = torch.randint(-(2**31), 2**31 - 1, (N, L), dtype=torch.int32)
    bf16_ties = ((bits & ~0xFFFF) | 0x8000).view(torch.float32)  # exactly half a bf16 ulp
    bf16_ties = torch.where(torch.isfinite(bf16_ties), bf16_ties, 1.0)
    x[::3] = _fill_rows(ties[torch.randperm(ties.numel())], N, L)[::3]
    x[1::3] = bf16_ties[1::3]
    big = torch.full((N, L + 24), float("nan"))
    big[:, :L] = x
    return big.to(dtype)[:, :L]


def _keys(N: int, D: int, dtype: torch.dtype, specials: bool) -> torch.Tensor:
    """Random keys over many magnitudes; rows 0-4: zero, fp32 subnormals, tie-laden (amax 448 * 2^k),
    with +inf, with NaN (when `specials`)."""
    x = torch.randn(N, D) * torch.exp2(torch.randint(-20, 20, (N, 1)).float())
    if specials and N >= 5:
        x[0] = 0.0
        x[1] = torch.randn(D) * 1e-39
        x[2] = _fill_rows(_near(_e4m3_ties() * 4, 1), 1, D)[0]
        x[2, 0] = 448.0 * 4
        x[3, 5] = float("inf")
        x[4, 7] = float("nan")
    return x.to(dtype)


def _groups_of(values: torch.Tensor, N: int, G: int, group: int) -> torch.Tensor:
    """[N, G * group] rows, group by group drawn from `values` [M, group] at random."""
    return values[torch.randint(0, values.shape[0], (N * G,))].view(N, G * group)


def _nvfp4_latents(N: int, L: int, g: float, dtype: torch.dtype) -> torch.Tensor:
    """Finite latents for an NVFP4 cache of global scale g, as a non-contiguous slice. Groups of 16
    (the last one cut at L, so a partial group sees what a whole one would) of six kinds: random over
    e4m3's block-scale range (subnormal to saturated); amax / (6 g) on an e4m3 midpoint +-2 ulps
    (block-scale ties, where division and reciprocal multiply differ); e2m1 ties (+-1 ulp) under an
    exact e4m3 block scale; zeros and -0; 1e6 / 1e-30; fp32 subnormals."""
    G = -(-L // 16)
    g32 = torch.tensor(g, dtype=torch.float32)
    rand = torch.randn(4 * N * G, 16) * torch.exp2(torch.randint(-16, 12, (4 * N * G, 1)).float()) * 6 * g32
    mids = _near((_e4m3_ties()[: _e4m3_ties().numel() // 2].double() * 6 * g).float())
    amax_ties = torch.rand(mids.numel(), 16) * mids[:, None]
    amax_ties[:, 3] = mids * torch.where(torch.rand(mids.numel()) < 0.5, 1.0, -1.0)
    s = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    s = s[torch.randint(0, s.numel(), (64,))]
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 1.0, 3.0])
    tie = _near(bounds[torch.randint(0, 10, (64, 15))] * (s * g32)[:, None], 1)  # [3 * 64, 15]
    tie = tie * torch.where(torch.rand(tie.shape) < 0.5, 1.0, -1.0)
    e2m1_ties = torch.cat([(6 * (s * g32)).repeat(3)[:, None], tie], 1)  # amax 6 s g: block scale s
    zeros = torch.zeros(4, 16)
    zeros[1] = -0.0
    zeros[2, ::3] = -0.0
    zeros[3, 5] = 1.0
    extremes = torch.tensor([1e6, -1e6, 1e-30, -1e-30, 3e5, 1e-25, 0.0, -0.0]).repeat(2)[torch.randperm(16)]
    extremes = torch.stack([extremes, extremes.abs() * 1e-30, extremes.clamp(-1.0, 1.0), extremes.sign() * 1e6])
    subnormal = torch.randn(4, 16) * 1e-39
    kinds = [rand, amax_ties, e2m1_ties, zeros, extremes, subnormal]
    rows = torch.stack([_groups_of(k, N, G, 16) for k in kinds])  # [6, N, G * 16]
    pick = torch.randint(0, len(kinds), (N, G))
    pick[:, -1] = torch.arange(N) % len(kinds)  # every kind in the last (partial) group too
    x = rows.gather(0, pick.repeat_interleave(16, 1)[None])[0]
    big = torch.full((N, G * 16 + 24), float("nan"))
    big[:, : G * 16] = x
    return big.to(dtype)[:, :L]


def _mxfp4_keys(N: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    """Finite index keys for an MXFP4 cache: groups of 32 (the last cut at D) random over many
    magnitudes; with amax significand exactly 1.75 / just below (the scale exponent's round-up);
    e2m1 ties under amax 6 * 2^k (scale 2^k); zero, -0, fp32 subnormal (scale byte 0), 1e-30, 1e6,
    1e30 and near fp32's max."""
    G = -(-D // 32)
    rand = torch.randn(4 * N * G, 32) * torch.exp2(torch.randint(-40, 40, (4 * N * G, 1)).float())
    k = torch.randint(-60, 60, (64, 1)).float()
    edge = torch.tensor([1.75, 1.75 - 2**-22, 1.5, 1.0, 2.0 - 2**-22, 1.875]).repeat(11)[:64, None]
    sig = torch.cat([edge * torch.exp2(k), (torch.rand(64, 31) * 2 - 1) * edge * torch.exp2(k)], 1)
    bounds = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 0.5, 3.0, 6.0])
    tie = bounds[torch.randint(0, 10, (64, 31))] * torch.exp2(k) * torch.where(torch.rand(64, 31) < 0.5, 1.0, -1.0)
    pick = torch.randperm(3 * 64)[:64]  # exact ties and their fp32 neighbours
    ties = torch.cat([6 * torch.exp2(k)[pick % 64], _near(tie, 1)[pick]], 1)
    special = torch.zeros(7, 32)
    special[1] = -0.0
    special[2] = torch.randn(32) * 1e-39
    special[3] = torch.randn(32) * 1e-30
    special[4] = torch.randn(32) * 1e6
    special[5] = torch.randn(32) * 1e30
    special[6] = torch.tensor([3.0e38, -1e38] * 16)
    kinds = [rand, sig, ties, special]
    rows = torch.stack([_groups_of(kd, N, G, 32) for kd in kinds])
    pick = torch.randint(0, len(kinds), (N, G))
    pick[:, -1] = torch.arange(N) % len(kinds)
    x = rows.gather(0, pick.repeat_interleave(32, 1)[None])[0][:, :D]
    return x.to(dtype)


def _pools(preset: str, kv: str, num_pages: int, device: str) -> tuple[PagePool, PagePool]:
    layout = CacheLayout.from_config(load_preset(preset), kv, torch.bfloat16)
    pools = PagePool(layout, num_pages, device), PagePool(layout, num_pages, device)
    for p in pools:
        p.data.fill_(0xFF)
    return pools


def _slots(N: int, num_pages: int, block_size: int, device: str, index_dtype: torch.dtype):
    """N distinct (page, offset) slots in random order over all pages."""
    flat = torch.randperm(num_pages * block_size)[:N]
    return (flat // block_size).to(device, index_dtype), (flat % block_size).to(device, index_dtype)


def check_write(device: str, preset: str, kv: str, N: int, in_dtype: torch.dtype, scale: float,
                with_keys: bool = True, specials: bool = True, layer: int = 1, num_pages: int = 6,
                index_dtype: torch.dtype = torch.int64) -> None:
    """Write N tokens with both implementations; the pools must be byte-identical."""
    from kimiserve.ops.cache_write.triton import write_mla_tokens

    ref, tri = _pools(preset, kv, num_pages, device)
    L, D = ref.layout.latent_dim, ref.layout.index_dim
    lat_fmt, key_fmt = formats.latent_format(kv), formats.index_key_format(kv)
    pages, offsets = _slots(N, num_pages, ref.block_size, device, index_dtype)
    latent = (_nvfp4_latents(N, L, scale, in_dtype) if lat_fmt == "fp4" else _latents(N, L, scale, in_dtype)).to(device)
    if with_keys:
        keys = _mxfp4_keys(N, D, in_dtype) if key_fmt == "fp4" else _keys(N, D, in_dtype, specials and key_fmt == "fp8")
        keys = keys.to(device)
    else:
        keys = None
    for pool, fn in ((ref, reference_write), (tri, write_mla_tokens)):
        fn(pool.latent[layer], pool.index_key[layer] if with_keys else None,
           pool.index_scale[layer] if with_keys and pool.index_scale else None,
           pages, offsets, latent, keys, kv, scale)
    differ = (ref.data != tri.data).nonzero()
    assert differ.numel() == 0, f"{len(differ)} bytes differ, first (page, byte): {differ[:8].tolist()}"


@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("kv", ["fp8", "bf16"])
@pytest.mark.parametrize("N", [1, 3, 17, 1000])
def test_k31_layout_bit_equal(kv, N, in_dtype):
    """Real K3.1 geometry (block_size 384 for fp8, 576-wide latent, 128-dim index key), layer 7 of 24."""
    for scale in (1.0, 0.37, 19.0, 0.0123):  # 0.0123: x / s and x * (1 / s) round e4m3 ties differently
        check_write("cuda", "kimi-k3.1-pro", kv, N, in_dtype, scale, layer=7, num_pages=4)


@pytest.mark.parametrize("kv", ["fp8", "bf16"])
def test_tiny_layout_latent_only_int32_slots(kv):
    """Block size 64, no keys written (the index regions must stay untouched), int32 pages/offsets."""
    check_write("cuda", "tiny", kv, 100, torch.float32, 0.37, with_keys=False, index_dtype=torch.int32)
    check_write("cuda", "tiny", kv, 100, torch.bfloat16, 2.0, index_dtype=torch.int32)


FP4_KINDS = ["fp4", "fp8+fp4", "fp4+fp8", "bf16+fp4", "fp4+bf16"]


@pytest.mark.parametrize("kv", FP4_KINDS)
@pytest.mark.parametrize("N", [1, 7, 33, 1000])
def test_fp4_k31_layout_bit_equal(kv, N):
    """K3.1 geometry with NVFP4 latents (576 values: 36 groups, 324-byte rows) and / or MXFP4 keys
    (128 dims: 4 groups), global scales 1 (exact e2m1 ties), 2^-7 and a typical amax / (6 * 448)."""
    for scale, in_dtype in ((1.0, torch.float32), (2.0**-7, torch.bfloat16), (0.0123, torch.float32)):
        check_write("cuda", "kimi-k3.1-pro", kv, N, in_dtype, scale, layer=7, num_pages=4)  # 4 x 256 slots >= 1000


@pytest.mark.parametrize("kv", FP4_KINDS)
def test_fp4_tiny_layout_partial_groups(kv):
    """Tiny geometry: latent 40 (a last NVFP4 group of 8, 27-byte rows), keys 16 (one MXFP4 group
    padded from 16 to 32); int32 slots; and latents only (the index regions must stay untouched)."""
    for N in (1, 7, 33):
        check_write("cuda", "tiny", kv, N, torch.float32, 0.37, num_pages=3)
        check_write("cuda", "tiny", kv, N, torch.bfloat16, 1.0, num_pages=3, index_dtype=torch.int32)
    check_write("cuda", "tiny", kv, 9, torch.float32, 3.0, with_keys=False, num_pages=3)


def test_bf16_cache_nan_stays_nan():
    """NaN bits are the one documented difference for the bf16 cache: only NaN-ness is checked."""
    from kimiserve.ops.cache_write.triton import write_mla_tokens

    ref, tri = _pools("tiny", "bf16", 2, "cuda")
    x = torch.randn(4, ref.latent[0].shape[-1], device="cuda")
    k = torch.randn(4, ref.index_key[0].shape[-1], device="cuda")
    x[1, 3] = k[2, 5] = float("nan")
    pages, offsets = torch.tensor([0, 1, 1, 0], device="cuda"), torch.tensor([5, 0, 63, 6], device="cuda")
    for pool, fn in ((ref, reference_write), (tri, write_mla_tokens)):
        fn(pool.latent[0], pool.index_key[0], None, pages, offsets, x, k, "bf16", 1.0)
    for a, b in ((ref.latent[0], tri.latent[0]), (ref.index_key[0], tri.index_key[0])):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(a.nan_to_num(0.0).view(torch.int16), b.nan_to_num(0.0).view(torch.int16))


def test_rejects_bad_arguments():
    from kimiserve.ops.cache_write.triton import write_mla_tokens

    ref, _ = _pools("tiny", "fp8", 1, "cuda")
    x = torch.randn(1, ref.latent[0].shape[-1], device="cuda")
    p = torch.zeros(1, dtype=torch.int64, device="cuda")
    with pytest.raises(ValueError):
        write_mla_tokens(ref.latent[0], None, None, p, p, x, None, "fp8", 0.0)
    with pytest.raises(ValueError):
        write_mla_tokens(ref.latent[0], None, None, p, p, x, None, "bf16", 1.0)  # an e4m3 view
    with pytest.raises(ValueError):
        write_mla_tokens(ref.latent[0], None, None, p, p, x, None, "fp4", 1.0)  # an e4m3 view, not NVFP4 rows
    four, _ = _pools("tiny", "fp4", 1, "cuda")
    with pytest.raises(ValueError):
        write_mla_tokens(four.latent[0], None, None, p, p, x, None, "fp4", 0.0)
    k = torch.randn(1, four.layout.index_dim, device="cuda")
    with pytest.raises(ValueError):
        write_mla_tokens(four.latent[0], four.index_key[0], None, p, p, x, k, "fp4", 1.0)  # scales missing
    with pytest.raises(ValueError):  # MXFP4 code bytes where fp8 keys are expected
        write_mla_tokens(four.latent[0], four.index_key[0], four.index_scale[0], p, p, x, k, "fp4+fp8", 1.0)


def _interpreter_smoke() -> None:
    """Small CPU cases under TRITON_INTERPRET=1 (the kernel follows torch's CPU division rule there)."""
    import warnings

    warnings.filterwarnings("ignore", category=RuntimeWarning)  # numpy on the NaN / inf inputs
    torch.manual_seed(0)
    for kv in ("fp8", "bf16", *FP4_KINDS):
        for in_dtype in (torch.float32, torch.bfloat16):
            for scale in (1.0, 0.37):
                check_write("cpu", "tiny", kv, 23, in_dtype, scale, specials=kv == "fp8", num_pages=3)
        check_write("cpu", "tiny", kv, 5, torch.float32, 3.0, with_keys=False, index_dtype=torch.int32)
    print("write_mla_tokens interpreter smoke check: bit-equal to the CPU reference")


if __name__ == "__main__":
    _interpreter_smoke()
