"""The whole engine's decode step and prefill (issue 15): `LLMEngine` on a preset, real scheduler,
runner, sampler and detokenizer, CUDA graphs as the engine uses them, against the bytes and FLOPs
the step must move, with the copy bandwidth and the bf16 matmul rate measured in the same run.

Decode rows (`batch` x `context`): the contexts are seeded, not prefilled (`kimiserve.bench.contexts`):
one source prompt of min(context, --source-tokens) tokens is prefilled for real, and every request
gets its own copies of the source's cache pages (tiled to the context's length, index keys redrawn
when tiled) as a prefix-cache snapshot of all but its last prompt token; the engine restores each
request from it like any prefix-cache hit and prefills the last token. The step's cost depends on the
context length (the index scan over every key, the top-k latents, the KDA state pages), not on the
cached values; `setup_s` says what the seeding took. Then each decode step is timed on its own: the
host-clock time between one request's consecutive tokens as `engine.step()` returns them (the
sampled tokens are on the host by then, so the clock covers the GPU work; an engine that overlaps
steps is timed in its steady state), after one untimed decode step (CUDA-graph capture) and one
untimed interval. Every request's last prompt token is its own (the seeded caches are copies of one,
so the batch's tokens, hence its routed experts, would otherwise all be the same).

Bytes per decode step: every weight the step reads (all parameters but the routed experts and the
embedding table, plus one embedding row per token) + the distinct routed experts the batch hit in each
MoE layer (counted by a hook on the routers in eager steps, bytes as stored: MXFP4 codes and scales;
under expert parallelism the rank's own experts, expert 0 included when another rank's pair was
masked onto it) + per sequence and MLA layer the index keys of the whole context and the latents of
the min(context, top-k) selected tokens + per sequence and KDA layer its state page read and
written. Roofline = bytes / copy bandwidth.

Prefill rows: one prompt of `prompt_tokens` prefilled for real after --prefill-warmups untimed ones
of the same length (compiles, autotuning), TTFT = time to its first token (chunked as
--max-num-batched-tokens says); FLOPs (`prefill_flops`) = 2 x the active parameters but
lm_head x tokens + 2 x lm_head once (only the last token's logits are computed) + per token and MLA
layer the attention's 2 x heads x (576 + 512) x min(position + 1, top-k) (q.k over the latent and
rope dims, probs @ latent) and the index scan's 2 x index heads x index dim x (position + 1) (every
visible key); the KDA chunked form's own products (under 1% at these widths) are not counted;
matmul_fraction = FLOPs / TTFT / measured matmul rate.

One engine serves every row (max_model_len fits the longest). `--moe torch` runs the plain-PyTorch
routed experts (the path before the fused kernel) for the baseline beside it. Writes `{"device",
"date", "commit", "copy_gbps", "matmul_tflops", "rows"}`; decode rows carry kind, batch, context,
step_ms, roofline_ms (and tokens/s, bytes, experts hit, setup_s); prefill rows kind, prompt_tokens,
ttft_s, matmul_fraction.

    python benchmarks/e2e_step.py            # issue 15's rows: batch 1,8,64,256 x 4K,128K; 1M at batch 1; prefill 32K, 128K
    python benchmarks/e2e_step.py --quick    # the same rows, 8 timed steps each
    python benchmarks/e2e_step.py --dry-run  # tiny preset on the CPU: the plumbing only
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimiserve.bench.contexts import PoolTooSmall, check_seeded, seed_contexts  # noqa: E402
from kimiserve.engine.args import EngineArgs  # noqa: E402
from kimiserve.engine.engine import LLMEngine  # noqa: E402
from kimiserve.model.expert_layout import moe_layouts  # noqa: E402
from kimiserve.model.inspect import count_params, index_key_bytes, kda_state_bytes_per_layer, latent_bytes  # noqa: E402
from kimiserve.sampling_params import SamplingParams  # noqa: E402
from kimiserve.utils.run_info import git_commit, results_path  # noqa: E402


def use_moe_config(spec: str | None, regime: str = "decode") -> None:
    """The fused MoE's config for one regime (bf16, MXFP4) from now on: "decode" (<= `DECODE_MAX_ROWS` routed rows
    per expert) or "prefill" (more): `spec` (a moe_layer.py variant) where its dequant matches the one the default
    picks for the experts' layout, else the default; "default+OPT+...": the default with moe_layer.py's options
    (`moe_specs.with_options`: pdl, skS, dskS for decode, the `moe_specs.TAILS` names for prefill). Patches
    this process's `ops.moe.triton.default_config` (a benchmark's A/B, not a library setting; the other regime keeps
    what it had)."""
    from kimiserve.ops.moe import triton as moe_triton

    current = moe_triton.default_config
    original = getattr(current, "original", current)
    tiles = dict(getattr(current, "tiles", {}))
    if spec in (None, "default"):
        tiles.pop(regime, None)
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from moe_specs import parse_variant, with_options

        if spec.startswith("default+"):
            options = spec.split("+")[1:]
            with_options(moe_triton.MoEConfig(), options)  # a bad option fails here
            tiles[regime] = options
        else:
            tiles[regime] = parse_variant(spec)
    if not tiles:
        moe_triton.default_config = original
        return

    def patched(num_tokens, top_k, num_experts, dtype, mxfp4, mxfp4_layout="checkpoint", dims=None, num_sms=None,
                dependent_launch=False):
        config = original(num_tokens, top_k, num_experts, dtype, mxfp4, mxfp4_layout, dims, num_sms, dependent_launch)
        rows = num_tokens * top_k / max(1, num_experts)
        tile = tiles.get("decode" if rows <= moe_triton.DECODE_MAX_ROWS else "prefill")
        if isinstance(tile, list):  # options onto the default
            from moe_specs import with_options

            return with_options(config, tile)
        ok = tile is not None and dtype == torch.bfloat16 and mxfp4 and tile.dequant == config.dequant
        return tile if ok else config

    patched.tiles = tiles
    patched.original = original
    moe_triton.default_config = patched


def copy_gbps(device) -> float:
    if device.type != "cuda":
        return float("nan")
    from kimiserve.utils.cuda_timing import cuda_time

    src_bytes = 2 << 30
    src = torch.empty(src_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = cuda_time(lambda: dst.copy_(src), repeats=10)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * src_bytes / ms / 1e6


def matmul_tflops(device) -> float:
    if device.type != "cuda":
        return float("nan")
    from kimiserve.utils.cuda_timing import cuda_time

    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    ms = cuda_time(lambda: a @ b, repeats=10)
    del a, b
    torch.cuda.empty_cache()
    return 2 * 8192**3 / ms / 1e9


class ExpertsHit:
    """Counts the distinct routed experts each MoE layer reads, per engine step: those the router picked
    (under expert parallelism: the rank's own, plus its expert 0 when a pair of another rank's expert
    was masked onto it)."""

    def __init__(self, model):
        self.per_step: list[int] = []
        self._current = 0
        self.handles = [m.gate.register_forward_hook(self._hook(m.experts)) for n, m in model.named_modules()
                        if n.endswith("block_sparse_moe")]

    def _hook(self, experts):
        def hook(module, inputs, output):
            ids = output[0]
            if getattr(experts, "expert_parallel", False):
                local = experts.local_index[ids]
                mine = torch.unique(local[local >= 0])
                self._current += int(mine.numel()) + int(bool((local < 0).any()) and not bool((mine == 0).any()))
            else:
                self._current += int(torch.unique(ids).numel())
        return hook

    def end_step(self) -> None:
        self.per_step.append(self._current)
        self._current = 0


def weight_bytes(model) -> tuple[int, int, int]:
    """(bytes of everything but routed experts and the embedding table, bytes of one routed expert of one
    layer, bytes of one embedding row)."""
    other, expert, row = 0, 0, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * p.element_size()
        if ".experts." in name:
            expert += nbytes // p.shape[0]  # stacked [E, ...]: one expert's share
        elif name.endswith("embed_tokens.weight"):
            row = p.shape[1] * p.element_size()
        else:
            other += nbytes
    num_moe = sum(1 for n, _ in model.named_modules() if n.endswith("block_sparse_moe.experts"))
    return other, expert // max(1, num_moe), row


def synchronize(engine) -> None:
    if engine.device.type == "cuda":
        torch.cuda.synchronize()


def decode_row(engine: LLMEngine, batch: int, context: int, copy: float, steps: int, source_tokens: int,
               count_steps: int = 2) -> dict:
    cfg, layout = engine.config, engine.layout
    gen = torch.Generator().manual_seed(batch * 7919 + context)
    body = torch.randint(0, cfg.vocab_size, (context - 2,), generator=gen).tolist()
    last = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).tolist()
    # distinct first tokens: one snapshot each; distinct last tokens: the seeded contexts are copies of one
    # cache, so without them every sequence would feed the same tokens and route to the same experts
    prompts = [[i % cfg.vocab_size] + body + [last[i]] for i in range(batch)]
    source = torch.randint(0, cfg.vocab_size, (min(context, max(source_tokens, engine.block_size + 2)),),
                           generator=gen).tolist()
    start = time.perf_counter()
    seed_contexts(engine, source, prompts)
    ids = [f"d{batch}x{context}-{i}" for i in range(batch)]
    for rid, prompt in zip(ids, prompts):
        engine.add_request(rid, prompt, SamplingParams(max_tokens=steps + count_steps + 4, temperature=0,
                                                       ignore_eos=True))
    engine.step()
    check_seeded(engine, ids)
    while any(not engine.groups[rid].samples[0].output_ids for rid in ids):  # the last prompt tokens
        engine.step()
    synchronize(engine)
    setup_s = time.perf_counter() - start
    engine.step()  # the first decode step (captures the CUDA graph of this shape)
    first = engine.groups[ids[0]].samples[0]
    times, done = [], len(first.output_ids)
    synchronize(engine)
    clock = time.perf_counter()
    while len(times) < steps + 1:  # the time between a request's tokens (an engine with overlapped steps included)
        engine.step()
        if len(first.output_ids) > done:
            now = time.perf_counter()
            times.append((now - clock) * 1e3 / (len(first.output_ids) - done))
            clock, done = now, len(first.output_ids)
    times = times[1:]  # the first token may come from a step launched before the clock started (async scheduling)
    # a replayed graph runs no Python: count the experts the batch hits in eager steps
    graphs, engine.runner.graphs = engine.runner.graphs, None
    hits = ExpertsHit(engine.model)
    for _ in range(count_steps):
        engine.step()
        hits.end_step()
    for h in hits.handles:
        h.remove()
    engine.runner.graphs = graphs
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    engine.allocator.check_idle()  # every page of the row is back
    other, expert, row = weight_bytes(engine.model)
    mla, kda = len(cfg.full_attn_layers), len(cfg.kda_layers)
    ctx = context + 1 + steps // 2
    latent_format, key_format = layout.kv_cache_dtype.split("+")[0], layout.kv_cache_dtype.split("+")[-1]
    per_seq = mla * (ctx * index_key_bytes(cfg, key_format) +
                     min(ctx, cfg.index_topk or ctx) * latent_bytes(cfg, latent_format)) \
        + 2 * kda * kda_state_bytes_per_layer(engine.model.cache_config)  # the rank's heads under run_one_rank
    experts_hit = statistics.mean(hits.per_step)
    step_bytes = other + batch * row + experts_hit * expert + batch * per_seq
    step_ms = statistics.median(times)
    roofline_ms = step_bytes / copy / 1e6
    return {"kind": "decode", "batch": batch, "context": context, "step_ms": step_ms,
            "tokens_per_s": batch / step_ms * 1e3, "tokens_per_s_per_user": 1e3 / step_ms,
            "experts_hit_per_step": experts_hit, "bytes": step_bytes, "roofline_ms": roofline_ms,
            "roofline_fraction": roofline_ms / step_ms, "step_ms_all": times, "setup_s": setup_s,
            "source_tokens": len(source), "moe": os.environ.get("KIMISERVE_MOE", "default")}


def prefill_once(engine: LLMEngine, prompt: list[int], rid: str) -> float:
    """Seconds from adding the prompt to its first token."""
    synchronize(engine)
    start = time.perf_counter()
    engine.add_request(rid, prompt, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
    while not any(out.outputs[0].token_ids for out in engine.step()):
        pass
    ttft = time.perf_counter() - start
    while engine.has_unfinished_requests():
        engine.step()
    engine.reset_prefix_cache()
    return ttft


def prefill_row(engine: LLMEngine, tokens: int, matmul: float, warmups: int = 1) -> dict:
    cfg = engine.config
    gen = torch.Generator().manual_seed(tokens)
    # untimed prompts of the same length first: the chunk shapes' compiles and autotuning
    warm = [prefill_once(engine, torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).tolist(), f"w{i}")
            for i in range(warmups)]
    ttft = prefill_once(engine, torch.randint(0, cfg.vocab_size, (tokens,), generator=gen).tolist(), "p")
    flops = prefill_flops(cfg, tokens)
    return {"kind": "prefill", "prompt_tokens": tokens, "ttft_s": ttft, "tokens_per_s": tokens / ttft, "warmup_s": warm,
            "flops": flops["total"], "flops_parts": flops,
            "matmul_fraction": flops["total"] / ttft / (matmul * 1e12) if matmul == matmul else None,
            "moe": os.environ.get("KIMISERVE_MOE", "default")}


def prefill_flops(cfg, tokens: int) -> dict[str, int]:
    """Matmul FLOPs of prefilling one prompt of `tokens` tokens (see the module doc): the linear layers
    (active parameters; lm_head for the last token only), the MLA attention over the selected latents
    (absorbed form: q.k over 576 dims, probs @ the 512-dim latent) and the index scan."""
    active = count_params(cfg)["active_params"]
    head = cfg.vocab_size * cfg.hidden_size
    mla = len(cfg.full_attn_layers)
    k = cfg.index_topk or tokens
    attended = sum(min(p + 1, k) for p in range(tokens))
    visible = tokens * (tokens + 1) // 2
    latent = cfg.kv_latent_dim + cfg.kv_lora_rank  # 576 + 512
    body = active - (0 if cfg.tie_word_embeddings else head)  # tied: count_params leaves the shared table out
    parts = {"linear": 2 * body * tokens + 2 * head,
             "attention": mla * 2 * cfg.num_attention_heads * latent * attended,
             "index_scan": mla * 2 * cfg.index_n_heads * cfg.index_head_dim * visible if cfg.has_indexer else 0}
    parts["total"] = sum(parts.values())
    return parts


def print_decode(row: dict, label: str = "") -> None:
    print(f"{label}decode batch {row['batch']:4d} context {row['context']:8d}: step {row['step_ms']:8.3f} ms "
          f"({row['tokens_per_s']:8.1f} tok/s, {row['tokens_per_s_per_user']:6.1f} per user), "
          f"{row['experts_hit_per_step']:.0f} experts hit, roofline {row['roofline_ms']:.3f} ms = "
          f"{100 * row['roofline_fraction']:.1f}% (setup {row['setup_s']:.1f} s)", flush=True)


def result_header(device, copy: float, matmul: float, **extra) -> dict:
    return {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
            "date": datetime.date.today().isoformat(), "commit": git_commit(), "copy_gbps": copy,
            "matmul_tflops": matmul, "command": " ".join(sys.argv), **extra, "rows": []}


def saver(result: dict, path: str):
    def save():
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(result, f, indent=1)
    return save


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--contexts", default="4096,131072", help="contexts run at every batch")
    p.add_argument("--single-contexts", default="1000000", help="contexts run at batch 1 only")
    p.add_argument("--prefill", default="32768,131072", help="prompt lengths to prefill ('' for none)")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--source-tokens", type=int, default=16384,
                   help="longest real prefill the seeded contexts are copied from")
    p.add_argument("--kv-cache-dtype", default="fp8")
    p.add_argument("--cache-gib", type=float, default=None,
                   help="the cache pool in GiB (default: what leaves 20%% of the GPU's memory free once the model is "
                        "loaded, about 90 GiB on an H200 and what an 80 GB card can hold)")
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--prefill-warmups", type=int, default=1,
                   help="untimed prompts of each prefill row's length run before the timed one")
    p.add_argument("--moe", choices=("triton", "torch"), default="triton")
    p.add_argument("--moe-layout", default="",
                   help="the MXFP4 routed experts' code layout(s) for the fused MoE kernel, comma-separated, "
                        "'checkpoint' and/or 'shift' (kimiserve.ops.backend.shift_moe_layout): the decode rows "
                        "run for each, re-laid in place between them ('': the engine's choice)")
    p.add_argument("--projections", default="",
                   help="comma-separated 'stacked' and/or 'separate': the decode rows run with the CUDA default's "
                        "stacked projection GEMMs (kimiserve.ops.backend.fewer_kernel_ops) and/or each projection "
                        "apart (separate_kernel_ops), interleaved per layout ('': the engine's choice)")
    p.add_argument("--shared-experts", default="",
                   help="comma-separated 'serial' and/or 'overlap': the decode rows run with each MoE block's shared "
                        "experts after its routed experts and/or on a second stream beside them "
                        "(kimiserve.ops.backend.shared_expert_overlap_ops) ('': the engine's choice)")
    p.add_argument("--moe-decode-tiles", default="",
                   help="comma-separated fused-MoE configs for the decode regime (<= 8 routed rows per expert), each "
                        "'default', 'default+OPT+...' (the default with moe_layer.py's options: pdl, skS, "
                        "dskS) or a benchmarks/moe_layer.py variant SPEC (e.g. shift-m16-n128-k128-w4-s3): the "
                        "decode rows run for each, graphs captured again between them (an A/B of a default change; "
                        "a SPEC whose dequant does not match the experts' layout leaves the default)")
    p.add_argument("--moe-prefill-tiles", default="",
                   help="comma-separated fused-MoE configs for the prefill regime (> 8 routed rows per expert), each "
                        "'default', 'default+OPT+...' (the default with moe_specs.TAILS' options, e.g. t32) or a "
                        "benchmarks/moe_layer.py variant SPEC: the prefill rows run for each (an A/B "
                        "of a default change; a SPEC whose dequant does not match the experts' layout leaves the "
                        "default)")
    p.add_argument("--quick", action="store_true", help="the same rows, 8 timed steps and 1 expert-count step each")
    p.add_argument("--dry-run", action="store_true", help="tiny preset on the CPU, small sizes")
    p.add_argument("--out", default=None,
                   help="the JSON (default benchmarks/results/e2e_step.json; a CPU smoke run's under the temp dir)")
    args = p.parse_args()
    args.out = args.out or results_path("e2e_step.json", smoke=args.dry_run)
    if args.moe == "torch":
        os.environ["KIMISERVE_MOE"] = "torch"
    count_steps = 2
    if args.quick:
        args.steps, count_steps = 8, 1
    if args.dry_run:
        args.preset, args.batches, args.contexts, args.single_contexts = "tiny", "1,3", "40,300", "700"
        args.prefill, args.steps, args.source_tokens, args.kv_cache_dtype = "100", 3, 130, "bf16"
    device = torch.device("cpu" if args.dry_run else "cuda")
    copy, matmul = copy_gbps(device), matmul_tflops(device)
    result = result_header(device, copy, matmul, preset=args.preset, kv_cache_dtype=args.kv_cache_dtype, moe=args.moe)
    save = saver(result, args.out)
    batches, contexts, singles, prefills = ints(args.batches), ints(args.contexts), ints(args.single_contexts), ints(args.prefill)
    longest = max(contexts + singles + prefills)
    engine = LLMEngine(EngineArgs(
        model=args.preset, dtype="float32" if args.dry_run else "bfloat16", kv_cache_dtype=args.kv_cache_dtype,
        device=device.type, max_model_len=longest + args.steps + count_steps + 16, max_num_seqs=max(batches, default=1),
        enable_prefix_caching=True, max_num_batched_tokens=args.max_num_batched_tokens, seed=0,
        **({"num_pages": 3000} if args.dry_run
           else {"kv_cache_memory_gib": args.cache_gib, "gpu_memory_utilization": 0.8})))
    layouts = [x for x in args.moe_layout.split(",") if x] or [None]
    if any(x not in (None, "checkpoint", "shift") for x in layouts):
        p.error(f"--moe-layout takes 'checkpoint' and/or 'shift', got {args.moe_layout!r}")
    projections = [x for x in args.projections.split(",") if x] or [None]
    if any(x not in (None, "stacked", "separate") for x in projections):
        p.error(f"--projections takes 'stacked' and/or 'separate', got {args.projections!r}")
    shared = [x for x in args.shared_experts.split(",") if x] or [None]
    if any(x not in (None, "serial", "overlap") for x in shared):
        p.error(f"--shared-experts takes 'serial' and/or 'overlap', got {args.shared_experts!r}")
    tiles = [x for x in args.moe_decode_tiles.split(",") if x] or [None]
    base_ops = engine.runner.ops
    plan = [(b, c) for c in contexts for b in batches] + [(1, c) for c in singles]
    for layout, projection, overlap, tile in itertools.product(layouts, projections, shared, tiles):
        from kimiserve.ops import backend

        if args.moe_decode_tiles:
            use_moe_config(tile)
        ops = base_ops
        if layout is not None:
            ops = backend.shift_moe_layout(ops) if layout == "shift" else dataclasses.replace(ops, moe_layout="checkpoint")
        if projection is not None:
            ops = backend.fewer_kernel_ops(ops) if projection == "stacked" else backend.separate_kernel_ops(ops)
        if overlap is not None:
            ops = (backend.shared_expert_overlap_ops(ops) if overlap == "overlap"
                   else dataclasses.replace(ops, overlap_shared_experts=False))
        engine.runner.ops = ops  # the graph sets capture again with them
        result["ops"], result["moe_layouts"] = engine.runner.ops.name, moe_layouts(engine.model)
        print(f"ops {result['ops']}: MXFP4 expert layouts {result['moe_layouts']}", flush=True)
        label = "".join(f"[{x}] " for x in (layout, projection, overlap, tile) if x)
        for batch, context in plan:
            try:
                row = decode_row(engine, batch, context, copy, args.steps, args.source_tokens, count_steps)
            except PoolTooSmall as e:  # a row the card's memory cannot hold: note it, go on with the rest
                result.setdefault("skipped", []).append({"batch": batch, "context": context, "reason": str(e)})
                save()
                print(f"{label}decode batch {batch:4d} context {context:8d}: skipped ({e})", flush=True)
                continue
            row["ops"], row["moe_layouts"] = result["ops"], result["moe_layouts"]
            if tile is not None:
                row["moe_decode_tile"] = tile
            result["rows"].append(row)
            save()
            print_decode(row, label)
    prefill_tiles = [x for x in args.moe_prefill_tiles.split(",") if x] or [None]
    for tile, tokens in itertools.product(prefill_tiles, prefills):
        if args.moe_prefill_tiles:
            use_moe_config(tile, "prefill")
        row = prefill_row(engine, tokens, matmul, args.prefill_warmups)
        if tile is not None:
            row["moe_prefill_tile"] = tile
        result["rows"].append(row)
        save()
        frac = row["matmul_fraction"]
        print(f"prefill {tokens:7d} tokens{f' [{tile}]' if tile else ''}: TTFT {row['ttft_s']:.3f} s "
              f"({row['tokens_per_s']:.0f} tok/s), "
              f"{'n/a' if frac is None else f'{100 * frac:.1f}%'} of the matmul rate on "
              f"{row['flops'] / 1e12:.1f} TFLOP (warm-up runs: {', '.join(f'{w:.2f}' for w in row['warmup_s'])} s)",
              flush=True)
    print(f"\n{result['device']}, commit {result['commit']}: copy {copy:.0f} GB/s, bf16 matmul {matmul:.1f} TFLOP/s, "
          f"MoE {args.moe}, ops {result['ops']}, MXFP4 expert layouts {result['moe_layouts']}")
    save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
