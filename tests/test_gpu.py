"""The reference model and ops on CUDA (skipped without a GPU)."""

import time

import pytest
import torch

from conftest import rel_rms
from kimiserve.config import load_preset
from kimiserve.model.model import KimiForCausalLM, build_model
from kimiserve.ops.kda.reference import chunk_kda, kda_gate, recurrent_kda
from kimiserve.ops.norm.reference import l2_normalize

pytestmark = pytest.mark.gpu


def test_tiny_model_on_cuda_matches_cpu():
    cpu = build_model(load_preset("tiny"), torch.float32, seed=0)
    gpu = KimiForCausalLM(cpu.config, torch.float32).cuda().eval()
    gpu.load_state_dict(cpu.state_dict())
    ids = torch.randint(0, 1024, (2, 45))
    assert rel_rms(gpu(ids.cuda()).cpu(), cpu(ids)) < 1e-4


def test_chunk_kda_equals_recurrent_on_cuda():
    B, T, H, K, V = 2, 200, 4, 64, 64
    dev = "cuda"
    q = l2_normalize(torch.randn(B, T, H, K, device=dev))
    k = l2_normalize(torch.randn(B, T, H, K, device=dev))
    v = torch.randn(B, T, H, V, device=dev)
    g = kda_gate(torch.randn(B, T, H, K, device=dev), torch.randn(H, device=dev), torch.randn(H * K, device=dev), -5.0)
    beta = torch.rand(B, T, H, device=dev)
    o_ref, s_ref = recurrent_kda(q, k, v, g, beta)
    o, s = chunk_kda(q, k, v, g, beta)
    assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4


def test_small_preset_forward_on_cuda(capsys):
    """Real per-layer sizes (96 KDA heads, 96 MLA heads, 32 x 128 indexer, top-2048) through the reference ops."""
    config = load_preset("small")
    model = build_model(config, torch.bfloat16, seed=0, device="cuda")
    ids = torch.randint(0, config.vocab_size, (1, 2500), device="cuda")  # longer than index_topk
    torch.cuda.synchronize()
    start = time.perf_counter()
    logits = model(ids)
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    assert logits.shape == (1, 2500, config.vocab_size) and torch.isfinite(logits).all()
    # causality at real sizes: a change at token 2400 leaves earlier logits alone (up to GEMM
    # algorithm choice: the changed token can move to another expert and resize that expert's batch)
    changed = ids.clone()
    changed[0, 2400] = (changed[0, 2400] + 1) % config.vocab_size
    other = model(changed)
    assert rel_rms(other[:, :2400], logits[:, :2400]) < 1e-2 and rel_rms(other[:, 2400:], logits[:, 2400:]) > 1e-2
    with capsys.disabled():
        print(f"\nsmall preset reference forward, 2500 tokens, bf16: {elapsed:.2f} s, "
              f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB")


@pytest.mark.parametrize("dtype,kv", [("float32", "bf16"), ("float32", "fp8"), ("bfloat16", "fp8")])
def test_engine_on_cuda_matches_full_forward(dtype, kv):
    from engine_utils import GREEDY, assert_matches_full_forward, make_engine, random_prompts, run
    from kimiserve.sampling_params import SamplingParams

    engine = make_engine(dtype, kv, device="cuda", max_num_batched_tokens=64)
    prompts = random_prompts([3, 70, 150])
    outs = run(engine, prompts, SamplingParams(max_tokens=16, **GREEDY))
    for i, prompt in enumerate(prompts):
        assert_matches_full_forward(engine, prompt, outs[f"r{i}"].outputs[0].token_ids)
    again = run(engine, [prompts[2]], SamplingParams(max_tokens=4, **GREEDY), ids=["again"])["again"]
    assert again.num_cached_tokens == 149
    engine.check_idle()


def test_small_preset_engine_long_prompt_on_cuda():
    """Real per-layer attention sizes: a 3000-token prompt (chunked) then decode, in bf16 with an fp8 cache."""
    from engine_utils import GREEDY, assert_matches_full_forward, make_engine, run
    from kimiserve.sampling_params import SamplingParams

    engine = make_engine("bfloat16", "fp8", model="small", device="cuda", max_model_len=8192, num_pages=None,
                         kv_cache_memory_gib=8, max_num_batched_tokens=1024)
    prompt = torch.randint(0, engine.config.vocab_size, (3000,), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    out = run(engine, [prompt], SamplingParams(max_tokens=8, **GREEDY))["r0"]
    print(f"small preset: 3000-token prompt + 8 tokens in {time.perf_counter() - start:.2f} s")
    tokens = out.outputs[0].token_ids
    assert len(tokens) == 8
    assert_matches_full_forward(engine, prompt, tokens)
    engine.check_idle()
