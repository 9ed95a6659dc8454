"""LoRA adapters of a Kimi model: y = W x + (alpha / r) B A x on chosen projections, and on the routed
experts (one A, B pair per expert and weight w1 / w2 / w3).

On disk, PEFT's layout: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules) and
`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` [r, in] and `.lora_B.weight`
[out, r]; for routed experts `base_model.model.<...>.experts.<e>.<w1|w2|w3>.lora_A.weight`, the name of
expert e's tensor in the checkpoint (an optional `language_model.` after `base_model.model.` is accepted).

Module names are the model's own (`model.layers.3.self_attn.q_b_proj`). Projections that can carry
an adapter: every Linear / column- / row-parallel projection the batch-invariant forward runs through
`InvariantForward.proj` (attention, KDA, MLPs, shared experts, latent-MoE projections, the indexer) and
the routed experts (the default forward, `kimiserve.lora.serving`: all of them but the indexer's wq_b and
weights_proj); not `kv_b_proj` (the absorbed attention uses its weight directly), the embedding,
lm_head or the router.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field

import torch

from kimiserve.model.layers import Linear
from kimiserve.model.model import KimiForCausalLM
from kimiserve.model.parallel_layers import ColumnParallelLinear, RowParallelLinear
from kimiserve.model.moe import RoutedExperts

DEFAULT_TARGETS = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "o_proj", "g_proj", "k_proj", "v_proj",
                   "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj", "gate_proj", "up_proj", "down_proj",
                   "routed_expert_down_proj", "routed_expert_up_proj", "w1", "w2", "w3")
"""Attention (MLA) and KDA projections, the dense and shared MLPs, the latent-MoE projections and the
routed experts' w1 / w2 / w3."""
UNSUPPORTED = ("kv_b_proj", "embed_tokens", "lm_head", "gate")
EXPERT_WEIGHTS = RoutedExperts.NAMES
PROJECTIONS = (Linear, ColumnParallelLinear, RowParallelLinear)
"""The module kinds an adapter may cover (not the attention-residual queries or the conv weights)."""
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."


def lora_targets(model: KimiForCausalLM) -> tuple[dict[str, tuple[int, int]], dict[str, tuple[int, int, int]]]:
    """(projection name -> (out, in), "<experts module>.<w1|w2|w3>" -> (experts, out, in)) an adapter may cover."""
    linears, experts = {}, {}
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, RoutedExperts):
            if module.expert_parallel:
                raise ValueError("LoRA on expert-parallel experts is not supported")
            for w in EXPERT_WEIGHTS:
                packed = getattr(module, f"{w}_packed", None)
                out, inp = (packed.shape[1], packed.shape[2] * 2) if packed is not None else getattr(module, w).shape[1:]
                experts[f"{name}.{w}"] = (module.num_experts, out, inp)
        elif isinstance(module, PROJECTIONS) and leaf not in UNSUPPORTED and name.startswith("model.layers."):
            linears[name] = tuple(module.weight.shape)
    return linears, experts


@dataclass
class LoRAAdapter:
    """One adapter: `weights[module] = (A [r, in], B [out, r])`, `expert_weights["<experts>.<w>"] =
    (A [E, r, in], B [E, out, r])`, scaled by alpha / rank."""

    name: str
    rank: int
    alpha: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    expert_weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    path: str | None = None

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def tensors(self) -> list[torch.Tensor]:
        return [t for pair in (*self.weights.values(), *self.expert_weights.values()) for t in pair]

    def trainable_parameters(self) -> list[torch.Tensor]:
        """The A and B tensors, set to require gradients (the base model stays frozen)."""
        ts = self.tensors()
        for t in ts:
            t.requires_grad_(True)
        return ts

    # building ----------------------------------------------------------------------------------
    @classmethod
    def init(cls, model: KimiForCausalLM, name: str, rank: int = 8, alpha: float = 16.0,
             targets: tuple[str, ...] = DEFAULT_TARGETS, seed: int = 0, random_b: bool = False) -> "LoRAAdapter":
        """A fresh adapter on every target projection: A ~ N(0, 1/in) (PEFT's Kaiming-uniform in spirit),
        B = 0 (the adapter starts as the base model) unless `random_b` (tests: a visible adapter)."""
        check_name(name)
        if rank < 1:
            raise ValueError(f"LoRA rank must be >= 1, got {rank}")
        g = torch.Generator().manual_seed(seed)
        device = model.lm_head_weight.device
        linears, experts = lora_targets(model)

        def pair(*lead, out, inp):
            a = torch.randn(*lead, rank, inp, generator=g) * inp ** -0.5
            b = torch.randn(*lead, out, rank, generator=g) * (0.5 * rank ** -0.5) if random_b else torch.zeros(*lead, out, rank)
            return a.to(device), b.to(device)

        adapter = cls(name, rank, float(alpha))
        for mod, (out, inp) in linears.items():
            if mod.rsplit(".", 1)[-1] in targets:
                adapter.weights[mod] = pair(out=out, inp=inp)
        for key, (E, out, inp) in experts.items():
            if key.rsplit(".", 1)[-1] in targets:
                adapter.expert_weights[key] = pair(E, out=out, inp=inp)
        if not adapter.weights and not adapter.expert_weights:
            raise ValueError(f"no projection of the model matches the LoRA targets {targets}")
        return adapter

    @classmethod
    def from_pretrained(cls, path: str, model: KimiForCausalLM, name: str) -> "LoRAAdapter":
        """Load a PEFT adapter folder; ValueError naming what is wrong (missing files, shapes, modules)."""
        from safetensors.torch import load_file

        check_name(name)
        config_file, weights_file = os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)
        if not os.path.isfile(config_file) or not os.path.isfile(weights_file):
            raise ValueError(f"LoRA adapter {path!r} needs {CONFIG_FILE} and {WEIGHTS_FILE}")
        with open(config_file) as f:
            config = json.load(f)
        if config.get("peft_type", "LORA").upper() != "LORA":
            raise ValueError(f"{config_file}: peft_type {config.get('peft_type')!r} is not LORA")
        rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", config.get("r", 8)))
        if config.get("use_rslora"):
            alpha = alpha * math.sqrt(rank)  # rsLoRA scales by alpha / sqrt(r) = (alpha sqrt(r)) / r
        linears, experts = lora_targets(model)
        device = model.lm_head_weight.device
        tensors = load_file(weights_file)
        found: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in tensors.items():
            m = re.fullmatch(r"(?:base_model\.model\.)?(?:language_model\.)?(.+)\.lora_([AB])(?:\.default)?\.weight", key)
            if m is None:
                raise ValueError(f"{weights_file}: tensor {key!r} is not a lora_A / lora_B weight")
            found.setdefault(m.group(1), {})[m.group(2)] = value.float()
        adapter = cls(name, rank, alpha, path=path)
        per_expert: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        for mod, ab in found.items():
            if set(ab) != {"A", "B"}:
                raise ValueError(f"{weights_file}: {mod} needs both lora_A and lora_B")
            a, b = ab["A"], ab["B"]
            em = re.fullmatch(r"(.+)\.(\d+)\.(w[123])", mod)
            if em is not None and f"{em.group(1)}.{em.group(3)}" in experts:
                key, e = f"{em.group(1)}.{em.group(3)}", int(em.group(2))
                E, out, inp = experts[key]
                _check(mod, a, b, rank, out, inp)
                if not 0 <= e < E:
                    raise ValueError(f"{weights_file}: {mod}: the model has {E} experts")
                per_expert.setdefault(key, {})[e] = (a, b)
                continue
            if mod.rsplit(".", 1)[-1] in UNSUPPORTED:
                raise ValueError(f"{weights_file}: LoRA on {mod} is not supported (see kimiserve.lora.adapter)")
            if mod not in linears:
                raise ValueError(f"{weights_file}: the model has no projection {mod!r}")
            _check(mod, a, b, rank, *linears[mod])
            adapter.weights[mod] = (a.to(device), b.to(device))
        for key, by_expert in per_expert.items():
            E, out, inp = experts[key]
            A = torch.zeros(E, rank, inp)
            B = torch.zeros(E, out, rank)
            for e, (a, b) in by_expert.items():
                A[e], B[e] = a, b
            adapter.expert_weights[key] = (A.to(device), B.to(device))
        if not adapter.weights and not adapter.expert_weights:
            raise ValueError(f"{weights_file} holds no LoRA weights")
        return adapter

    def save_pretrained(self, path: str) -> None:
        """Write the PEFT folder (adapter_config.json + adapter_model.safetensors)."""
        from safetensors.torch import save_file

        os.makedirs(path, exist_ok=True)
        tensors = {}
        for mod, (a, b) in self.weights.items():
            tensors[f"{_PEFT_PREFIX}{mod}.lora_A.weight"] = a.detach().float().cpu().contiguous()
            tensors[f"{_PEFT_PREFIX}{mod}.lora_B.weight"] = b.detach().float().cpu().contiguous()
        for key, (A, B) in self.expert_weights.items():
            base, w = key.rsplit(".", 1)
            for e in range(A.shape[0]):
                tensors[f"{_PEFT_PREFIX}{base}.{e}.{w}.lora_A.weight"] = A[e].detach().float().cpu().contiguous()
                tensors[f"{_PEFT_PREFIX}{base}.{e}.{w}.lora_B.weight"] = B[e].detach().float().cpu().contiguous()
        save_file(tensors, os.path.join(path, WEIGHTS_FILE))
        targets = sorted({k.rsplit(".", 1)[-1] for k in (*self.weights, *self.expert_weights)})
        with open(os.path.join(path, CONFIG_FILE), "w") as f:
            json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank, "lora_alpha": self.alpha,
                       "target_modules": targets, "bias": "none", "lora_dropout": 0.0}, f, indent=1)

    def copy_from(self, other: "LoRAAdapter") -> None:
        """Take `other`'s values in place (same modules and shapes: the engine's copy after a training step)."""
        if set(other.weights) != set(self.weights) or set(other.expert_weights) != set(self.expert_weights):
            raise ValueError(f"adapter {other.name!r} covers other modules than the loaded {self.name!r}")
        with torch.no_grad():
            for mine, theirs in zip(self.tensors(), other.tensors()):
                if mine.shape != theirs.shape:
                    raise ValueError(f"adapter {other.name!r}: shape {tuple(theirs.shape)} != {tuple(mine.shape)}")
                mine.copy_(theirs)
        self.rank, self.alpha = other.rank, other.alpha

    def detached_copy(self, name: str | None = None) -> "LoRAAdapter":
        return LoRAAdapter(name or self.name, self.rank, self.alpha,
                           {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in self.weights.items()},
                           {k: (a.detach().clone(), b.detach().clone()) for k, (a, b) in self.expert_weights.items()},
                           self.path)

    # the trainer's side -----------------------------------------------------------------------
    def batch_for(self, num_rows: int, lengths: list[int] | None = None):
        """A LoRABatch with this adapter on every row (`num_rows`, or the sum of `lengths`)."""
        from kimiserve.lora.batch import LoRABatch

        rows = sum(lengths) if lengths is not None else num_rows
        return LoRABatch([self], torch.zeros(rows, dtype=torch.int64, device=self.device))

    @property
    def device(self) -> torch.device:
        return self.tensors()[0].device

    def sync_to(self, llm) -> None:
        """Push these values into the engine's loaded adapter of the same name (its prefix-cache entries
        are dropped)."""
        engine = getattr(llm, "engine", llm)
        engine.update_lora_adapter(self)


def _check(mod: str, a: torch.Tensor, b: torch.Tensor, rank: int, out: int, inp: int) -> None:
    if tuple(a.shape) != (rank, inp) or tuple(b.shape) != (out, rank):
        raise ValueError(f"LoRA weights of {mod}: lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; rank {rank} "
                         f"on this projection needs ({rank}, {inp}) and ({out}, {rank})")


def check_name(name: str) -> None:
    if not isinstance(name, str) or not name or len(name) > 256:
        raise ValueError(f"a LoRA adapter needs a non-empty name, got {name!r}")
