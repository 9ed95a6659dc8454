"""`kimiserve plan`: how many full contexts fit on N GPUs, with the arithmetic shown.

Per GPU = weights + reserve + cache pool. Under both parallel modes the weights are sharded N
ways: tensor parallel over heads (KDA, MLA q_b/kv_b/g/o) and over the dense MLPs, shared experts
and latent-MoE projections, vocab parallel embedding and lm_head, expert parallel routed experts
(DESIGN.md section 4, `kimiserve.distributed`); the parts every head shares (norms, the fp32
router, the MLA latent and KDA low-rank down-projections, the attention-residual projections) and
the whole indexer (every rank computes every index head) are replicated, as the model builds
them. KDA heads are split N ways in both modes, so a rank's state page holds H / N heads. The
modes differ in the MLA cache: under tp the latent is shared by all heads, so every rank holds
every token (tp gives no cache capacity); under dcp (decode context parallel over the same N
GPUs) a sequence's tokens go round-robin over the ranks, so a rank holds ceil(L / N) of them.

Pages are those of the engine: `CacheLayout` of the per-rank config (H / N KDA heads, which sets
block_size), counted with the engine's `pages_for_budget`; a sequence owns ceil(tokens /
block_size) attention pages and one whole page per KDA layer.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from typing import Any

PARALLEL_MODES = ("tp", "dcp")
DEFAULT_RESERVE_GB = 4.0
RESERVE_COVERS = ("CUDA context, cuBLAS/NCCL workspaces, activations of one engine step "
                  "(max_num_batched_tokens 2048: hidden states, attention-residual block snapshots, MoE "
                  "dispatch buffers, indexer score rows), CUDA-graph pools and the engine's graph padding pages, "
                  "allocator fragmentation")
GB = 1e9  # decimal, as GPU memory is sold (an H200 is 141 GB)

# Parameters every rank holds whole: (pattern on the name, what the README and output call them).
REPLICATED = (
    (re.compile(r"\.indexer\."), "indexer (all index heads: wq_b, wk, k_norm, weights_proj)"),
    (re.compile(r"norm\.(weight|bias)$"), "norms"),
    (re.compile(r"block_sparse_moe\.gate\."), "MoE router + score-correction bias"),
    (re.compile(r"_res_proj\.weight$"), "attention-residual score projections"),
    (re.compile(r"self_attn\.(q_a_proj|kv_a_proj_with_mqa)\."), "MLA down-projections (q_a, kv_a: shared latent)"),
    (re.compile(r"self_attn\.(f_a_proj|g_a_proj)\."), "KDA low-rank down-projections (f_a, g_a)"),
)
# Parameters split N ways by tensor parallelism, by part (first match; the layer decides KDA or MLA).
SHARDED = (
    (re.compile(r"\.shared_experts\."), "shared experts"),
    (re.compile(r"\.routed_expert_(down|up)_proj\."), "latent-MoE down/up projections"),
    (re.compile(r"\.mlp\."), "dense MLP"),
)
VOCAB = re.compile(r"(embed_tokens|lm_head)\.weight$")
LAYER = re.compile(r"layers\.(\d+)\.self_attn\.")
DTYPE_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32", "torch.float16": "fp16", "torch.uint8": "mxfp4"}


def _n(x: int) -> str:
    return f"{x:,}"


def _gb(x: float) -> str:
    return f"{x / GB:,.2f} GB"


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ------------------------------------------------------------------------------------------- weights
def weight_groups(config) -> dict[str, Any]:
    """Parameters and bytes of the model as the engine holds it on a GPU (bf16 model dtype; the
    parameters the model keeps in fp32 stay fp32; routed experts as stored), by how they are split.
    Does not depend on the number of GPUs."""
    import torch

    from kimiserve.model.model import KimiForCausalLM

    with torch.device("meta"):
        model = KimiForCausalLM(config, torch.bfloat16)
    experts = {"params": 0, "bytes": 0, "format": "bf16"}
    sharded: dict[str, dict[str, int]] = {}
    vocab = {"params": 0, "bytes": 0, "tables": 0}
    replicated: dict[str, dict[str, int]] = {}
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            # MXFP4: `_packed` holds two 4-bit values per byte, `_scale` one ue8m0 byte per 32 values
            if name.endswith("_packed"):
                experts["format"] = "mxfp4"
            experts["params"] += 0 if name.endswith("_scale") else p.numel() * (2 if name.endswith("_packed") else 1)
            experts["bytes"] += nbytes
            continue
        if VOCAB.search(name):
            vocab["params"] += p.numel()
            vocab["bytes"] += nbytes
            vocab["tables"] += 1
            continue
        dt = DTYPE_NAMES.get(str(p.dtype), str(p.dtype))
        kind = next((label for pattern, label in REPLICATED if pattern.search(name)), None)
        if kind is not None:
            group = replicated.setdefault(f"{kind} ({dt})", {"params": 0, "bytes": 0})
        else:
            group = sharded.setdefault(f"{_sharded_part(config, name)} ({dt})", {"params": 0, "bytes": 0})
        group["params"] += p.numel()
        group["bytes"] += nbytes
    moe_layers = sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    experts.update(num_experts=config.num_experts or 0, moe_layers=moe_layers if config.num_experts else 0)
    vocab["rows"] = config.vocab_size
    return {"routed_experts": experts, "sharded": sharded, "vocab": vocab, "replicated": replicated}


def _sharded_part(config, name: str) -> str:
    label = next((label for pattern, label in SHARDED if pattern.search(name)), None)
    if label is not None:
        return label
    layer = LAYER.search(name)
    if layer is None:
        return "other"
    if config.is_mla_layer(int(layer.group(1))):
        return "MLA heads (q_b or q, kv_b, g, o)"
    return "KDA heads (q/k/v/g/o, conv, f_b, b, A_log, dt_bias)"


def weights_per_gpu(groups: dict[str, Any], n: int) -> dict[str, Any]:
    ex, vocab = groups["routed_experts"], groups["vocab"]
    experts_here = _cdiv(ex["num_experts"], n) if ex["num_experts"] else 0
    ex_bytes = ex["bytes"] // ex["num_experts"] * experts_here if ex["num_experts"] else 0
    sharded = _cdiv(sum(g["bytes"] for g in groups["sharded"].values()), n)
    rows_here = _cdiv(vocab["rows"], n)
    vocab_bytes = vocab["bytes"] // vocab["rows"] * rows_here if vocab["rows"] else 0
    replicated = sum(g["bytes"] for g in groups["replicated"].values())
    return {"experts_per_gpu": experts_here, "routed_experts": ex_bytes, "sharded": sharded,
            "vocab_rows_per_gpu": rows_here, "vocab": vocab_bytes, "replicated": replicated,
            "total": ex_bytes + sharded + vocab_bytes + replicated}


# ------------------------------------------------------------------------------------------- checks
def _head_counts(config) -> dict[str, int]:
    heads = {}
    if config.kda_layers:
        heads["KDA"] = config.kda_num_heads
    if config.full_attn_layers:
        heads["MLA"] = config.num_attention_heads  # the indexer is replicated: its heads need not divide
    return heads


def check_inputs(config, gpu_mem_gb: float, gpus: int, parallel: str, kv_cache_dtype: str, context: int,
                 gpu_memory_utilization: float, reserve_gb: float) -> None:
    """ValueError naming the bad value (the CLI turns it into exit code 2)."""
    from kimiserve.cache.formats import check_kv_cache_dtype

    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"--gpus must be >= 1, got {gpus}")
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"--parallel must be one of {', '.join(PARALLEL_MODES)}, got {parallel!r}")
    if not isinstance(context, int) or context < 1:
        raise ValueError(f"--context must be >= 1 token, got {context}")
    if not math.isfinite(gpu_mem_gb) or gpu_mem_gb <= 0:
        raise ValueError(f"--gpu-mem must be a positive number of GB, got {gpu_mem_gb}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {gpu_memory_utilization}")
    if not math.isfinite(reserve_gb) or reserve_gb < 0:
        raise ValueError(f"--reserve-gb must be >= 0, got {reserve_gb}")
    check_kv_cache_dtype(kv_cache_dtype)
    for what, heads in _head_counts(config).items():
        if heads % gpus:
            raise ValueError(f"--gpus {gpus} does not divide the {heads} {what} heads (tensor parallel splits "
                             f"heads evenly over the GPUs)")


# ------------------------------------------------------------------------------------------- the plan
def rank_layout(config, kv_cache_dtype: str, gpus: int):
    """The page layout of one rank: H / N KDA heads per state page, every MLA layer's latent and index key."""
    import torch

    from kimiserve.cache.layout import CacheLayout
    from kimiserve.distributed.parallel_state import ParallelConfig

    rank = ParallelConfig(gpus).cache_config(config)  # what the engine lays a rank's pool out from
    # rotation changes no byte (and would reject a non power-of-two index_head_dim the engine can still serve)
    return CacheLayout.from_config(rank, kv_cache_dtype, torch.bfloat16, index_key_rotation=False)


def compute_plan(config, gpu_mem_gb: float, gpus: int, parallel: str, kv_cache_dtype: str, context: int,
                 gpu_memory_utilization: float = 0.9, reserve_gb: float = DEFAULT_RESERVE_GB,
                 model: str = "", groups: dict[str, Any] | None = None, hints: bool = True) -> dict[str, Any]:
    from kimiserve.engine.args import pages_for_budget
    from kimiserve.model.inspect import count_params

    check_inputs(config, gpu_mem_gb, gpus, parallel, kv_cache_dtype, context, gpu_memory_utilization, reserve_gb)
    groups = weight_groups(config) if groups is None else groups
    w = weights_per_gpu(groups, gpus)
    layout = rank_layout(config, kv_cache_dtype, gpus)
    bs, page = layout.block_size, layout.page_bytes
    n_kda, n_mla = len(config.kda_layers), layout.num_mla_layers

    per_layer = lambda regions: regions[0].nbytes // bs if regions else 0  # noqa: E731
    attention_page = _align16(max((r.offset + r.nbytes for r in layout.latent + layout.index_key + layout.index_scale),
                                  default=0))
    cache = {
        "block_size": bs, "page_bytes": page, "attention_page_bytes": attention_page,
        "state_page_bytes": layout.state_bytes, "mla_layers": n_mla,
        "latent_bytes_per_token_per_layer": per_layer(layout.latent),
        "index_key_bytes_per_token_per_layer": per_layer(layout.index_key),
        "index_scale_bytes_per_token_per_layer": per_layer(layout.index_scale),
        "bytes_per_token_per_gpu": layout.token_bytes,
        "tokens_per_gpu": context if parallel == "tp" else _cdiv(context, gpus),
    }
    kda = {
        "layers": n_kda, "heads_per_gpu": config.kda_num_heads // gpus if n_kda else 0,
        "head_dim": config.kda_head_dim, "conv_size": config.kda_conv_size,
        "recurrent_bytes": layout.recurrent.nbytes if layout.recurrent else 0,
        "conv_bytes": layout.conv.nbytes if layout.conv else 0,
        "state_bytes_per_layer": layout.state_bytes, "state_pages_per_seq": n_kda,
        "bytes_per_seq_per_gpu": n_kda * page,
    }
    usable = int(gpu_mem_gb * GB * gpu_memory_utilization)
    reserve = int(reserve_gb * GB)
    left = usable - w["total"] - reserve
    available = max(0, left)
    pages = pages_for_budget(available, page)
    attn_pages = _cdiv(cache["tokens_per_gpu"], bs) if n_mla else 0
    per_seq = attn_pages + n_kda
    full = pages // per_seq if per_seq else None
    spare = pages - n_kda
    # one sequence alone: every page not holding its KDA states holds its tokens (N ranks' worth under dcp)
    if not n_mla:
        longest = None if spare >= 0 else 0
    else:
        longest = max(0, spare) * bs * (gpus if parallel == "dcp" else 1)
    fit = {
        "usable_bytes": usable, "reserve_bytes": reserve, "available_bytes": available,
        "shortfall_bytes": max(0, -left), "pages_per_gpu": pages,
        "attention_pages_per_seq": attn_pages, "state_pages_per_seq": n_kda, "pages_per_seq": per_seq,
        "bytes_per_seq_per_gpu": per_seq * page, "full_contexts": full, "max_single_context": longest,
        "weights_fit": w["total"] + reserve <= usable,
    }
    plan = {
        "model": model, "gpus": gpus, "parallel": parallel, "kv_cache_dtype": kv_cache_dtype, "context": context,
        "gpu_mem_gb": gpu_mem_gb, "gpu_memory_utilization": gpu_memory_utilization, "reserve_gb": reserve_gb,
        "max_position_embeddings": config.max_position_embeddings,
        "weights": {"total_params": count_params(config)["total_params"], "groups": groups, "per_gpu": w},
        "kda": kda, "cache": cache, "fit": fit,
    }
    if hints and not full:
        plan["hints"] = _hints(config, plan, groups)
    return plan


def _align16(n: int) -> int:
    return -(-n // 16) * 16


def _hints(config, plan: dict[str, Any], groups: dict[str, Any]) -> dict[str, Any]:
    """What would fit one full context: the least GPU memory at this --gpus, the fewest --gpus at this memory."""
    fit = plan["fit"]
    need = plan["weights"]["per_gpu"]["total"] + fit["reserve_bytes"] + fit["bytes_per_seq_per_gpu"]
    hints: dict[str, Any] = {"min_gpu_mem_gb": math.ceil(need / plan["gpu_memory_utilization"] / GB * 100) / 100,
                             "min_gpus": None}
    heads = list(_head_counts(config).values())
    limit = math.gcd(*heads) if heads else 1024
    for n in range(plan["gpus"] + 1, limit + 1):
        if all(h % n == 0 for h in heads):
            other = compute_plan(config, plan["gpu_mem_gb"], n, plan["parallel"], plan["kv_cache_dtype"],
                                 plan["context"], plan["gpu_memory_utilization"], plan["reserve_gb"],
                                 groups=groups, hints=False)
            if other["fit"]["full_contexts"]:
                hints["min_gpus"] = n
                break
    return hints


# ------------------------------------------------------------------------------------------- output
def format_plan(p: dict[str, Any]) -> str:
    N, mode, L = p["gpus"], p["parallel"], p["context"]
    groups, w = p["weights"]["groups"], p["weights"]["per_gpu"]
    kda, cache, fit = p["kda"], p["cache"], p["fit"]
    ex, vocab = groups["routed_experts"], groups["vocab"]
    out = [
        f"kimiserve plan: {p['model']} on {N} GPUs x {p['gpu_mem_gb']:g} GB, {mode}{N}, kv_cache_dtype "
        f"{p['kv_cache_dtype']}, context {_n(L)} tokens"
        + (f" (longer than the model's {_n(p['max_position_embeddings'])})" if L > p["max_position_embeddings"] else ""),
        "",
        f"weights per GPU ({_n(p['weights']['total_params'])} params; sharded {N} ways in both tp and dcp)",
    ]
    if ex["num_experts"]:
        if ex["format"] == "mxfp4":
            rate = f"{_n(ex['params'])} values x (4 bits + 8 bits / 32 per ue8m0 scale) = {_n(ex['bytes'])} B"
        else:
            rate = f"{_n(ex['params'])} params x 2 B = {_n(ex['bytes'])} B"
        out.append(f"  routed experts ({ex['format']}, expert parallel): {rate}; {_n(w['experts_per_gpu'])} of "
                   f"{_n(ex['num_experts'])} experts per GPU (ceil({ex['num_experts']} / {N})) x {ex['moe_layers']} MoE "
                   f"layers -> {_n(ex['bytes'])} x {w['experts_per_gpu']} / {ex['num_experts']} = {_n(w['routed_experts'])} B")
    sh = groups["sharded"]
    out.append(f"  tensor parallel: {_n(sum(g['params'] for g in sh.values()))} params = "
               f"{_n(sum(g['bytes'] for g in sh.values()))} B; ceil(that / {N}) = {_n(w['sharded'])} B")
    for label, g in sh.items():
        out.append(f"    {label}: {_n(g['params'])} params, {_n(g['bytes'])} B")
    if vocab["tables"]:
        row = vocab["bytes"] // vocab["rows"]
        out.append(f"  vocab parallel (embedding + lm_head, {vocab['tables']} tables): {_n(vocab['params'])} params = "
                   f"{_n(vocab['bytes'])} B; ceil({_n(vocab['rows'])} / {N}) = {_n(w['vocab_rows_per_gpu'])} rows x "
                   f"{_n(row)} B -> {_n(w['vocab'])} B")
    rep = groups["replicated"]
    out.append(f"  replicated on every GPU: {_n(sum(g['params'] for g in rep.values()))} params = {_n(w['replicated'])} B")
    for label, g in rep.items():
        out.append(f"    {label}: {_n(g['params'])} params, {_n(g['bytes'])} B")
    terms = [w["routed_experts"], w["sharded"], w["vocab"], w["replicated"]]
    out.append(f"  weights per GPU = {' + '.join(_n(t) for t in terms if t)} = {_n(w['total'])} B ({_gb(w['total'])})")

    out += ["", f"KDA state per sequence per GPU ({kda['layers']} KDA layers)"]
    if kda["layers"]:
        H, K, W = kda["heads_per_gpu"], kda["head_dim"], kda["conv_size"] - 1
        out += [
            f"  heads per GPU = {H * N} / {N} = {H}",
            f"  recurrent fp32 [{H}, {K}, {K}] = {H} x {K} x {K} x 4 = {_n(kda['recurrent_bytes'])} B; "
            f"conv bf16 [3, {H} x {K}, {W}] = 3 x {H * K} x {W} x 2 = {_n(kda['conv_bytes'])} B",
            f"  state = recurrent + conv (each region 16-byte aligned) = {_n(kda['state_bytes_per_layer'])} B per KDA layer",
            f"  one whole page per KDA layer: {kda['layers']} x {_n(cache['page_bytes'])} B = "
            f"{_n(kda['bytes_per_seq_per_gpu'])} B ({_gb(kda['bytes_per_seq_per_gpu'])})",
        ]
    else:
        out.append("  none (no KDA layers)")

    out += ["", f"cache per token per GPU (kv_cache_dtype {p['kv_cache_dtype']})"]
    parts = [f"latent {cache['latent_bytes_per_token_per_layer']} B"]
    if cache["index_key_bytes_per_token_per_layer"]:
        parts.append(f"index key {cache['index_key_bytes_per_token_per_layer']} B")
    if cache["index_scale_bytes_per_token_per_layer"]:
        parts.append(f"key scale {cache['index_scale_bytes_per_token_per_layer']} B")
    out += [
        f"  {cache['mla_layers']} MLA layers x ({' + '.join(parts)}) = {_n(cache['bytes_per_token_per_gpu'])} B per token",
        f"  block_size {cache['block_size']} tokens (smallest multiple of 64 whose attention page >= a "
        f"{_n(cache['state_page_bytes'])} B state page); attention page {_n(cache['attention_page_bytes'])} B; "
        f"page_bytes {_n(cache['page_bytes'])}",
    ]
    if mode == "tp":
        out.append(f"  tp{N}: the MLA latent is shared by all heads, so every rank holds every token: "
                   f"{_n(cache['tokens_per_gpu'])} tokens per GPU (tp adds no cache capacity)")
    else:
        out.append(f"  dcp{N}: tokens round-robin over {N} ranks: ceil({_n(L)} / {N}) = {_n(cache['tokens_per_gpu'])} "
                   f"tokens per GPU")

    out += [
        "",
        "fit",
        f"  usable = {p['gpu_mem_gb']:g} GB x {p['gpu_memory_utilization']:g} = {_n(fit['usable_bytes'])} B",
        f"  reserve = {p['reserve_gb']:g} GB (--reserve-gb: {RESERVE_COVERS})",
    ]
    avail = f"  available for the cache = {_n(fit['usable_bytes'])} - {_n(w['total'])} (weights) - " \
            f"{_n(fit['reserve_bytes'])} (reserve)"
    if not fit["weights_fit"]:
        out += [
            f"{avail}: none, {_n(fit['shortfall_bytes'])} B ({_gb(fit['shortfall_bytes'])}) short",
            f"  NOTHING FITS: weights ({_gb(w['total'])}) + reserve ({_gb(fit['reserve_bytes'])}) exceed the usable "
            f"{_gb(fit['usable_bytes'])} per GPU",
        ]
    else:
        out.append(f"{avail} = {_n(fit['available_bytes'])} B ({_gb(fit['available_bytes'])})")
        out += [
            f"  pages per GPU = floor({_n(fit['available_bytes'])} / {_n(cache['page_bytes'])}) = {_n(fit['pages_per_gpu'])}",
            f"  per sequence per GPU = ceil({_n(cache['tokens_per_gpu'])} / {cache['block_size']}) = "
            f"{_n(fit['attention_pages_per_seq'])} attention pages + {fit['state_pages_per_seq']} state pages = "
            f"{_n(fit['pages_per_seq'])} pages ({_gb(fit['bytes_per_seq_per_gpu'])})",
        ]
        if fit["full_contexts"] is not None:
            out.append(f"  full contexts of {_n(L)} tokens: floor({_n(fit['pages_per_gpu'])} / {_n(fit['pages_per_seq'])}) "
                       f"= {_n(fit['full_contexts'])}")
        if fit["max_single_context"] is None:
            out.append("  longest single context: unbounded (no MLA layers: only KDA state, no per-token cache)")
        else:
            ranks = f" x {N} ranks" if mode == "dcp" else ""
            out.append(f"  longest single context: ({_n(fit['pages_per_gpu'])} - {fit['state_pages_per_seq']}) pages x "
                       f"{cache['block_size']} tokens{ranks} = {_n(fit['max_single_context'])} tokens"
                       + (f" (beyond the model's {_n(p['max_position_embeddings'])})"
                          if fit["max_single_context"] > p["max_position_embeddings"] else ""))
        if fit["full_contexts"] == 0:
            out.append(f"  NOTHING FITS: one context of {_n(L)} tokens needs {_n(fit['pages_per_seq'])} pages per GPU, "
                       f"the cache has {_n(fit['pages_per_gpu'])}")
    if "hints" in p:
        h = p["hints"]
        line = f"  one full context would fit with --gpu-mem {h['min_gpu_mem_gb']:g} at {N} GPUs"
        if h["min_gpus"]:
            line += f", or with --gpus {h['min_gpus']} at {p['gpu_mem_gb']:g} GB"
        out.append(line)
    answer = fit["full_contexts"] if fit["weights_fit"] else 0
    out += ["", f"answer: {_n(answer or 0)} full context{'' if answer == 1 else 's'} of {_n(L)} tokens"
            + (f"; longest single context {_n(fit['max_single_context'])} tokens"
               if fit["weights_fit"] and fit["max_single_context"] is not None else "")]
    return "\n".join(out)


# ------------------------------------------------------------------------------------------- CLI
def add_cli_args(p: argparse.ArgumentParser) -> None:
    from kimiserve.cache.formats import KV_CACHE_DTYPES

    p.add_argument("--model", required=True, help="a preset (tiny, small, kimi-k3.1-pro) or a model folder")
    p.add_argument("--gpu-mem", type=float, required=True, help="memory per GPU in decimal GB (H200: 141)")
    p.add_argument("--gpus", type=int, required=True, help="GPUs N; the weights are sharded N ways")
    p.add_argument("--parallel", required=True, choices=PARALLEL_MODES,
                   help="tp: tensor parallel, every rank caches every token; dcp: decode context parallel, "
                        "each rank caches ceil(L / N) tokens of a sequence")
    p.add_argument("--kv-cache-dtype", required=True, choices=KV_CACHE_DTYPES, help="cache dtype of MLA latents and index keys")
    p.add_argument("--context", type=int, required=True, help="tokens per sequence L")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of each GPU's memory the engine may use (weights + reserve + cache)")
    p.add_argument("--reserve-gb", type=float, default=DEFAULT_RESERVE_GB,
                   help=f"per-GPU memory kept out of the cache, GB (default {DEFAULT_RESERVE_GB:g}: {RESERVE_COVERS})")
    p.add_argument("--json", action="store_true", help="print JSON instead of the worked arithmetic")


def run(args: argparse.Namespace) -> int:
    from kimiserve.config import resolve_model

    config = resolve_model(args.model)
    plan = compute_plan(config, args.gpu_mem, args.gpus, args.parallel, args.kv_cache_dtype, args.context,
                        args.gpu_memory_utilization, args.reserve_gb, model=args.model)
    print(json.dumps(plan, indent=2) if args.json else format_plan(plan))
    return 0
