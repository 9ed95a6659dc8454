"""fla-core KDA (`kimiserve.ops.kda.fla`) against the references (`kimiserve.ops.kda.paged`), on CUDA.

States live in the real page pool's strided state view (`PagePool.recurrent`, page stride =
page_bytes); pages the op must not touch hold NaN and must come back bit-identical. q/k/v are bf16
(the engine's activations), g and beta fp32 as the model makes them. Bounds (relative RMS):
- decode (fla's recurrent kernel, fp32 throughout, only o rounded to bf16): o 1e-2, state 1e-4;
- prefill (fla's chunked kernels, bf16 tensor-core dots of decayed q/k): o and state 2e-2.

Interpreter smoke check without a GPU (decode only, tiny sizes; fla's chunked kernels do not run
in Triton 3.6's interpreter):
    python tests/test_fla_kda.py
"""

import sys

if __name__ == "__main__":  # must precede any triton import
    sys.path.insert(0, "tests")
    import triton_interpreter_shims

    triton_interpreter_shims.enable()

import pytest
import torch

from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.ops.kda import paged as ref
from kimiserve.ops.kda.reference import kda_gate
from kimiserve.ops.norm.reference import l2_normalize

pytestmark = pytest.mark.gpu

HEAD_SHAPES = [(4, 16), (4, 128), (96, 16), (96, 128)]  # (H, K = V); tiny is (4, 16), K3.1 (96, 128)


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return float((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30))


def make_pool(H: int, K: int, num_pages: int, device) -> PagePool:
    """A pool of the small preset's page geometry with H heads of dim K, all state pages NaN."""
    cfg = load_preset("small").replace(kda_num_heads=H, kda_head_dim=K)
    pool = PagePool(CacheLayout.from_config(cfg, "fp8", torch.bfloat16), num_pages, device)
    pool.recurrent.fill_(float("nan"))
    return pool


def make_inputs(B: int, T: int, H: int, K: int, device, gen: torch.Generator):
    """q, k (L2-normalised), v in bf16; K3 gate (lower bound -5) with mostly mild decay; beta."""
    r = lambda *s: torch.randn(*s, generator=gen).to(device)
    q = l2_normalize(r(B, T, H, K).bfloat16())
    k = l2_normalize(r(B, T, H, K).bfloat16())
    v = r(B, T, H, K).bfloat16()
    g = kda_gate(r(B, T, H, K) - 3.0, torch.zeros(H, device=device), torch.zeros(H * K, device=device), -5.0)
    beta = torch.sigmoid(r(B, T, H))
    return q, k, v, g, beta


def run_decode_case(B: int, H: int, K: int, device, steps: int = 3) -> None:
    from kimiserve.ops.kda import fla

    gen = torch.Generator().manual_seed(B * 1000 + H + K)
    pool = make_pool(H, K, 2 * B + 3, device)
    pages = torch.randperm(pool.num_pages, generator=gen)[:B].to(device)
    pool.recurrent[pages] = 0.5 * torch.randn(B, H, K, K, generator=gen).to(device)
    ref_states = pool.recurrent.clone()  # the reference runs on a contiguous copy of the pool
    untouched = torch.ones(pool.num_pages, dtype=torch.bool, device=device)
    untouched[pages] = False
    before = pool.data.clone()
    for _ in range(steps):
        q, k, v, g, beta = make_inputs(B, 1, H, K, device, gen)
        o = fla.kda_decode(q, k, v, g, beta, pool.recurrent, pages)
        o_ref = ref.kda_decode(q, k, v, g, beta, ref_states, pages)
        assert o.shape == o_ref.shape and o.dtype == o_ref.dtype and torch.isfinite(o).all()
        assert rel_rms(o, o_ref) < 1e-2, (B, H, K, rel_rms(o, o_ref))
    assert rel_rms(pool.recurrent[pages], ref_states[pages]) < 1e-4
    # every byte of pages the op does not own is as it was (state pages NaN, attention bytes too)
    assert torch.equal(pool.data[untouched], before[untouched])


@pytest.mark.parametrize("H,K", HEAD_SHAPES)
@pytest.mark.parametrize("B", [1, 3, 17])
def test_decode_updates_state_pages_in_place(B, H, K):
    run_decode_case(B, H, K, "cuda")


@pytest.mark.parametrize("H,K", HEAD_SHAPES)
@pytest.mark.parametrize("T", [1, 7, 64, 65, 300])
def test_prefill_matches_reference(T, H, K):
    from kimiserve.ops.kda import fla

    gen = torch.Generator().manual_seed(T * 1000 + H + K)
    pool = make_pool(H, K, 5, "cuda")
    page = torch.tensor([3], device="cuda")
    pool.recurrent[page] = 0.5 * torch.randn(1, H, K, K, generator=gen).cuda()
    q, k, v, g, beta = make_inputs(1, T, H, K, "cuda", gen)
    state0 = pool.recurrent[page]  # a gathered copy, as paged_mix passes it
    o, state = fla.kda_prefill(q, k, v, g, beta, state0.clone())
    o_ref, state_ref = ref.kda_prefill(q, k, v, g, beta, state0)
    assert o.shape == o_ref.shape and o.dtype == torch.bfloat16 and torch.isfinite(o).all()
    assert state.shape == (1, H, K, K) and state.dtype == torch.float32
    assert rel_rms(o, o_ref) < 2e-2, rel_rms(o, o_ref)
    assert rel_rms(state, state_ref) < 2e-2, rel_rms(state, state_ref)


def test_prefill_from_zero_state_then_decode_continues():
    """A 300-token prompt through fla's chunked form, its state stored in a page, then 3 fla decodes
    from that page: the same as the references end to end."""
    from kimiserve.ops.kda import fla

    H, K = 96, 128
    gen = torch.Generator().manual_seed(7)
    pool = make_pool(H, K, 4, "cuda")
    page = torch.tensor([2], device="cuda")
    q, k, v, g, beta = make_inputs(1, 300, H, K, "cuda", gen)
    zero = torch.zeros(1, H, K, K, device="cuda")
    _, pool.recurrent[page] = fla.kda_prefill(q, k, v, g, beta, zero.clone())
    _, s_ref = ref.kda_prefill(q, k, v, g, beta, zero)
    ref_states = pool.recurrent.clone()
    ref_states[page] = s_ref
    for _ in range(3):
        q, k, v, g, beta = make_inputs(1, 1, H, K, "cuda", gen)
        o = fla.kda_decode(q, k, v, g, beta, pool.recurrent, page)
        o_ref = ref.kda_decode(q, k, v, g, beta, ref_states, page)
        assert rel_rms(o, o_ref) < 2e-2
    assert rel_rms(pool.recurrent[page], ref_states[page]) < 2e-2


def test_fp32_prefill_uses_reference():
    """fp32 activations keep the reference's precision (fla's dots would run in tf32)."""
    from kimiserve.ops.kda import fla

    gen = torch.Generator().manual_seed(1)
    q, k, v, g, beta = (t.float() if t.dtype == torch.bfloat16 else t for t in make_inputs(1, 65, 4, 16, "cuda", gen))
    s0 = torch.zeros(1, 4, 16, 16, device="cuda")
    o, s = fla.kda_prefill(q, k, v, g, beta, s0)
    o_ref, s_ref = ref.kda_prefill(q, k, v, g, beta, s0)
    assert torch.equal(o, o_ref) and torch.equal(s, s_ref)


def test_engine_selects_fla_ops():
    from kimiserve.ops import backend
    from kimiserve.ops.kda import fla

    ops = backend.select_decode_ops(torch.device("cuda"))
    assert ops.kda_prefill is fla.kda_prefill and ops.kda_decode is fla.kda_decode


if __name__ == "__main__":
    import kimiserve.ops.kda.fla as fla_module

    # the interpreter runs on CPU tensors: bypass the CUDA device guard of kda_decode
    torch.cuda.device = lambda _: __import__("contextlib").nullcontext()
    for B, H, K in [(1, 2, 16), (3, 2, 16)]:
        run_decode_case(B, H, K, "cpu")
    print("interpreter smoke check passed:", fla_module.__name__)


@pytest.mark.parametrize("varlen_launch", [True, False])
@pytest.mark.parametrize("H,K", HEAD_SHAPES)
def test_varlen_prefill_matches_reference(H, K, varlen_launch):
    """Several sequences packed in one varlen call (what paged_mix runs for a step's prefill chunks),
    each from its own state, against the reference's per-sequence loop."""
    from kimiserve.ops.kda import fla

    gen = torch.Generator().manual_seed(H + K)
    lengths = [1, 7, 64, 65, 300]
    q, k, v, g, beta = make_inputs(1, sum(lengths), H, K, "cuda", gen)
    states = 0.5 * torch.randn(len(lengths), H, K, K, generator=gen).cuda()
    cu = torch.tensor([0] + lengths).cumsum(0)
    o, final = fla.kda_prefill(q, k, v, g, beta, states.clone(), cu, varlen_launch=varlen_launch)
    o_ref, final_ref = ref.kda_prefill(q, k, v, g, beta, states, cu)
    assert o.shape == o_ref.shape and final.shape == (len(lengths), H, K, K) and torch.isfinite(o).all()
    assert rel_rms(o, o_ref) < 2e-2 and rel_rms(final, final_ref) < 2e-2, (rel_rms(o, o_ref), rel_rms(final, final_ref))
