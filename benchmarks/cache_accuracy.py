"""What the FP8 and 4-bit caches cost in accuracy: indexer top-k recall, sparse MLA output error, and
greedy agreement of whole-model generation, each against the bf16 cache.

    python benchmarks/cache_accuracy.py [--quick] [--parts 1,2,3] [--out PATH]

1. Indexer top-k recall (`index_recall`). For a decode query over a context of S tokens: the fraction
   of the top-2048 tokens by score with bf16 keys that are also in the top-2048 by score with keys
   read back from the cache, for FP8 keys (`fp8`), MXFP4 keys (`fp4`), MXFP4 keys stored rotated
   by the Hadamard matrix (`fp4_rotated`, the layout's default for fp4 keys) and MXFP4 keys divided by
   a per-channel scale s_c (`fp4_smoothed`: the query is multiplied by it, so scores are unchanged
   before quantisation; here s_c is each channel's RMS over the context, an oracle calibration; in a
   model it can be folded into the key LayerNorm's weight and bias and into wq_b). score_s =
   sum_h w_h ReLU(q_h . k_s) over 32 heads x 128 dims (`indexer_scores`); queries are bf16 in every
   case, so only the keys differ. Also reported: the fraction of the bf16 top-256 kept in the
   quantised top-2048 (`top256_recall`: do the best tokens survive?) and of the planted relevant
   tokens that the bf16 top-2048 holds (`relevant_recall`).
   Data model (index keys come out of a LayerNorm with a learned weight and bias):
   - k_s = r_s * (gamma * a_s) + beta, rounded to bf16. gamma ~ U(0.6, 1.4) per channel, except 4
     outlier channels (random positions; they may share a 32-wide MXFP4 group) with gamma ~ U(10, 30);
     beta ~ N(0, 0.2^2). Outlier channels carry a consistent sign (a_s,c = m_c + 0.5 N(0, 1),
     m_c = +-1), like the massive activations of LLM residual streams. r_s ~ logNormal(0, 0.25):
     per-token norm variation.
   - 16 topics, each a random unit-RMS direction t_j (zero on the outlier channels) carried by 128
     tokens at random positions: a_s = sqrt(1 - rho_s^2) z_s + rho_s t_j, rho_s ~ U(0.3, 0.9) (graded
     relevance); every other token has a_s = z_s ~ N(0, I) on the normal channels.
   - A query picks 2 topics (256 relevant tokens). 16 "topic" heads: q_h = 0.7 t_j + 0.7 z_h
     (alternating between its topics), w_h ~ U(0.5, 1.5); 16 "generic" heads: q_h = z_h, w_h ~
     N(0, 0.5^2) (signed). Query outlier channels ~ N(0, 0.1^2): a token-norm-dependent offset.
   So each query has a few hundred clearly relevant tokens (scores several tail-sigmas up, graded)
   and the rest of its 2048 slots come from a long continuous tail. The same model without the
   outlier channels (`no_outliers`) shows what rotation does when there is nothing to spread.
   Several queries per context; mean and min over queries.

2. Sparse MLA output error (`mla_error`). K3.1 dims: 96 heads, latent 512 NoPE + 64 RoPE, 2048
   selected tokens out of a 4096-token paged context (64-token pages, shuffled page table). Latents:
   NoPE part = RMS-normed N(0, I) times a norm weight ~ U(0.7, 1.3) with 8 channels ~ U(4, 8);
   RoPE part = a per-sequence random vector (pair magnitudes ~ U(0.5, 2)) plus 0.3 N(0, I) noise,
   rotated by each token's position (10000-base frequencies); all bf16. Queries: per (sequence, head)
   a random direction plus a pull towards 16 of the selected tokens; the RoPE query is half as
   large; each head is scaled so its logits over the selected tokens have a std ~ U(1, 3) (from
   broad to peaked softmaxes). Caches are built with `formats.store_latent` and read by
   `paged_sparse_mla_decode` (dtype bf16); the figure is the relative RMS of the latent-space output
   against the bf16-latent cache's output. Variants: `fp8` (scale 1.0, the engine default), `fp4`
   (NVFP4 global scale 1.0, the engine default), `fp4_calibrated` (global = amax / (448 * 6)),
   `fp4_rope_fp8` (NoPE NVFP4, RoPE FP8: the layout keeps RoPE NVFP4 to save 28 B per token),
   `fp4_small` / `fp4_small_calibrated` (the latents / 64 stored, read back times 64: a model whose
   norm weights are small; with global scale 1.0 the e4m3 block scales amax / 6 then go subnormal),
   and `bf16_vs_fp32` (the bf16 cache against exact fp32 latents: the floor).

3. Greedy agreement (`generation`). The offline API with kv_cache_dtype bf16 (reference), fp8, fp4:
   the same random-token prompts, temperature 0, ignore_eos. Per dtype: `prefix_agreement`, the
   fraction of the generated tokens before the first divergence from the reference, and
   `position_agreement`, the fraction of positions with equal tokens; the reference is also rerun
   (`bf16_repeat`) to show the engine's own nondeterminism. The presets have RANDOM weights: their
   next-token distributions are flat and near-tied, and a random model in bf16 is chaotic under
   rounding (see tests/test_gpu.py), so these numbers bound from below what a trained model keeps;
   the fp32 model rows isolate the cache's effect. On the CPU (deterministic) the rerun is skipped.
   The `small` preset's top-k is 2048: prompts shorter than that never read the index keys (dense
   path), the longer ones do.

--quick: CPU-sized contexts, 2 MLA sequences, the tiny preset and 32 tokens (a smoke run).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import shlex
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from kimiserve.cache import formats  # noqa: E402
from kimiserve.ops.indexer.reference import indexer_scores  # noqa: E402
from kimiserve.ops.mla.reference import paged_sparse_mla_decode  # noqa: E402
from kimiserve.ops.quant.reference import FP8_MAX  # noqa: E402
from kimiserve.utils.run_info import git_commit  # noqa: E402

INDEX_FORMATS = {"fp8": ("fp8", False, False), "fp4": ("fp4", False, False), "fp4_rotated": ("fp4", True, False),
                 "fp4_smoothed": ("fp4", False, True)}
"""name: (key format, Hadamard rotation, per-channel smoothing)."""
DEFAULT = dict(contexts=(32768, 1048576), topk=2048, queries=8, mla_batch=8, mla_context=4096, gen_model="small",
               gen_tokens=256, prompt_lens=(384, 384, 3072, 3072))
QUICK = dict(contexts=(8192, 16384), topk=2048, queries=3, mla_batch=2, mla_context=2560, gen_model="tiny",
             gen_tokens=32, prompt_lens=(24, 48, 96))


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - START:6.1f}s] {msg}", file=sys.stderr, flush=True)


START = time.perf_counter()


# 1. indexer top-k recall ---------------------------------------------------------------------
def index_data(context: int, queries: int, heads: int, dim: int, outliers: bool, g: torch.Generator,
               device) -> dict:
    """Keys [S, D] (bf16 values in fp32), queries [Q, Hi, D] (bf16 values), weights [Q, Hi], and each
    query's relevant tokens: the data model of the module docstring."""
    def rand(*shape):
        return torch.rand(*shape, generator=g, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    n_out = 4 if outliers else 0
    out_ch = torch.randperm(dim, generator=g, device=device)[:n_out]
    normal = torch.ones(dim, dtype=torch.bool, device=device)
    normal[out_ch] = False
    gamma = 0.6 + 0.8 * rand(dim)
    gamma[out_ch] = 10 + 20 * rand(n_out)
    beta = 0.2 * randn(dim)
    sign = torch.where(rand(n_out) < 0.5, -1.0, 1.0)

    topics, per_topic = 16, 128
    t = randn(topics, dim) * normal
    t = t / t[:, normal].pow(2).mean(-1, keepdim=True).sqrt()
    a = randn(context, dim) * normal
    a[:, out_ch] = sign + 0.5 * randn(context, n_out)
    pos = torch.randperm(context, generator=g, device=device)[: topics * per_topic].view(topics, per_topic)
    rho = (0.3 + 0.6 * rand(topics, per_topic)).unsqueeze(-1)
    a[pos] = (1 - rho**2).sqrt() * a[pos] * normal + rho * t.unsqueeze(1) + a[pos] * ~normal
    r = torch.exp(0.25 * randn(context, 1))
    keys = (r * gamma * a + beta).bfloat16().float()

    q = torch.empty(queries, heads, dim, device=device)
    w = torch.empty(queries, heads, device=device)
    relevant = []
    half = heads // 2
    for i in range(queries):
        chosen = torch.randperm(topics, generator=g, device=device)[:2]
        relevant.append(pos[chosen].flatten())
        z = randn(heads, dim) * normal
        q[i] = z
        q[i, :half] = 0.7 * t[chosen.repeat(half)[:half]] + 0.7 * z[:half]
        q[i][:, out_ch] = 0.1 * randn(heads, n_out)
        w[i, :half] = 0.5 + rand(half)
        w[i, half:] = 0.5 * randn(heads - half)
    return dict(keys=keys, q=q.bfloat16().float(), w=w, relevant=relevant, outlier_channels=out_ch.tolist())


def read_back_keys(keys: torch.Tensor, fmt: str, rotate: bool, smooth: bool) -> torch.Tensor:
    """The keys as the scan sees them, in their own basis. Smoothing stores k / s and scans with q * s
    (s: each channel's RMS over the context), which leaves every dot product unchanged."""
    s = keys.pow(2).mean(0).sqrt().clamp_min(1e-6) if smooth else 1.0
    return formats.roundtrip_index_key(keys / s, fmt, rotate=rotate) * s


def query_scores(q: torch.Tensor, keys: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 scores [S] of one query q [Hi, D] with weights [Hi] (one query at a time keeps 1M contexts small)."""
    return indexer_scores(q[None, None], keys[None], w[None, None])[0, 0]


def recall_case(context: int, topk: int, queries: int, outliers: bool, seed: int, device) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    d = index_data(context, queries, 32, 128, outliers, g, device)
    keys, q, w = d["keys"], d["q"], d["w"]
    read_back = {name: read_back_keys(keys, *v) for name, v in INDEX_FORMATS.items()}
    stats = {name: dict(recall=[], top256_recall=[], relevant_recall=[]) for name in INDEX_FORMATS}
    bf16_relevant = []
    for i in range(queries):
        ref = torch.topk(query_scores(q[i], keys, w[i]), topk)
        in_ref = torch.zeros(context, dtype=torch.bool, device=device)
        in_ref[ref.indices] = True
        rel = d["relevant"][i]
        bf16_relevant.append(float(in_ref[rel].float().mean()))
        for name, k in read_back.items():
            sel = torch.topk(query_scores(q[i], k, w[i]), topk).indices
            in_sel = torch.zeros(context, dtype=torch.bool, device=device)
            in_sel[sel] = True
            stats[name]["recall"].append(float(in_ref[sel].float().mean()))
            stats[name]["top256_recall"].append(float(in_sel[ref.indices[:256]].float().mean()))
            stats[name]["relevant_recall"].append(float(in_sel[rel].float().mean()))
    result = {"outlier_channels": d["outlier_channels"], "bf16_relevant_recall_mean": _mean(bf16_relevant)}
    for name, s in stats.items():
        key_err = (read_back[name] - keys).norm() / keys.norm()
        result[name] = {"recall_mean": _mean(s["recall"]), "recall_min": min(s["recall"]),
                        "top256_recall_mean": _mean(s["top256_recall"]), "top256_recall_min": min(s["top256_recall"]),
                        "relevant_recall_mean": _mean(s["relevant_recall"]), "key_rel_rms_error": float(key_err),
                        "recall_per_query": s["recall"]}
    return result


def run_index_recall(cfg: dict, device, seed: int) -> dict:
    out = {"topk": cfg["topk"], "queries": cfg["queries"], "index_heads": 32, "index_head_dim": 128,
           "data_model": "LayerNorm-like keys, 4 outlier channels (gamma 10-30, consistent sign), lognormal "
                         "token norms, 16 topics x 128 graded relevant tokens, 2 topics per query; see docstring",
           "contexts": {}}
    for context in cfg["contexts"]:
        out["contexts"][str(context)] = {}
        for variant, outliers in (("outliers", True), ("no_outliers", False)):
            log(f"index recall: context {context}, {variant}")
            out["contexts"][str(context)][variant] = recall_case(context, cfg["topk"], cfg["queries"], outliers,
                                                                 seed + context, device)
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return out


# 2. sparse MLA output error ----------------------------------------------------------------
def rope_rotate(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0) -> torch.Tensor:
    """Rotate pairs (i, i + R/2) of x [..., N, R] by positions [..., N] times base^(-2i/R)."""
    half = x.shape[-1] // 2
    freq = base ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    ang = positions.float().unsqueeze(-1) * freq
    cos, sin = ang.cos(), ang.sin()
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def mla_case(batch: int, context: int, g: torch.Generator, device, heads=96, L=512, R=64, topk=2048, bs=64) -> dict:
    def rand(*shape):
        return torch.rand(*shape, generator=g, device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device)

    weight = 0.7 + 0.6 * rand(L)
    weight[torch.randperm(L, generator=g, device=device)[:8]] = 4 + 4 * rand(8)
    z = randn(batch, context, L)
    nope = z / z.pow(2).mean(-1, keepdim=True).sqrt() * weight
    pair = 0.5 + 1.5 * rand(batch, 1, R // 2)
    base = randn(batch, 1, R) * pair.repeat(1, 1, 2)
    positions = torch.sort(torch.randint(0, 1 << 20, (batch, context), generator=g, device=device), dim=-1).values
    rope = rope_rotate(base + 0.3 * randn(batch, context, R), positions)
    exact = torch.cat([nope, rope], dim=-1)  # [B, C, L + R]: what a fp32 model would cache
    latents = exact.bfloat16()

    pages = context // bs
    tables = torch.randperm(batch * pages, generator=g, device=device).view(batch, pages)
    idx = torch.sort(torch.stack([torch.randperm(context, generator=g, device=device)[:topk]
                                  for _ in range(batch)]), dim=-1).values

    # queries: a random direction plus a pull towards 16 selected tokens, scaled per head to a logit std
    sel = torch.gather(latents.float(), 1, idx.unsqueeze(-1).expand(-1, -1, L + R))  # [B, k, L + R]
    q_lat = torch.nn.functional.normalize(randn(batch, heads, L), dim=-1)
    pick = torch.randint(0, topk, (batch, heads, 16), generator=g, device=device)
    pulled = torch.gather(sel[..., :L].unsqueeze(1).expand(-1, heads, -1, -1), 2,
                          pick.unsqueeze(-1).expand(-1, -1, -1, L)).mean(2)
    q_lat = q_lat + torch.nn.functional.normalize(pulled, dim=-1)
    q_pe = 0.5 * torch.nn.functional.normalize(randn(batch, heads, R), dim=-1) * q_lat.norm(dim=-1, keepdim=True)
    scale = (128 + R) ** -0.5
    logits = torch.einsum("bhl,bkl->bhk", q_lat, sel[..., :L]) + torch.einsum("bhr,bkr->bhk", q_pe, sel[..., L:])
    target = 1 + 2 * rand(batch, heads, 1)
    factor = target / (scale * logits.std(-1, keepdim=True))
    return dict(exact=exact, latents=latents, tables=tables, idx=idx, q_lat=q_lat * factor, q_pe=q_pe * factor,
                scale=scale, bs=bs, L=L)


def paged_cache(values: torch.Tensor, tables: torch.Tensor, bs: int) -> torch.Tensor:
    """[B, C, W] per-sequence rows -> a [P, bs, W] page pool laid out by tables [B, C / bs]."""
    B, C, W = values.shape
    cache = torch.empty(B * (C // bs), bs, W, dtype=values.dtype, device=values.device)
    cache[tables.flatten()] = values.reshape(B * (C // bs), bs, W)
    return cache


def run_mla_error(cfg: dict, device, seed: int) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    c = mla_case(cfg["mla_batch"], cfg["mla_context"], g, device)
    latents, L = c["latents"], c["L"]
    lat = latents.float()
    amax = float(lat.abs().max())
    calibrated = amax / (FP8_MAX * 6)

    def decode(cache, latent_scale, dtype=torch.bfloat16):
        return paged_sparse_mla_decode(c["q_lat"], c["q_pe"], cache, latent_scale, c["tables"], c["idx"], c["scale"],
                                       dtype).float()

    def stored(kv, scale):
        """(output through a cache of this format, the latents as read back)."""
        codes = formats.store_latent(latents, kv, scale)
        read = formats.load_latent(codes, kv, scale, torch.float32, latents.shape[-1])
        return decode(paged_cache(codes, c["tables"], c["bs"]), scale), read

    ref = decode(paged_cache(latents, c["tables"], c["bs"]), None)
    exact = decode(paged_cache(c["exact"], c["tables"], c["bs"]), None, torch.float32)
    fp4 = stored("fp4", 1.0)
    rope_fp8 = torch.cat([fp4[1][..., :L], formats.roundtrip_latent(lat[..., L:], "fp8", 1.0)], dim=-1)
    # name: ((output, the latents it read), (baseline output, the latents they stand for))
    variants = {
        "bf16_vs_fp32": ((ref, lat), (exact, c["exact"])),
        "fp8": (stored("fp8", 1.0), (ref, lat)),
        "fp4": (fp4, (ref, lat)),
        "fp4_calibrated": (stored("fp4", calibrated), (ref, lat)),
        "fp4_rope_fp8": ((decode(paged_cache(rope_fp8, c["tables"], c["bs"]), None), rope_fp8), (ref, lat)),
    }
    small = 1 / 64
    for name, g_scale in (("fp4_small", 1.0), ("fp4_small_calibrated", calibrated * small)):
        read = formats.roundtrip_latent(lat * small, "fp4", g_scale) / small
        variants[name] = ((decode(paged_cache(read, c["tables"], c["bs"]), None), read), (ref, lat))

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    results = {}
    for name, ((out, read), (base, orig)) in variants.items():
        per_head = (out - base).norm(dim=-1) / base.norm(dim=-1)
        results[name] = {"rel_rms": rel(out, base), "rel_rms_per_head_median": float(per_head.median()),
                         "rel_rms_per_head_max": float(per_head.max()), "latent_rel_rms": rel(read, orig),
                         "nope_rel_rms": rel(read[..., :L], orig[..., :L]),
                         "rope_rel_rms": rel(read[..., L:], orig[..., L:])}
    return {"heads": 96, "latent_dim": L, "rope_dim": latents.shape[-1] - L, "selected_tokens": c["idx"].shape[1],
            "context": latents.shape[1], "sequences": latents.shape[0], "latent_amax": amax,
            "nvfp4_global_scale_default": 1.0, "nvfp4_global_scale_calibrated": calibrated,
            "reference": "bf16 latent cache (bf16_vs_fp32: that against fp32 latents and fp32 math)",
            "space": "attention output in latent space [B, H, 512], before w_vc", "results": results}


# 3. greedy agreement -----------------------------------------------------------------------
def agreement(tokens: list[int], ref: list[int]) -> tuple[float, float]:
    n = len(ref)
    same = [a == b for a, b in zip(tokens, ref)] + [False] * (n - min(n, len(tokens)))
    first = same.index(False) if False in same else n
    return first / n, sum(same) / n


def generate(model: str, kv: str, model_dtype: str, prompts, max_tokens: int, device: str, seed: int,
             repeat: bool, forced: list[list[int]] | None = None) -> tuple[list[list[list[int]]], list[list[int]]]:
    """(greedy runs, teacher-forced argmaxes): each run's generated tokens per prompt; then, in the
    same engine, one prefill of prompt + forced tokens per prompt (default: this engine's own first
    run) whose prompt_logprobs give the argmax at every forced position (next-token choices given
    the same context, so one flip does not carry over to the rest of the sequence)."""
    from kimiserve import LLM, SamplingParams

    kw = dict(kv_cache_dtype=kv, dtype=model_dtype, device=device, seed=seed, enable_prefix_caching=False,
              max_model_len=max(len(p) for p in prompts) + max_tokens + 64)
    if device.startswith("cuda"):
        kw["kv_cache_memory_gib"] = 8.0
    llm = LLM(model, **kw)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        runs = []
        for _ in range(2 if repeat else 1):
            outs = llm.generate(prompts, params, use_tqdm=False)
            runs.append([list(o.outputs[0].token_ids) for o in outs])
        forced = runs[0] if forced is None else forced
        scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
        outs = llm.generate([p + f for p, f in zip(prompts, forced)], scoring, use_tqdm=False)
        argmax = [[lp.top[0][0] for lp in o.prompt_logprobs[len(p):]] for o, p in zip(outs, prompts)]
        return runs, argmax
    finally:
        del llm
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()


def run_generation(cfg: dict, device, seed: int) -> dict:
    """Greedy generation with each cache against the bf16 cache's, and the teacher-forced argmax
    agreement over the bf16 cache's generated tokens. "bf16_decode_vs_prefill" calibrates both: the
    bf16 cache's own decode-time tokens against its prefill argmax over the same tokens (the same
    cache, only another kernel path and summation order)."""
    from kimiserve.config import load_preset

    vocab = load_preset(cfg["gen_model"]).vocab_size
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in cfg["prompt_lens"]]
    out = {"model": cfg["gen_model"], "random_weights": True, "max_tokens": cfg["gen_tokens"],
           "prompt_lens": list(cfg["prompt_lens"]), "reference": "bf16", "seed": seed,
           "note": "random-weight preset: flat, near-tied next-token distributions; agreement here bounds a "
                   "trained model's from below", "model_dtypes": {}}
    for model_dtype in cfg["gen_model_dtypes"]:
        rows = {}
        log(f"generation: {cfg['gen_model']} {model_dtype}, kv bf16")
        repeat = device.type == "cuda"
        (ref, *again), ref_forced = generate(cfg["gen_model"], "bf16", model_dtype, prompts, cfg["gen_tokens"],
                                             str(device), seed, repeat)
        runs = {"bf16_repeat": again[0]} if repeat else {}
        forced = {"bf16_decode_vs_prefill": ref}
        for kv in cfg["gen_dtypes"]:
            if kv == "bf16":
                continue
            log(f"generation: {cfg['gen_model']} {model_dtype}, kv {kv}")
            try:
                (runs[kv],), forced[kv] = generate(cfg["gen_model"], kv, model_dtype, prompts, cfg["gen_tokens"],
                                                   str(device), seed, False, forced=ref)
            except Exception as e:  # refused (ValueError) or broken: keep the other dtypes' results
                rows[kv] = {"error": f"{type(e).__name__}: {e}"}
                log(f"generation with kv {kv} failed: {rows[kv]['error']}")
        for kv, toks in runs.items():
            pairs = [agreement(t, r) for t, r in zip(toks, ref)]
            rows[kv] = {"prefix_agreement": _mean([p for p, _ in pairs]),
                        "position_agreement": _mean([a for _, a in pairs]),
                        "prefix_per_prompt": [p for p, _ in pairs], "position_per_prompt": [a for _, a in pairs],
                        "tokens_per_prompt": [len(t) for t in toks]}
        for kv, argmax in forced.items():
            same = [agreement(a, r)[1] for a, r in zip(argmax, ref_forced)]
            rows.setdefault(kv, {}).update(teacher_forced_agreement=_mean(same), teacher_forced_per_prompt=same)
        out["model_dtypes"][model_dtype] = rows
    return out


# driver --------------------------------------------------------------------------------------
def _mean(xs) -> float:
    return float(sum(xs) / len(xs))


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x)


def table(data: dict) -> str:
    lines = []
    if "index_recall" in data:
        r = data["index_recall"]
        lines.append(f"indexer top-{r['topk']} recall vs bf16 keys (mean / min over {r['queries']} queries; "
                     f"top-256 kept)")
        lines.append(f"  {'context':>8} {'data':<12}" + "".join(f"{n:>24}" for n in INDEX_FORMATS))
        for ctx, variants in r["contexts"].items():
            for variant, res in variants.items():
                cells = "".join(f"{res[n]['recall_mean']:>9.4f} /{res[n]['recall_min']:.4f} "
                                f"({res[n]['top256_recall_mean']:.3f})" for n in INDEX_FORMATS)
                lines.append(f"  {ctx:>8} {variant:<12}{cells}")
    if "mla_error" in data:
        m = data["mla_error"]
        lines.append(f"sparse MLA output, relative RMS vs bf16 latents ({m['heads']} heads, {m['selected_tokens']} "
                     f"tokens; global calibrated = {m['nvfp4_global_scale_calibrated']:.3g})")
        lines.append(f"  {'variant':<22}{'output':>10}{'head max':>10}{'latent':>10}{'nope':>10}{'rope':>10}")
        for name, res in m["results"].items():
            lines.append(f"  {name:<22}{res['rel_rms']:>10.4f}{res['rel_rms_per_head_max']:>10.4f}"
                         f"{res['latent_rel_rms']:>10.4f}{res['nope_rel_rms']:>10.4f}{res['rope_rel_rms']:>10.4f}")
    if "generation" in data:
        gen = data["generation"]
        lines.append(f"greedy agreement vs the bf16 cache, {gen['model']} preset (RANDOM weights), "
                     f"{gen['max_tokens']} tokens, prompts {gen['prompt_lens']}")
        lines.append(f"  {'model dtype':<12}{'cache':<24}{'prefix':>10}{'position':>10}{'forced':>10}  "
                     "(forced: teacher-forced argmax vs the bf16 cache's)")
        for model_dtype, rows in gen["model_dtypes"].items():
            for kv, res in rows.items():
                if "error" in res:
                    lines.append(f"  {model_dtype:<12}{kv:<24}  refused: {res['error'][:60]}")
                    continue
                cells = [f"{res[k]:>10.3f}" if k in res else f"{'-':>10}"
                         for k in ("prefix_agreement", "position_agreement", "teacher_forced_agreement")]
                lines.append(f"  {model_dtype:<12}{kv:<24}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--quick", action="store_true", help="CPU-sized smoke configuration")
    parser.add_argument("--parts", default="1,2,3", help="which measurements (1 recall, 2 MLA error, 3 generation)")
    parser.add_argument("--device", default="auto", help="cpu or cuda (auto: cuda when present)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--contexts", type=_ints, default=None, help="index recall contexts, e.g. 32768,1048576")
    parser.add_argument("--topk", type=int, default=None)
    parser.add_argument("--queries", type=int, default=None, help="index queries per context")
    parser.add_argument("--gen-model", default=None, help="preset for part 3 (small; tiny under --quick)")
    parser.add_argument("--gen-tokens", type=int, default=None)
    parser.add_argument("--prompt-lens", type=_ints, default=None)
    parser.add_argument("--gen-dtypes", default="bf16,fp8,fp4", help="cache dtypes of part 3 (bf16 is the reference)")
    parser.add_argument("--gen-model-dtypes", default=None,
                        help="model dtypes of part 3 (default: bfloat16,float32 on CUDA, float32 on CPU)")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available() else
                          "cpu" if args.device == "auto" else args.device)
    cfg = dict(QUICK if args.quick else DEFAULT)
    for key in ("contexts", "topk", "queries", "gen_model", "gen_tokens", "prompt_lens"):
        if getattr(args, key) is not None:
            cfg[key] = getattr(args, key)
    cfg["gen_dtypes"] = tuple(args.gen_dtypes.split(","))
    cfg["gen_model_dtypes"] = tuple((args.gen_model_dtypes or (
        "bfloat16,float32" if device.type == "cuda" else "float32")).split(","))
    parts = set(_ints(args.parts))
    if not parts or parts - {1, 2, 3}:
        parser.error("--parts takes a subset of 1,2,3")

    data = {"benchmark": "cache_accuracy", "device": device.type,
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.machine(),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "torch_version": torch.__version__, "python_version": platform.python_version(),
            "git_commit": git_commit(), "command": shlex.join([Path(sys.executable).name, *sys.argv]),
            "quick": args.quick, "seed": args.seed, "parts": sorted(parts),
            "config": {k: list(v) if isinstance(v, tuple) else v for k, v in cfg.items()}}
    if 1 in parts:
        data["index_recall"] = run_index_recall(cfg, device, args.seed)
    if 2 in parts:
        log("sparse MLA output error")
        data["mla_error"] = run_mla_error(cfg, device, args.seed)
    if 3 in parts:
        data["generation"] = run_generation(cfg, device, args.seed)
    data["wall_seconds"] = time.perf_counter() - START
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    print(table(data))
    refused = [kv for rows in data.get("generation", {}).get("model_dtypes", {}).values()
               for kv, r in rows.items() if "error" in r]
    return 2 if refused else 0


if __name__ == "__main__":
    sys.exit(main())
