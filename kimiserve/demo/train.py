"""Training of the demo model: config, batches, the loop (wall-clock budgeted) and the release-format export.

`scripts/train_demo.py` is the command line. The schedule runs on the fraction of the wall-clock
budget spent, so a run stops on time at the end of its schedule whatever the hardware's speed:
learning-rate warmup then cosine decay to 10%; MLA dense with the indexer learning by KL, then
sparse (the indexer's top-k, as served) from `sparse_from`; MXFP4 fake quantisation of the routed
experts from `fake_quant_from`. Routers are balanced without an auxiliary loss (noaux_tc): each
step moves every score-correction bias by `bias_rate` towards the mean load.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kimiserve.config import ModelConfig
from kimiserve.demo import corpus
from kimiserve.model.loader import load_model, save_checkpoint
from kimiserve.model.model import build_model
from kimiserve.model.training import TrainContext, enable_training, train_logits
from kimiserve.ops.quant.reference import dequantize_mxfp4, quantize_mxfp4
from kimiserve.tokenizer import load_tokenizer

TOKENIZER_DIR = Path(__file__).resolve().parent.parent / "presets" / "tiny"
TOKENIZER_FILES = ("tiktoken.model", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PAD_ID = 1023


def demo_config(**changes) -> ModelConfig:
    """The demo model: 8 layers (6 KDA, 2 MLA with the indexer, top-128), LatentMoE with 16 MXFP4 routed
    experts (2 active) and 2 shared experts, attention residuals in blocks of 4, Kimi's byte-level
    1024-token vocabulary. ~9M parameters, ~12 MB as released."""
    base = dict(
        architecture="KimiK3ForConditionalGeneration", vocab_size=1024, hidden_size=256, num_hidden_layers=8,
        max_position_embeddings=262144, bos_token_id=768, eos_token_id=770, pad_token_id=PAD_ID,
        full_attn_layers=(3, 7), kda_num_heads=4, kda_head_dim=64, kda_conv_size=4, gate_lower_bound=-5.0,
        num_attention_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=32,
        v_head_dim=64, index_n_heads=4, index_head_dim=32, index_topk=128,
        hidden_act="situ", intermediate_size=768, first_k_dense_replace=1, num_experts=16, num_experts_per_token=2,
        num_shared_experts=2, moe_intermediate_size=128, routed_expert_hidden_size=128, attn_res_block_size=4,
        routed_experts_mxfp4=True,
    )
    base.update(changes)
    return ModelConfig(**base)


def draft_config(**changes) -> ModelConfig:
    """The demo model's draft for speculative decoding (`kimi-demo-draft`, v4): the demo model's widths and
    vocabulary in 2 layers (1 KDA, 1 MLA with the indexer) with dense MLPs (no router, no routed experts),
    ~2.4M parameters, ~4.8 MB as released. Few kernels per step, which is what a small model's step costs on a
    GPU (the v3 draft, 4 layers at hidden 128 with routed experts, cost about half a target step there)."""
    return demo_config(**{**dict(num_hidden_layers=2, full_attn_layers=(1,), first_k_dense_replace=2,
                                 attn_res_block_size=2), **changes})


def tiny_train_config(**changes) -> ModelConfig:
    """A very small model of the same structure (tests)."""
    return demo_config(**{**dict(hidden_size=64, num_hidden_layers=4, full_attn_layers=(1, 3), kda_head_dim=16,
                                 q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                 v_head_dim=16, index_head_dim=16, index_topk=16, intermediate_size=128,
                                 num_experts=8, moe_intermediate_size=32, routed_expert_hidden_size=32,
                                 attn_res_block_size=2), **changes})


@dataclass
class TrainArgs:
    """Options of a training run (the command line's)."""

    model: str = "demo"
    """Model size: demo (kimi-demo, `demo_config`), demo-draft (kimi-demo-draft, its speculative-decoding
    draft, `draft_config`) or tiny (same structure, for smoke runs and tests)."""
    out: str = "kimi-demo"
    """Model folder to write (release format; an intermediate export every `export_every_minutes`)."""
    device: str = "cuda"
    """Where to train: cuda or cpu."""
    max_minutes: float = 8.0
    """Wall-clock budget of the training loop (the schedule is laid out over it); export follows."""
    max_steps: int | None = None
    """Stop after this many steps (None: only the budget stops the run); the schedule then runs on
    whichever of the budget and the steps is spent faster."""
    seed: int = 0
    """Seed of the weights, the corpus and the batch order."""
    tokens_per_step: int = 98304
    """Padded tokens per optimizer step (a batch of equal-length rows)."""
    max_seq_len: int = 1280
    """Examples longer than this are skipped."""
    max_filler_tokens: int = 900
    """Passkey filler in training: uniform in [0, this] tokens."""
    lr: float = 2e-3
    """Peak learning rate (AdamW)."""
    weight_decay: float = 0.1
    """AdamW weight decay on matrices."""
    warmup_steps: int = 40
    """Linear warmup steps (a 6-minute H200 run makes ~350 steps)."""
    sparse_from: float = 0.5
    """Budget fraction from which MLA attends only the indexer's top-k (as served)."""
    fake_quant_from: float = 0.8
    """Budget fraction from which the routed experts run MXFP4-rounded weights (straight-through)."""
    bias_rate: float = 1e-3
    """Router score-correction bias step per optimizer step (aux-loss-free balancing)."""
    kda_chunk_size: int = 32
    """KDA chunk of the training forward."""
    log_every: int = 10
    """Log every this many steps (the first 5 steps always)."""
    eval_every_minutes: float = 2.0
    """Held-out teacher-forced evaluation every this many minutes."""
    eval_examples: int = 128
    """Held-out examples (another seed) per evaluation."""
    export_every_minutes: float = 3.0
    """Intermediate export every this many minutes."""
    reference_forms: bool = False
    """Train through the slower forms of the same computation (KDA's per-pair decays, every routed
    expert on every token), as before the fast ones: for A/B timing."""
    autocast_bf16: bool = False
    """Run the training forward under bf16 autocast (matmuls and attention in bf16; fp32 weights, optimizer
    and evaluation): opt-in, not the fp32 arithmetic of the default, and not validated for the demo's
    accuracy."""
    num_workers: int = 4
    """Batch-making worker processes (0: in the training process)."""
    quick: bool = False
    """CPU smoke run: the tiny model, small batches, short filler, two minutes."""
    mixture: str = ""
    """Example shares changed from the corpus's `MIXTURE`, as kind=share pairs (e.g. "edit=0.4"); the
    others keep theirs."""
    init_from: str | None = None
    """Model folder (release format, the same shape as --model) whose weights start the run: a fine-tune
    (its MXFP4 routed experts dequantised to float). None: random weights from --seed."""

    def model_config(self) -> ModelConfig:
        configs = {"demo": demo_config, "demo-draft": draft_config, "tiny": tiny_train_config}
        if self.model not in configs:
            raise ValueError(f"--model must be one of {', '.join(configs)}, got {self.model!r}")
        return configs[self.model]()


# ---------------------------------------------------------------------------------- batches
class BatchStream(torch.utils.data.IterableDataset):
    """Endless length-bucketed batches (numpy ids int64 [B, T], loss mask bool [B, T]) of rendered examples:
    a pool of examples is sorted by length and cut into batches of at most `tokens_per_step` padded
    tokens (T a multiple of 64), handed out in a random order. Deterministic per (seed, worker)."""

    def __init__(self, seed: int, tokens_per_step: int, max_seq_len: int, max_filler_tokens: int, pool: int = 1024,
                 mixture: dict[str, float] | None = None):
        self.seed, self.tokens, self.max_len, self.filler, self.pool = seed, tokens_per_step, max_seq_len, max_filler_tokens, pool
        self.mixture = mixture

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker = 0 if info is None else info.id
        rng = random.Random(self.seed * 1000 + worker)
        tokenizer = load_tokenizer(TOKENIZER_DIR)
        while True:
            rows = []
            while len(rows) < self.pool:
                ids, mask = corpus.render(tokenizer, corpus.sample(rng, self.filler, self.mixture))
                if len(ids) <= self.max_len:
                    rows.append((ids, mask))
            rows.sort(key=lambda r: len(r[0]))
            batches, cur = [], []
            for r in rows:
                T = -(-len(r[0]) // 64) * 64
                if cur and (len(cur) + 1) * T > self.tokens:
                    batches.append(cur)
                    cur = []
                cur.append(r)
            batches.append(cur)
            rng.shuffle(batches)
            for b in batches:
                ids, mask = collate(b)
                yield ids.numpy(), mask.numpy()  # numpy crosses the worker pipe pickled: no /dev/shm needed


def _as_is(batch):
    return batch


def collate(rows: list[tuple[list[int], list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    T = -(-max(len(r[0]) for r in rows) // 64) * 64
    ids = torch.full((len(rows), T), PAD_ID, dtype=torch.int64)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (r, m) in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(m)] = torch.tensor(m, dtype=torch.bool)
    return ids, mask


def heldout(seed: int, n: int, max_filler_tokens: int) -> list[tuple[str, list[int], list[int]]]:
    """n held-out (kind, ids, mask), from the corpus with another seed."""
    rng = random.Random(10_007 + seed)
    tokenizer = load_tokenizer(TOKENIZER_DIR)
    out = []
    while len(out) < n:
        ex = corpus.sample(rng, max_filler_tokens)
        ids, mask = corpus.render(tokenizer, ex)
        out.append((ex.kind, ids, mask))
    return out


# ---------------------------------------------------------------------------------- loss
def batch_loss(model, ids: torch.Tensor, mask: torch.Tensor, ctx: TrainContext):
    """(mean next-token cross-entropy over the target tokens, mean indexer KL, target count, correct count)."""
    inputs, targets, weight = ids[:, :-1], ids[:, 1:], mask[:, 1:]
    rows = weight.reshape(-1).nonzero().squeeze(1)
    logits = train_logits(model, inputs, ctx, rows)
    tgt = targets.reshape(-1)[rows]
    ce = torch.nn.functional.cross_entropy(logits, tgt)
    kl = torch.stack(ctx.indexer_losses).mean() if ctx.indexer_losses else ce.new_zeros(())
    correct = (logits.argmax(-1) == tgt).sum()
    return ce, kl, rows.numel(), correct


@torch.no_grad()
def evaluate(model, examples, device, ctx_args: dict, tokens_per_batch: int = 32768) -> dict:
    """Teacher-forced held-out metrics per kind: target-token accuracy and the share of examples whose
    every target token is the argmax (exactly what greedy decoding would produce). Examples run in
    length-sorted right-padded batches (padding after a sequence changes nothing before it)."""
    was_training = model.training
    model.train()  # the training forms (sparse MLA as served), no gradients here
    stats: dict[str, list[float]] = {}
    tot_loss, tot_n = 0.0, 0
    order = sorted(range(len(examples)), key=lambda i: len(examples[i][1]))
    groups, cur = [], []
    for i in order:
        T = -(-len(examples[i][1]) // 64) * 64
        if cur and (len(cur) + 1) * T > tokens_per_batch:
            groups.append(cur)
            cur = []
        cur.append(i)
    groups.append(cur)
    for group in groups:
        ids, mask = collate([examples[i][1:] for i in group])
        ids, mask = ids.to(device), mask.to(device)
        weight = mask[:, 1:]
        rows = weight.reshape(-1).nonzero().squeeze(1)
        logits = train_logits(model, ids[:, :-1], TrainContext(**ctx_args), rows)
        tgt = ids[:, 1:].reshape(-1)[rows]
        tot_loss += torch.nn.functional.cross_entropy(logits, tgt, reduction="sum").item()
        tot_n += rows.numel()
        ok = torch.zeros(weight.shape, dtype=torch.bool, device=device).reshape(-1)
        ok[rows] = logits.argmax(-1) == tgt
        ok = ok.view(weight.shape)
        right, count = (ok & weight).sum(1).tolist(), weight.sum(1).tolist()
        for j, i in enumerate(group):
            s = stats.setdefault(examples[i][0], [0, 0, 0, 0])
            s[0] += right[j]
            s[1] += count[j]
            s[2] += right[j] == count[j]
            s[3] += 1
    model.train(was_training)
    for m in moe_layers(model):
        m.routed_load = None
    return {"loss": round(tot_loss / max(tot_n, 1), 4),
            "token_acc": {k: round(v[0] / max(v[1], 1), 4) for k, v in sorted(stats.items())},
            "exact": {k: round(v[2] / v[3], 3) for k, v in sorted(stats.items())},
            "exact_all": round(sum(v[2] for v in stats.values()) / len(examples), 4)}


# ---------------------------------------------------------------------------------- export
@torch.no_grad()
def export(model, folder: str | Path, info: dict | None = None) -> Path:
    """Write the release-format model folder (config.json with MXFP4 routed experts, safetensors,
    tokenizer files, chat template) from the float training model. Written to a sibling temporary
    folder then moved into place, so a reader never sees a half-written model."""
    folder = Path(folder)
    config = model.config.replace(routed_experts_mxfp4=True)
    release = build_model(config, torch.bfloat16, seed=None, device="cpu")
    trained = {n: p.detach().to("cpu", torch.float32) for n, p in model.named_parameters()}
    for name, param in release.named_parameters():
        if name.endswith(("_packed", "_scale")):
            base, leaf = name.rsplit(".", 1)
            w = trained[f"{base}.{leaf.split('_')[0]}"]
            packed, scale = quantize_mxfp4(w)
            param.data.copy_(packed if leaf.endswith("_packed") else scale)
        else:
            param.data.copy_(trained[name])
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(release, tmp)
    for f in TOKENIZER_FILES:
        shutil.copy(TOKENIZER_DIR / f, tmp / f)
    if info is not None:
        (tmp / "training_info.json").write_text(json.dumps(info, indent=2))
    old = folder.with_name(folder.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if folder.exists():
        folder.rename(old)
    tmp.rename(folder)
    shutil.rmtree(old, ignore_errors=True)
    return folder


@torch.no_grad()
def load_float_weights(model, folder: str | Path) -> None:
    """Copy a release-format model folder's weights into the float training `model` (the inverse of
    `export`): MXFP4 routed experts dequantised, every other tensor as stored. The folder's model must have
    the training model's shape."""
    release = load_model(folder, torch.float32, device="cpu")
    stored = {n: p.detach() for n, p in release.named_parameters()}
    experts = {n: m for n, m in release.named_modules() if getattr(m, "mxfp4", False)}
    for name, param in model.named_parameters():
        base, leaf = name.rsplit(".", 1)
        if base in experts and f"{name}_packed" in stored:
            value = dequantize_mxfp4(experts[base].checkpoint_codes(leaf), stored[f"{name}_scale"])
        elif name in stored:
            value = stored[name]
        else:
            raise ValueError(f"--init-from {folder}: no weight for {name}; the folder's model is not this --model's shape")
        if value.shape != param.shape:
            raise ValueError(f"--init-from {folder}: {name} is {tuple(value.shape)} there, {tuple(param.shape)} here; "
                             "the folder's model is not this --model's shape")
        param.copy_(value.to(param.device, param.dtype))


# ---------------------------------------------------------------------------------- loop
def lr_at(args: TrainArgs, step: int, frac: float) -> float:
    warm = min(1.0, (step + 1) / args.warmup_steps)
    return args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(frac, 1.0))))


def moe_layers(model):
    return [m for m in model.modules() if hasattr(m, "routed_load")]


def balance_routers(model, rate: float) -> float:
    """Move each router's score-correction bias towards the mean load; returns the worst max/mean load
    (a device scalar: no sync)."""
    worst = torch.zeros((), device=next(model.parameters()).device)
    with torch.no_grad():
        for layer in model.model.layers:
            moe = getattr(layer, "block_sparse_moe", None)
            if moe is None or moe.experts.routed_load is None:
                continue
            load = moe.experts.routed_load.float()
            moe.experts.routed_load = None
            moe.gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))
            worst = torch.maximum(worst, load.max() / load.mean().clamp_min(1))
    return worst


def train(config: ModelConfig, args: TrainArgs, log=print) -> tuple[torch.nn.Module, list[dict]]:
    """Train the model of `config` per `args`; export to args.out at the end (and every few minutes).
    Returns (the float model, the log records)."""
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    stream = BatchStream(args.seed, args.tokens_per_step, args.max_seq_len, args.max_filler_tokens,
                         mixture=corpus.parse_mixture(args.mixture))
    loader = torch.utils.data.DataLoader(stream, batch_size=None, num_workers=args.num_workers,
                                         collate_fn=_as_is,
                                         **({"prefetch_factor": 8, "persistent_workers": True} if args.num_workers else {}))
    batches = iter(loader)  # workers fork before the model touches the device
    model = build_model(config.replace(routed_experts_mxfp4=False), torch.float32, seed=args.seed, device=device)
    if args.init_from is not None:
        load_float_weights(model, args.init_from)
    params = enable_training(model)
    for m in moe_layers(model):
        m.train_every_expert = args.reference_forms
    n_params = sum(p.numel() for p in model.parameters())
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8,
                            **({"fused": True} if device.type == "cuda" else {}))
    evalset = heldout(args.seed, args.eval_examples, args.max_filler_tokens)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    records: list[dict] = []
    log(json.dumps({"event": "start", "params": n_params, "device": str(device), "config": config.to_hf_config()["text_config"]
                    if "text_config" in config.to_hf_config() else None, "args": asdict(args)}))
    budget = args.max_minutes * 60
    start = time.time()
    last_eval = last_export = start
    step, tokens, target_tokens, micro = 0, 0, 0, 1

    def new_window() -> dict:
        return {"stats": torch.zeros(3, device=device), "worst": torch.zeros((), device=device), "n": 0, "steps": 0,
                "t": time.time(), "tokens": 0}

    window = new_window()

    def info(final: bool) -> dict:
        return {"steps": step, "tokens": tokens, "target_tokens": target_tokens, "minutes": (time.time() - start) / 60,
                "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "params": n_params, "final": final, "args": asdict(args)}

    while True:
        elapsed = time.time() - start
        frac = max(elapsed / budget, step / args.max_steps if args.max_steps else 0.0)
        if frac >= 1.0 or (args.max_steps is not None and step >= args.max_steps):
            break
        ids, mask = (torch.from_numpy(a) for a in next(batches))
        total = int(mask[:, 1:].sum())  # on the host: no device sync
        ids, mask = ids.to(device), mask.to(device)
        lr = lr_at(args, step, frac)
        for g in opt.param_groups:
            g["lr"] = lr
        fake_quant = frac >= args.fake_quant_from
        for m in moe_layers(model):
            m.fake_quant = fake_quant
        ctx_args = dict(sparse=frac >= args.sparse_from, kda_chunk_size=args.kda_chunk_size,
                        fast=not args.reference_forms)
        t0 = time.time()
        oom = False
        try:
            opt.zero_grad(set_to_none=True)
            stats = torch.zeros(3, device=device)  # summed loss, mean indexer KL, correct tokens: read when logged
            for part_ids, part_mask in zip(ids.chunk(micro), mask.chunk(micro)):
                ctx = TrainContext(**ctx_args)
                with torch.autocast(device.type, torch.bfloat16, enabled=args.autocast_bf16):
                    ce, kl, n, correct = batch_loss(model, part_ids, part_mask, ctx)
                ((ce * n / max(total, 1)) + kl / micro).backward()
                stats += torch.stack([ce.detach() * n, kl.detach() / micro, correct.float()])
        except torch.cuda.OutOfMemoryError:  # (torch.OutOfMemoryError on recent torch)
            if micro >= ids.shape[0]:
                raise
            oom = True
        if oom:  # outside the handler, so the failed step's tensors are freed: retry in twice the micro-batches
            micro *= 2
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            log(json.dumps({"event": "oom", "step": step, "batch": list(ids.shape), "micro_batches": micro}))
            continue
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        worst = balance_routers(model, args.bias_rate)
        step += 1
        tokens += ids.numel()
        target_tokens += total
        window["stats"] = window["stats"] + stats
        window["worst"] = torch.maximum(window["worst"], worst)
        window["n"] += total
        window["steps"] += 1
        window["tokens"] += ids.numel()
        if step <= 5 or step % args.log_every == 0:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            now = time.time()
            loss_sum, kl_sum, correct = window["stats"].tolist()
            rec = {"event": "step", "step": step, "minutes": round((now - start) / 60, 3), "lr": round(lr, 6),
                   "loss": round(loss_sum / max(window["n"], 1), 4),
                   "token_acc": round(correct / max(window["n"], 1), 4),
                   "indexer_kl": round(kl_sum / window["steps"], 4),
                   "batch": list(ids.shape), "step_s": round(now - t0, 3),
                   "mean_step_s": round((now - window["t"]) / window["steps"], 3),
                   "tokens_per_s": round(window["tokens"] / max(now - window["t"], 1e-9)),
                   "max_expert_load": round(window["worst"].item(), 2), "sparse": ctx_args["sparse"],
                   "fake_quant": fake_quant, "micro_batches": micro}
            if step == 5:  # is the run as fast as planned? (the budget stops it on time either way)
                rec["projected_steps"] = round(budget / max((now - start) / step, 1e-9))
            if device.type == "cuda":
                rec["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
            log(json.dumps(rec))
            records.append(rec)
            window = new_window()
        now = time.time()
        if now - last_eval >= args.eval_every_minutes * 60:
            rec = {"event": "eval", "step": step, "minutes": round((now - start) / 60, 3),
                   **evaluate(model, evalset, device, ctx_args)}
            log(json.dumps(rec))
            records.append(rec)
            last_eval = time.time()
        if now - last_export >= args.export_every_minutes * 60:
            export(model, out, info(False))
            log(json.dumps({"event": "export", "step": step, "folder": str(out)}))
            last_export = time.time()
            _write_log(out, records)
    ctx_args = dict(sparse=True, kda_chunk_size=args.kda_chunk_size, fast=not args.reference_forms)
    for m in moe_layers(model):
        m.fake_quant = True  # the exported experts are MXFP4
    rec = {"event": "final_eval", "step": step, "minutes": round((time.time() - start) / 60, 3),
           **evaluate(model, evalset, device, ctx_args)}
    log(json.dumps(rec))
    records.append(rec)
    export(model, out, info(True))
    _write_log(out, records)
    log(json.dumps({"event": "done", "steps": step, "tokens": tokens, "minutes": round((time.time() - start) / 60, 3),
                    "folder": str(out)}))
    return model, records


def _write_log(folder: Path, records: list[dict]) -> None:
    (folder / "train_log.json").write_text(json.dumps(records, indent=1))
