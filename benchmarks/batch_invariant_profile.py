"""Where the batch-invariant forward spends its time: torch.profiler over one prefill step of
`--batch` prompts of `--prompt-len` tokens and one decode step of those sequences, the ops with the
most device time printed (and written as text). Run beside benchmarks/batch_invariant.py.

    PYTHONPATH=. python benchmarks/batch_invariant_profile.py --model small --device cuda --batch 4 --prompt-len 512
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from kimiserve.engine.args import EngineArgs
from kimiserve.engine.engine import LLMEngine
from kimiserve.sampling_params import SamplingParams


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rows", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    cuda = args.device.startswith("cuda")
    engine = LLMEngine(EngineArgs(model=args.model, device=args.device, batch_invariant=True,
                                  max_model_len=args.prompt_len + 16, enable_prefix_caching=False,
                                  max_num_batched_tokens=max(2048, args.batch * args.prompt_len)))
    torch.manual_seed(0)
    prompts = [torch.randint(0, 768, (args.prompt_len,)).tolist() for _ in range(args.batch)]
    params = SamplingParams(temperature=1.0, seed=1, max_tokens=4, ignore_eos=True)
    engine.add_request("warm", prompts[0], params)
    while engine.has_unfinished_requests():
        engine.step()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, params)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    text = []
    for phase in ("prefill", "decode"):
        with profile(activities=activities) as prof:
            engine.step()
            if cuda:
                torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total" if cuda else "cpu_time_total", row_limit=args.rows)
        text.append(f"== {phase} ({args.model}, batch {args.batch}, prompt {args.prompt_len})\n{table}")
        print(text[-1], flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write("\n".join(text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
