"""The parallel layout (`ParallelConfig`) and what one rank knows of it (`ParallelContext`).

Ranks: W = tp x pcp; rank r has tp_rank = r % tp, pcp_rank = r // tp. TP groups are the tp
consecutive ranks of one pcp_rank; DCP groups cut each TP group into tp / dcp groups of dcp
consecutive ranks; PCP groups are the ranks with the same tp_rank. The EP group is the TP group
(when `enable_expert_parallel`). A `ParallelContext` holds the rank's process groups and the
collectives the model uses; at world size 1 every collective is the identity, so the same model
code runs in one process without torch.distributed.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kimiserve.config import ModelConfig
from kimiserve.ops.quant.reference import MXFP4_GROUP  # values per ue8m0 scale: a TP split keeps whole groups


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int = 1
    """Ranks that split the heads, dense MLPs and vocabulary (and the experts with expert parallel)."""
    enable_expert_parallel: bool = False
    """Split the routed experts over the tensor-parallel ranks instead of sharding each expert."""
    decode_context_parallel_size: int = 1
    """Ranks of the tensor-parallel group that split every sequence's attention pages (divides tp)."""
    prefill_context_parallel_size: int = 1
    """Copies of the tensor-parallel group that split a long prompt into contiguous chunks."""

    @property
    def tp(self) -> int:
        return self.tensor_parallel_size

    @property
    def dcp(self) -> int:
        return self.decode_context_parallel_size

    @property
    def pcp(self) -> int:
        return self.prefill_context_parallel_size

    @property
    def world_size(self) -> int:
        return self.tp * self.pcp

    def validate(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("bool", bool):
                if not isinstance(value, bool):
                    raise ValueError(f"{f.name} must be a bool, got {value!r}")
            elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")
        if self.tp % self.dcp:
            raise ValueError(f"decode_context_parallel_size ({self.dcp}) must divide tensor_parallel_size "
                             f"({self.tp}): DCP splits the tokens over ranks of the tensor-parallel group")

    def check_model(self, config: ModelConfig) -> None:
        """ValueError naming each size of `config` that the layout cannot split evenly."""
        self.validate()
        tp, problems = self.tp, []

        def need(value: int | None, what: str, by: int = tp) -> None:
            if value and value % by:
                problems.append(f"{what} ({value}) is not divisible by tensor_parallel_size ({by})")

        if config.kda_layers:
            need(config.kda_num_heads, "KDA heads (linear_attn_config.num_heads)")
        if config.full_attn_layers:
            need(config.num_attention_heads, "MLA heads (num_attention_heads)")
        if any(not config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            need(config.intermediate_size, "the dense MLP's intermediate_size")
        if config.num_experts:
            if self.enable_expert_parallel:
                need(config.num_experts, "routed experts (num_experts, with enable_expert_parallel)")
            else:
                need(config.moe_intermediate_size, "moe_intermediate_size (tensor-parallel experts)")
                local = config.moe_intermediate_size // tp
                if config.routed_experts_mxfp4 and not config.moe_intermediate_size % tp and local % MXFP4_GROUP:
                    problems.append(
                        f"MXFP4 routed experts split over tensor_parallel_size ({tp}) would cut their "
                        f"{MXFP4_GROUP}-value scale groups: moe_intermediate_size / tp = {config.moe_intermediate_size} "
                        f"/ {tp} = {local} is not a multiple of {MXFP4_GROUP} (use enable_expert_parallel or another tp)")
            if config.num_shared_experts:
                need(config.moe_intermediate_size * config.num_shared_experts,
                     "the shared experts' intermediate size (moe_intermediate_size x num_shared_experts)")
            if config.routed_expert_hidden_size:
                need(config.routed_expert_hidden_size, "routed_expert_hidden_size (latent-MoE projections)")
        if problems:
            raise ValueError("this parallel layout does not fit the model: " + "; ".join(problems))

    def cache_config(self, config: ModelConfig) -> ModelConfig:
        """The config one rank's page pool is laid out from (`CacheLayout.from_config`): its KDA state
        pages hold kda_num_heads / tp heads; MLA latents and index keys are whole on every TP rank.
        Every rank of the layout gets the same one, hence the same block_size and page size."""
        if not config.kda_layers or self.tp == 1:
            return config
        if config.kda_num_heads % self.tp:
            raise ValueError(f"KDA heads (linear_attn_config.num_heads) ({config.kda_num_heads}) is not divisible by "
                             f"tensor_parallel_size ({self.tp})")
        return config.replace(kda_num_heads=config.kda_num_heads // self.tp)


@dataclass
class ParallelContext:
    """One rank's view of the layout: its ranks in each group and the groups (None at size 1)."""

    config: ParallelConfig
    rank: int = 0
    device: torch.device = dataclasses.field(default_factory=lambda: torch.device("cpu"))
    world_group: object | None = None
    tp_group: object | None = None
    dcp_group: object | None = None
    pcp_group: object | None = None

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        """World size 1: every collective is the identity."""
        return cls(ParallelConfig(), 0, torch.device(device))

    @classmethod
    def create(cls, config: ParallelConfig, rank: int, device: torch.device | str) -> "ParallelContext":
        """After `dist.init_process_group` on every rank: make the subgroups (every rank creates every
        group, in the same order, as torch.distributed requires)."""
        config.validate()
        if dist.get_world_size() != config.world_size:
            raise ValueError(f"the process group has {dist.get_world_size()} ranks, the layout needs "
                             f"{config.world_size} (tensor_parallel_size x prefill_context_parallel_size)")
        tp, dcp, pcp = config.tp, config.dcp, config.pcp
        mine = {}
        for p in range(pcp):
            ranks = list(range(p * tp, (p + 1) * tp))
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["tp"] = group
            for start in range(0, tp, dcp):
                sub = ranks[start:start + dcp]
                group = dist.new_group(sub)
                if rank in sub:
                    mine["dcp"] = group
        for t in range(tp):
            ranks = [p * tp + t for p in range(pcp)]
            group = dist.new_group(ranks)
            if rank in ranks:
                mine["pcp"] = group
        return cls(config, rank, torch.device(device), dist.group.WORLD, mine["tp"], mine["dcp"], mine["pcp"])

    # ranks -------------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.config.world_size

    @property
    def tp_size(self) -> int:
        return self.config.tp

    @property
    def tp_rank(self) -> int:
        return self.rank % self.config.tp

    @property
    def dcp_size(self) -> int:
        return self.config.dcp

    @property
    def dcp_rank(self) -> int:
        return self.tp_rank % self.config.dcp

    @property
    def pcp_size(self) -> int:
        return self.config.pcp

    @property
    def pcp_rank(self) -> int:
        return self.rank // self.config.tp

    @property
    def ep_size(self) -> int:
        return self.config.tp if self.config.enable_expert_parallel else 1

    @property
    def ep_rank(self) -> int:
        return self.tp_rank if self.config.enable_expert_parallel else 0

    @property
    def is_driver(self) -> bool:
        """Rank 0: where the engine, the sampler and the logits live."""
        return self.rank == 0

    # collectives over the TP group (the identity at size 1) --------------------------------------
    def tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum over the TP group, in place; returns t."""
        if self.tp_size > 1:
            dist.all_reduce(t, group=self.tp_group)
        return t

    def tp_all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate the TP ranks' tensors along `dim`, in rank order."""
        if self.tp_size == 1:
            return t
        parts = [torch.empty_like(t) for _ in range(self.tp_size)]
        dist.all_gather(parts, t.contiguous(), group=self.tp_group)
        return torch.cat(parts, dim=dim)


class LoneRankContext(ParallelContext):
    """Rank 0 of a tensor(/expert)-parallel layout run alone in one process (`EngineArgs.run_one_rank`,
    for benchmarks): the model is the rank's shard, every collective a local op of its output's shape
    (all-reduce: the rank's own partial sum; all-gather: its block repeated tp times), so a step costs
    one rank's compute and memory traffic without the communication. Its outputs are not the model's."""

    @classmethod
    def of(cls, config: ParallelConfig, device: torch.device | str) -> "LoneRankContext":
        config.validate()
        if config.dcp != 1 or config.pcp != 1:
            raise ValueError("a lone rank simulates tensor and expert parallelism only: leave decode and prefill "
                             "context parallelism at 1")
        return cls(config, 0, torch.device(device))

    def tp_all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def tp_all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        return torch.cat([t] * self.tp_size, dim=dim)
