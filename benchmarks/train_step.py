"""Tokens per second of the demo model's training step (forward, backward, clip, AdamW), the fast training
forms against the forms before them (`--reference-forms`), at fixed shapes on random tokens.

The step is `scripts/train_demo.py`'s (`kimiserve.demo.train`: fp32 weights, TF32 matmuls and fused
AdamW on CUDA, `batch_loss` over every position); the batch is B rows of T tokens (a length bucket of
the corpus). One JSON line per configuration: the median step time of `--steps` timed steps after
`--warmup`, tokens/s, peak memory on CUDA. `--profile` adds the top ops of one step (torch.profiler),
`--traffic` the bytes its ops write per token and their count (a load-independent proxy of a
memory-bound GPU's time; the optimizer's writes included).

    PYTHONPATH=. OMP_NUM_THREADS=1 python benchmarks/train_step.py --batch 2 --seq-len 512 --forms both
    PYTHONPATH=. python benchmarks/train_step.py --device cuda --batch 96 --seq-len 1024 --forms both
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kimiserve.demo.train import TrainArgs, batch_loss, moe_layers
from kimiserve.model.model import build_model
from kimiserve.model.training import TrainContext, enable_training


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


VIEW_OPS = {"view", "_unsafe_view", "expand", "permute", "transpose", "t", "select", "slice", "unsqueeze", "squeeze",
            "as_strided", "detach", "alias", "split", "split_with_sizes", "unbind", "diagonal", "movedim", "reshape"}


def written_bytes(step) -> tuple[int, int]:
    """(bytes of the tensors the ops of `step()` write, not counting views; the op count): on a memory-bound
    device, a proxy of the step's time that does not depend on the machine's load."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        written, ops = 0, 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__.split(".")[0] not in VIEW_OPS:
                outs = out if isinstance(out, (tuple, list)) else [out]
                self.written += sum(o.numel() * o.element_size() for o in outs if isinstance(o, torch.Tensor))
                self.ops += 1
            return out

    with Count() as count:
        step()
    return count.written, count.ops


def measure(args, reference: bool) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.cuda.reset_peak_memory_stats(device)
    config = TrainArgs(model=args.model).model_config()
    model = build_model(config.replace(routed_experts_mxfp4=False), torch.float32, seed=0, device=device)
    params = enable_training(model)
    for m in moe_layers(model):
        m.train_every_expert, m.fake_quant = reference, args.fake_quant
    opt = torch.optim.AdamW(params, lr=1e-4, **({"fused": True} if device.type == "cuda" else {}))
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 1000, (args.batch, args.seq_len), generator=gen).to(device)
    mask = torch.ones(args.batch, args.seq_len, dtype=torch.bool, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        ctx = TrainContext(sparse=args.sparse, kda_chunk_size=args.kda_chunk_size, fast=not reference)
        with torch.autocast(device.type, torch.bfloat16, enabled=args.autocast_bf16):
            ce, kl, _, _ = batch_loss(model, ids, mask, ctx)
        (ce + kl).backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        for m in moe_layers(model):
            m.routed_load = None

    for _ in range(args.warmup):
        step()
    sync(device)
    times = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    rec = {"forms": "reference" if reference else "fast", "model": args.model, "device": str(device),
           "batch": [args.batch, args.seq_len], "sparse": args.sparse, "fake_quant": args.fake_quant,
           "autocast_bf16": args.autocast_bf16, "kda_chunk_size": args.kda_chunk_size,
           "step_s": round(step_s, 4), "min_step_s": round(min(times), 4),
           "tokens_per_s": round(args.batch * args.seq_len / step_s)}
    if device.type == "cuda":
        rec["gpu_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 1)
    if args.traffic:
        written, ops = written_bytes(step)
        rec["written_mb_per_token"] = round(written / (args.batch * args.seq_len) / 1e6, 2)
        rec["ops_per_step"] = ops
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            step()
            sync(device)
        key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=key, row_limit=args.profile), flush=True)
    return rec


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help="demo, demo-draft or tiny (TrainArgs.model)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=2, help="rows a step")
    p.add_argument("--seq-len", type=int, default=512, help="tokens a row")
    p.add_argument("--steps", type=int, default=3, help="timed steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--forms", default="both", choices=("fast", "reference", "both"))
    p.add_argument("--sparse", action="store_true", help="MLA over the indexer's top-k (the run's second half)")
    p.add_argument("--fake-quant", action="store_true", help="MXFP4-rounded routed experts (the run's last 20%%)")
    p.add_argument("--autocast-bf16", action="store_true", help="the forward under bf16 autocast (TrainArgs.autocast_bf16)")
    p.add_argument("--kda-chunk-size", type=int, default=TrainArgs.kda_chunk_size)
    p.add_argument("--profile", type=int, default=0, help="print this many top ops of one step")
    p.add_argument("--traffic", action="store_true", help="add the bytes the ops of one step write per token")
    args = p.parse_args()
    forms = {"fast": [False], "reference": [True], "both": [True, False]}[args.forms]
    for reference in forms:
        print(json.dumps(measure(args, reference)), flush=True)


if __name__ == "__main__":
    main()
