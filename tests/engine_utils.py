"""Helpers for engine tests: run requests to completion, record logits, compare with a full forward."""

from __future__ import annotations

import statistics

import torch

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams

GREEDY = dict(temperature=0.0, ignore_eos=True)


def make_engine(dtype="float32", kv="bf16", **kwargs) -> LLMEngine:
    kwargs = {"max_model_len": 512, "num_pages": 200, **kwargs}
    engine = LLMEngine(EngineArgs(model="tiny", dtype=dtype, kv_cache_dtype=kv, **kwargs))
    engine.recorded = {}  # (prompt ids, sample index, output position) -> logits row the sampler saw
    sampler = engine.runner.sampler

    def recording_sampler(logits, requests):
        for row, r in zip(logits, requests):
            engine.recorded[(tuple(r.prompt_ids), r.seed, len(r.output_ids))] = row.clone()
        return sampler(logits, requests)

    engine.runner.sampler = recording_sampler
    return engine


def random_prompts(lengths, seed=1, vocab=768) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]


def run(engine: LLMEngine, prompts, params: SamplingParams | list[SamplingParams], ids=None, max_steps=10_000):
    """Add the prompts, step until done; returns {request id: final RequestOutput}."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    ids = ids or [f"r{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(rid, prompt, p)
    outs = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = out
    assert not engine.has_unfinished_requests(), "engine did not finish"
    return outs


def compare_with_full_forward(engine: LLMEngine, prompt: list[int], tokens: list[int], seed=None):
    """Relative errors and argmax agreement of the engine's logits at each sampled position vs the
    full-sequence forward of prompt + tokens (with the cache dtype's round trip)."""
    ref = engine.model(torch.tensor(prompt + tokens), kv_cache_dtype=engine.layout.kv_cache_dtype)
    errors, agree = [], []
    for step in range(len(tokens)):
        row = engine.recorded[(tuple(prompt), seed, step)]
        expected = ref[len(prompt) - 1 + step]
        errors.append(float((row - expected).norm() / expected.norm()))
        agree.append(bool(row.argmax() == expected.argmax()))
    return errors, agree, ref


def assert_matches_full_forward(engine, prompt, tokens, seed=None):
    """Tolerances, from measurements on this model (the test module docstring has the story):

    fp32 model: the median row error <= 1e-4 (measured ~2e-6); at most max(1, 10%) of the rows
    off by more than 1e-3 or with another argmax. A row can be off when a near-tie at the top-k
    boundary of the indexer picks the other token (seen: the 8th pick 45 instead of 50, error
    0.05); ulp differences of another summation order also grow where they flip a bf16/fp8
    rounding of the cache.
    bf16 model: bf16's own rounding noise on this random tiny model is large (the bf16 and fp32
    forwards of the same weights differ by 44% rms, argmax equal at 53% of positions), because an
    ulp flips discrete choices (top-k tokens, routed experts). The engine must stay within that
    noise: median row error <= 0.5 and argmax equal at >= 50% of the positions (a broken cache
    gives errors near 1.4 and ~0.1% agreement).
    """
    errors, agree, _ = compare_with_full_forward(engine, prompt, tokens, seed)
    n = len(errors)
    if engine.dtype == torch.float32:
        allowed = max(1, n // 10)
        assert statistics.median(errors) <= 1e-4, errors
        assert sum(e > 1e-3 for e in errors) <= allowed, errors
        assert n - sum(agree) <= allowed, agree
    else:
        assert statistics.median(errors) <= 0.5, errors
        assert sum(agree) >= 0.5 * n, agree
