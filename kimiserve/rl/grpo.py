"""A minimal GRPO loop with zero rollout/trainer mismatch (scripts/rl_example.py runs it).

Each step: the engine (batch-invariant mode) samples `group_size` completions per prompt and reports
each sampled token's logprob; the trainer recomputes those logprobs with autograd (`PolicyTrainer`);
KL(rollout || trainer) is estimated from them (k3 = E[exp(d) - 1 - d], d = trainer - rollout logprob:
zero exactly when every logprob agrees bit for bit); group-normalised advantages of a toy reward (how
often the completion produces a target token) weight the clipped PPO ratio exp(trainer - rollout);
one optimizer step; the new weights go into the engine (`sync_weights`, prefix cache emptied).

`adapter` (a `kimiserve.lora` adapter name) trains that LoRA adapter with the base frozen: the engine
serves it by name, and the new adapter weights are pushed after every step instead of the model's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kimiserve.rl.trainer import PolicyTrainer
from kimiserve.rl.weight_sync import sync_weights
from kimiserve.sampling_params import SamplingParams


@dataclass
class GRPOConfig:
    steps: int = 100
    num_prompts: int = 4
    prompt_len: int = 8
    group_size: int = 8
    max_tokens: int = 8
    lr: float = 3e-3
    clip: float = 0.2
    seed: int = 0
    target_tokens: int = 64
    """The reward counts the completion tokens with ids below this (1/16 of the tiny vocabulary's
    non-special ids: often enough at the start for the group advantages to carry a signal)."""


def reward_of(tokens: list[int], target_tokens: int) -> float:
    """The fraction of `tokens` that are target tokens (ids < target_tokens)."""
    return sum(t < target_tokens for t in tokens) / len(tokens)


def k3_kl(rollout: torch.Tensor, trainer: torch.Tensor) -> float:
    d = (trainer - rollout).double()
    return float((torch.exp(d) - 1 - d).mean())


def rollouts(llm, prompts, cfg: GRPOConfig, step: int, lora_request=None):
    params = [SamplingParams(n=cfg.group_size, temperature=1.0, seed=cfg.seed * 100_003 + step * 1009 + i,
                             max_tokens=cfg.max_tokens, logprobs=0, ignore_eos=True) for i in range(len(prompts))]
    kwargs = {} if lora_request is None else {"lora_request": lora_request}
    outs = llm.generate(prompts, params, use_tqdm=False, **kwargs)
    pairs = []
    for prompt, out in zip(prompts, outs):
        for o in out.outputs:
            pairs.append((prompt, list(o.token_ids), torch.tensor([lp.logprob for lp in o.logprobs], dtype=torch.float32)))
    return pairs


def run_grpo(llm, cfg: GRPOConfig, adapter=None, log=print) -> list[dict]:
    """`cfg.steps` GRPO steps on `llm` (an LLM in batch-invariant mode); returns [{"step", "kl", "reward",
    "expected_reward", "max_abs_logprob_diff"}, ...]: `reward` the sampled completions' mean, `expected_reward`
    the policy's probability of a target token at the same positions (the reward's expectation over each
    position's draw, before the step's update; far less noisy than the sampled reward). `adapter`: a `kimiserve.lora.LoRAAdapter` to train instead of the model
    (it must be loaded in the engine under adapter.name)."""
    g = torch.Generator().manual_seed(cfg.seed)
    vocab = llm.engine.config.vocab_size
    prompts = [torch.randint(0, vocab, (cfg.prompt_len,), generator=g).tolist() for _ in range(cfg.num_prompts)]
    trainer = PolicyTrainer.from_engine(llm)
    if adapter is None:
        params = trainer.trainable_parameters()
        lora, request = None, None
    else:
        params = adapter.trainable_parameters()
        lora, request = adapter, adapter.name
    opt = torch.optim.Adam(params, lr=cfg.lr)
    history = []
    for step in range(cfg.steps):
        t0 = time.perf_counter()
        pairs = rollouts(llm, prompts, cfg, step, request)
        rewards = torch.tensor([reward_of(c, cfg.target_tokens) for _, c, _ in pairs])
        groups = rewards.view(cfg.num_prompts, cfg.group_size)
        adv = ((groups - groups.mean(1, keepdim=True)) / (groups.std(1, keepdim=True) + 1e-4)).view(-1)
        lps, dists = trainer.logprobs_and_distributions(
            [p for p, _, _ in pairs], [c for _, c, _ in pairs],
            lora=None if lora is None else lora.batch_for(len(pairs), [len(p) + len(c) for p, c, _ in pairs]))
        expected = float(dists.detach()[:, : cfg.target_tokens].exp().sum(-1).mean())
        rollout_lps = [r for _, _, r in pairs]
        trainer_flat, rollout_flat = torch.cat([lp.detach() for lp in lps]), torch.cat(rollout_lps)
        kl = k3_kl(rollout_flat, trainer_flat)
        loss = 0.0
        for a, lp, old in zip(adv, lps, rollout_lps):
            ratio = torch.exp(lp - old)
            clipped = torch.clamp(ratio, 1 - cfg.clip, 1 + cfg.clip)
            loss = loss - torch.minimum(ratio * a, clipped * a).mean()
        loss = loss / len(pairs)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if adapter is None:
            sync_weights(llm, trainer.model)
        else:
            adapter.sync_to(llm)
        entry = {"step": step, "kl": kl, "reward": float(rewards.mean()), "expected_reward": expected,
                 "max_abs_logprob_diff": float((trainer_flat - rollout_flat).abs().max())}
        history.append(entry)
        log(f"step {step:3d}  reward {entry['reward']:.3f}  expected {expected:.3f}  kl {kl:.3g}  max|dlogp| {entry['max_abs_logprob_diff']:.3g}  "
            f"{time.perf_counter() - t0:.2f}s")
    return history
