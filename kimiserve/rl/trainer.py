"""The trainer side of zero-mismatch RL: per-token logprobs of (prompt, completion) pairs through the
batch-invariant forward (`kimiserve.rl.forward`) with autograd, bit-identical to what an engine in
batch-invariant mode reports for the tokens it sampled (same ops, same order, same cache round trip).

    engine = LLMEngine(EngineArgs(model="tiny", batch_invariant=True))
    trainer = PolicyTrainer.from_engine(engine)          # its own copy of the weights
    lps = trainer.logprobs(prompts, completions)          # list of fp32 [len(completion)] tensors
    loss = ...; loss.backward(); optimizer.step()
    sync_weights(engine, trainer.model)                   # kimiserve.rl.weight_sync

Trainable parameters: every floating-point parameter (`trainable_parameters`); routed experts stored
MXFP4 (uint8 codes) stay frozen (train them through a LoRA adapter, `kimiserve.lora`).
"""

from __future__ import annotations

import copy

import torch

from kimiserve.model.model import KimiForCausalLM
from kimiserve.ops.batch_invariant import reference as bi
from kimiserve.rl.forward import InvariantForward


def completion_rows(prompts: list[list[int]], completions: list[list[int]]) -> list[int]:
    """Packed rows (of the concatenated prompt + completion sequences) whose logits predict each
    completion token: for a pair, positions len(prompt) - 1 .. len(prompt) + len(completion) - 2."""
    rows, start = [], 0
    for p, c in zip(prompts, completions):
        rows += range(start + len(p) - 1, start + len(p) + len(c) - 1)
        start += len(p) + len(c)
    return rows


class PolicyTrainer:
    """A model and the batch-invariant forward over it, set up to read latents and index keys as the
    engine's cache returns them (kv_cache_dtype, per-layer latent scales, index-key rotation)."""

    def __init__(self, model: KimiForCausalLM, kv_cache_dtype: str = "bf16", latent_scales: list[float] | None = None,
                 index_key_rotation: bool | None = None):
        self.model = model
        self.forward = InvariantForward(model)
        self.kv_cache_dtype, self.latent_scales, self.index_key_rotation = kv_cache_dtype, latent_scales, index_key_rotation

    @classmethod
    def from_engine(cls, engine, share_weights: bool = False) -> "PolicyTrainer":
        """A trainer matching `engine` (an LLMEngine or an LLM): a deep copy of its model (or the engine's
        own when `share_weights`) and its cache format."""
        engine = getattr(engine, "engine", engine)
        if not engine.args.batch_invariant:
            raise ValueError("the engine must run with batch_invariant=True for its logprobs to match the trainer's")
        model = engine.model if share_weights else copy.deepcopy(engine.model)
        return cls(model, engine.layout.kv_cache_dtype, list(engine.pool.latent_scales), engine.layout.index_key_rotation)

    def trainable_parameters(self) -> list[torch.nn.Parameter]:
        """Every floating-point parameter, set to require gradients."""
        params = [p for p in self.model.parameters() if p.dtype.is_floating_point]
        for p in params:
            p.requires_grad_(True)
        return params

    def logprobs(self, prompts: list[list[int]], completions: list[list[int]], lora=None) -> list[torch.Tensor]:
        """Logprob of each completion token given its prompt and the completion before it: one fp32 tensor
        [len(completion)] per pair, differentiable (unless called under no_grad / inference_mode)."""
        return self.logprobs_and_distributions(prompts, completions, lora)[0]

    def logprobs_and_distributions(self, prompts: list[list[int]], completions: list[list[int]],
                                   lora=None) -> tuple[list[torch.Tensor], torch.Tensor]:
        """`logprobs` and the whole log-softmax rows they were read from ([completion tokens, vocab], the
        pairs one after the other): what the policy would have given every token at those positions."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for i, (p, c) in enumerate(zip(prompts, completions)):
            if not p or not c:
                raise ValueError(f"pair {i}: prompt and completion must each have at least one token")
        sequences = [list(p) + list(c) for p, c in zip(prompts, completions)]
        device = self.model.lm_head_weight.device
        rows = torch.tensor(completion_rows(prompts, completions), dtype=torch.int64, device=device)
        logits = self.forward.sequences(sequences, self.kv_cache_dtype, self.latent_scales, self.index_key_rotation,
                                        lora=lora, rows=rows)
        targets = torch.tensor([t for c in completions for t in c], dtype=torch.int64, device=device)
        log_softmax = bi.log_softmax(logits, -1)
        lps = log_softmax.gather(1, targets.unsqueeze(1))[:, 0]
        return list(lps.split([len(c) for c in completions])), log_softmax
