"""Dense MLP, shared experts and the (latent) mixture of experts."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from kimiserve.config import ModelConfig
from kimiserve.distributed.expert_parallel import ExpertPlacement
from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model.layers import RMSNorm, Source, check_shape, make_param, read
from kimiserve.model.training import routed_experts_train_forward
from kimiserve.model.parallel_layers import ColumnParallelLinear, RowParallelLinear, context, divide
from kimiserve.ops.activation.reference import silu_and_mul
from kimiserve.ops.backend import REFERENCE_OPS, DecodeOps
from kimiserve.ops.moe.dispatch import fused_moe_for
from kimiserve.ops.moe.mxfp4_layout import MAX_SHIFT_SCALE, from_shift_layout, to_shift_layout
from kimiserve.ops.moe.reference import experts_forward, route
from kimiserve.ops.quant.reference import MXFP4_GROUP, dequantize_mxfp4

# batches of up to this many tokens take the routing-independent expert forms (the largest captured decode batch)
STATIC_MOE_TOKENS = 256
MXFP4_LAYOUTS = ("checkpoint", "shift")
RELAYOUT_CHUNK_BYTES = 1 << 28
"""Codes re-laid per slice of experts of about this many bytes (the transient copy stays small)."""


def gated_activation(config: ModelConfig, ops: DecodeOps = REFERENCE_OPS):
    """act(gate, up) of the config (SiTU through `ops.situ_and_mul`, or SiLU)."""
    if config.hidden_act == "situ":
        beta, linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        return lambda gate, up: ops.situ_and_mul(gate, up, beta, linear_beta)
    return silu_and_mul


class MLP(nn.Module):
    """down(act(gate(x), up(x))): the dense layers and the shared experts. Under tensor parallelism
    gate and up are column-parallel and down row-parallel over the intermediate dim; `reduce=False`
    leaves down's output a partial sum (the MoE adds it to the routed part before one all-reduce)."""

    def __init__(self, config: ModelConfig, hidden: int, intermediate: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None, reduce: bool = True, what: str = "intermediate size"):
        super().__init__()
        p = context(parallel)
        self.gate_proj = ColumnParallelLinear(hidden, intermediate, dtype, p, what)
        self.up_proj = ColumnParallelLinear(hidden, intermediate, dtype, p, what)
        self.down_proj = RowParallelLinear(intermediate, hidden, dtype, p, reduce, what)
        self.config = config
        self.act = gated_activation(config)

    def forward(self, x: torch.Tensor, ops: DecodeOps = REFERENCE_OPS) -> torch.Tensor:
        act = self.act if ops is REFERENCE_OPS else gated_activation(self.config, ops)
        return self.down_proj(act(*ops.linears(x, (self.gate_proj, self.up_proj))))

    def down_onto(self, gate: torch.Tensor, up: torch.Tensor, addend: torch.Tensor, ops: DecodeOps = REFERENCE_OPS):
        """addend + the forward after the gate and up projections (`ops.linear_add`)."""
        act = self.act if ops is REFERENCE_OPS else gated_activation(self.config, ops)
        return ops.linear_add(act(gate, up), self.down_proj, addend)

    def down(self, gate: torch.Tensor, up: torch.Tensor, ops: DecodeOps = REFERENCE_OPS) -> torch.Tensor:
        """The forward after the gate and up projections."""
        act = self.act if ops is REFERENCE_OPS else gated_activation(self.config, ops)
        return self.down_proj(act(gate, up))


class Router(nn.Module):
    """Sigmoid router in fp32 with a score-correction bias used for the choice only (noaux_tc).
    Replicated: every rank routes every token (the same choice everywhere)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.weight = make_param(config.num_experts, config.hidden_size, dtype=torch.float32)
        self.e_score_correction_bias = make_param(config.num_experts, dtype=torch.float32)

    def forward(self, x: torch.Tensor, route: Callable = route) -> tuple[torch.Tensor, torch.Tensor]:
        """route: `ops.moe.reference.route` or an op of its contract (`DecodeOps.route`)."""
        c = self.config
        logits = torch.nn.functional.linear(x.float(), self.weight)
        return route(
            logits,
            self.e_score_correction_bias,
            c.num_experts_per_token,
            score_func=c.moe_router_activation_func,
            num_expert_group=c.num_expert_group,
            topk_group=c.topk_group,
            renormalize=c.moe_renormalize,
            scaling_factor=c.routed_scaling_factor,
        )


def combine_expert_outputs(partial: torch.Tensor, parallel: ParallelContext) -> torch.Tensor:
    """The routed experts' output of every token from each TP rank's part of it (TP-sharded experts:
    a partial sum over the intermediate dim; expert parallel: the contributions of the rank's own
    experts): the sum over the TP group (identity at size 1). The one place the expert-parallel
    combine goes through, so another collective (e.g. a reduce-scatter) can replace it."""
    return parallel.tp_all_reduce(partial)


def expert_loader(dim: int, rank: int, parts: int):
    """Loads one expert's checkpoint tensor into slice `expert` (the index among this rank's experts)
    of a stacked parameter; block `rank` of `parts` along the per-expert `dim` (0: output rows of
    w1/w3, 1: input columns of w2; MXFP4 packed bytes and scales alike, whole 32-value groups)."""
    def load(param: nn.Parameter, loaded: Source, name: str, expert: int) -> None:
        local = list(param.shape[1:])
        full = list(local)
        full[dim] *= parts
        check_shape(loaded, tuple(full), name)
        n = local[dim]
        param.data[expert].copy_(read(loaded) if parts == 1 else read(loaded, dim, rank * n, (rank + 1) * n))

    load.shard = (dim + 1, rank, parts)
    return load


load_expert_slice = expert_loader(0, 0, 1)
"""The one-process expert loader: expert `expert`'s whole tensor."""


class RoutedExperts(nn.Module):
    """All routed experts of a layer stacked: w1 (gate) and w3 (up) [E, I, h], w2 (down) [E, h, I].

    With MXFP4 checkpoints the weights stay packed in memory (`<w>_packed` uint8 [E, out, in/2],
    `<w>_scale` uint8 [E, out, in/32]) and an expert is dequantised when it runs. The checkpoint
    stores one tensor per expert; each stacked parameter's loader takes expert e's slice.

    Tensor parallel (no expert parallel): every rank holds every expert's I / tp block of the
    intermediate dim (w1/w3 rows, w2 columns; MXFP4 needs I / tp a multiple of 32) and returns its
    partial sum. Expert parallel: the rank holds its experts whole (`expert_ids`, from the
    `distributed.expert_parallel.ExpertPlacement`, contiguous blocks by default) and returns their
    contribution (pairs routed elsewhere point at local expert 0 with weight 0). Either way the
    caller sums over the TP group (`combine_expert_outputs`).

    On CUDA with Triton the forward is the fused kernel (`ops.moe.triton.fused_moe`: weights
    dequantised in registers, only the routed experts read); elsewhere the pure-torch forms below.
    `use_fused = False` forces the torch forms (the tests' oracle on CUDA).

    MXFP4 code layout: `<w>_packed` holds the codes as the checkpoint stores them, or (`use_layout("shift")`,
    the engine's choice, `kimiserve.model.expert_layout`) re-laid for the fused kernel's cheaper "shift"
    decode (`ops.moe.mxfp4_layout`). Everything but the fused kernel reads the codes through
    `checkpoint_codes`; whatever writes checkpoint codes into the parameters other than at build time
    calls `weights_written` after (a weight sync).
    """

    NAMES = ("w1", "w2", "w3")
    lora = None
    """The default forward's LoRA slots of these experts (`kimiserve.lora.serving.LoRAExperts`), or None."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: ParallelContext | None = None,
                 placement: ExpertPlacement | None = None):
        super().__init__()
        p = context(parallel)
        E_all, h, inter = config.num_experts, config.moe_hidden_size, config.moe_intermediate_size
        self.expert_parallel = p.ep_size > 1
        if self.expert_parallel:
            placement = placement or ExpertPlacement.contiguous(E_all, p.ep_size)  # expert e on rank e // (E / ep)
            self.expert_ids = list(placement.local_experts(p.ep_rank))
            rank, parts = 0, 1
        else:
            self.expert_ids = list(range(E_all))
            rank, parts = p.tp_rank, p.tp_size
        # self.expert_ids: global ids of the experts this rank holds, in the order of the stacked parameters
        E = len(self.expert_ids)
        local_inter = divide(inter, parts, "moe_intermediate_size (tensor-parallel experts)")
        self.num_experts, self.num_global_experts, self.dtype = E, E_all, dtype
        self.mxfp4 = config.routed_experts_mxfp4
        if self.mxfp4 and local_inter % MXFP4_GROUP:
            raise ValueError(f"MXFP4 routed experts: moe_intermediate_size / tensor_parallel_size = {inter} / {parts} = "
                             f"{local_inter} is not a multiple of the {MXFP4_GROUP}-value scale group")
        self.act = gated_activation(config)
        self.activation = config.hidden_act
        self.situ_betas = (config.activation_situ_beta, config.activation_situ_linear_beta)
        self.use_fused: bool | None = None
        """None: the fused kernel wherever `fused_moe_for` offers one; False: always the torch forms."""
        self.fake_quant = False
        """Training mode: run float weights rounded through MXFP4 (straight-through gradient)."""
        self.train_every_expert = False
        """Training mode: every expert on every token, unrouted pairs weighted 0 (the form before the
        routed pairs only: the same result, kept for A/B timing)."""
        self.routed_load: torch.Tensor | None = None
        """Training mode: tokens routed to each expert since the trainer last read it."""
        self.mxfp4_layout = "checkpoint"
        """The layout `<w>_packed` holds its codes in now (the fused kernel's `mxfp4_layout`)."""
        self.wanted_layout = "checkpoint"
        """The layout asked for (`use_layout`); "shift" falls back to "checkpoint" while `shift_blocker` says why."""
        self.eval()  # an inference module (the routed-expert kernels) until a trainer calls .train()
        for name in self.NAMES:
            out, inp = (h, local_inter) if name == "w2" else (local_inter, h)
            full_out, full_inp = (h, inter) if name == "w2" else (inter, h)
            loader = expert_loader(1 if name == "w2" else 0, rank, parts)
            if self.mxfp4:
                setattr(self, f"{name}_packed", make_param(E, out, inp // 2, dtype=torch.uint8, loader=loader,
                                                           full_shape=(E_all, full_out, full_inp // 2)))
                setattr(self, f"{name}_scale", make_param(E, out, inp // MXFP4_GROUP, dtype=torch.uint8, loader=loader,
                                                          full_shape=(E_all, full_out, full_inp // MXFP4_GROUP)))
            else:
                setattr(self, name, make_param(E, out, inp, dtype=dtype, loader=loader,
                                               full_shape=(E_all, full_out, full_inp)))
        if self.expert_parallel:
            table = torch.full((E_all,), -1, dtype=torch.int64)
            table[torch.tensor(self.expert_ids)] = torch.arange(E)
            self.register_buffer("local_index", table, persistent=False)
            """Global expert id -> index among this rank's experts (-1: another rank's)."""

    def checkpoint_codes(self, name: str, experts: torch.Tensor | int | None = None) -> torch.Tensor:
        """`<name>_packed` (or its rows `experts`) in the checkpoint layout: the parameter (or its indexed
        rows) itself when it holds that layout, else a new tensor. The one reader of the codes besides
        the fused kernel: torch forms, LoRA, the RL forward, checkpoint export, weight sync sources."""
        packed = getattr(self, f"{name}_packed")
        codes = packed if experts is None else packed[experts]
        return codes if self.mxfp4_layout == "checkpoint" else from_shift_layout(codes)

    def expert_weight(self, name: str, e: int) -> torch.Tensor:
        if self.mxfp4:
            return dequantize_mxfp4(self.checkpoint_codes(name, e), getattr(self, f"{name}_scale")[e], self.dtype)
        return getattr(self, name)[e]

    def run_expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        w1, w2, w3 = (self.expert_weight(n, e).to(x.dtype) for n in self.NAMES)
        return self.act(x @ w1.T, x @ w3.T) @ w2.T

    def stacked_weight(self, name: str, experts: torch.Tensor) -> torch.Tensor:
        """Weights of the given experts [M] stacked: [M, out, in] in the model dtype."""
        if self.mxfp4:
            return dequantize_mxfp4(self.checkpoint_codes(name, experts), getattr(self, f"{name}_scale")[experts],
                                    self.dtype)
        return getattr(self, name)[experts]

    def shift_blocker(self) -> str | None:
        """Why these experts cannot hold the shift layout now, or None (float experts: nothing to re-lay)."""
        if not self.mxfp4:
            return None
        if self.dtype != torch.bfloat16:
            return f"the shift decode runs bf16 only (model dtype {str(self.dtype).removeprefix('torch.')})"
        top = max(int(getattr(self, f"{n}_scale").max()) if getattr(self, f"{n}_scale").numel() else 0
                  for n in self.NAMES)
        if top > MAX_SHIFT_SCALE:
            return f"scale bytes up to {top} > MAX_SHIFT_SCALE = {MAX_SHIFT_SCALE} (weights of magnitude >= 16)"
        return None

    def use_layout(self, layout: str) -> str | None:
        """Hold the MXFP4 codes in `layout` ("checkpoint" or "shift") from now on, re-laid in place now and
        after each `weights_written`. Returns why the layer keeps the checkpoint layout instead, or None."""
        if layout not in MXFP4_LAYOUTS:
            raise ValueError(f"MXFP4 layout must be one of {MXFP4_LAYOUTS}, got {layout!r}")
        self.wanted_layout = layout
        return self._settle(frozenset())

    def weights_written(self, leaves) -> str | None:
        """After checkpoint-layout values were copied into the parameters `leaves` ("w1_packed", "w2_scale",
        ...; a weight sync): the codes re-laid as `use_layout` asked, or every weight back to the checkpoint
        layout when the new scales forbid the shift layout. Returns why the layer keeps the checkpoint
        layout against the wanted one, or None."""
        return self._settle(frozenset(n.removesuffix("_packed") for n in leaves if n.endswith("_packed")))

    @torch.no_grad()
    def _settle(self, fresh: frozenset) -> str | None:
        """fresh: the weights whose `_packed` holds checkpoint codes now, whatever `mxfp4_layout` says."""
        if not self.mxfp4:
            return None
        reason = self.shift_blocker() if self.wanted_layout == "shift" else None
        target = "shift" if self.wanted_layout == "shift" and reason is None else "checkpoint"
        for name in self.NAMES:
            if ("checkpoint" if name in fresh else self.mxfp4_layout) != target:
                codes = getattr(self, f"{name}_packed").data
                move = to_shift_layout if target == "shift" else from_shift_layout
                step = max(1, RELAYOUT_CHUNK_BYTES // max(1, codes[0].numel()))
                for start in range(0, codes.shape[0], step):
                    codes[start:start + step] = move(codes[start:start + step])
        self.mxfp4_layout = target
        return reason

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x [N, h], ids/weights [N, k] -> [N, h] in `out_dtype` (default x's: a partial output that is
        summed over ranks is kept in fp32, so the sum rounds once). Up to STATIC_MOE_TOKENS tokens run
        in a form whose shapes do not depend on the routing (no host sync; CUDA graphs capture it):
        each token through its own k experts when that reads fewer than all experts, else every expert
        on every token with unrouted pairs weighted 0. More tokens loop over the experts that were picked."""
        y = self._forward(x, ids, weights, out_dtype or x.dtype)
        return y if out_dtype is None else y.to(out_dtype)

    def _forward(self, x, ids, weights, out_dtype: torch.dtype) -> torch.Tensor:
        if self.training:
            return routed_experts_train_forward(self, x, ids, weights, self.train_every_expert).to(out_dtype)
        if self.lora is not None and self.lora.applies():
            return self.lora.forward(self, x, ids, weights, out_dtype)
        fused = fused_moe_for(x.device.type) if self.use_fused is not False else None
        routed = ids
        if self.expert_parallel:  # this rank's experts only: the others' pairs weigh 0
            routed = self.local_index[ids]
            weights = weights.masked_fill(routed < 0, 0)
            ids = routed.clamp_min(0)
        if fused is not None:
            out = None if out_dtype == x.dtype else torch.empty(x.shape, dtype=out_dtype, device=x.device)
            return self.fused_forward(fused, x, ids, weights, out)
        N, k = ids.shape
        if N > STATIC_MOE_TOKENS:  # -1 matches no expert
            return experts_forward(x, routed, weights, self.run_expert, self.num_experts, out_dtype)
        if N * k <= self.num_experts:
            w1, w2, w3 = (self.stacked_weight(n, ids.reshape(-1)).to(x.dtype) for n in self.NAMES)
            xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [N * k, h, 1]
            act = self.act(torch.bmm(w1, xs), torch.bmm(w3, xs))
            y = torch.bmm(w2, act)[..., 0].float().view(N, k, -1)
            return (y * weights.float().unsqueeze(-1)).sum(1).to(out_dtype)
        every = torch.arange(self.num_experts, device=x.device)
        w1, w2, w3 = (self.stacked_weight(n, every).to(x.dtype) for n in self.NAMES)
        act = self.act(torch.einsum("nh,eih->eni", x, w1), torch.einsum("nh,eih->eni", x, w3))
        y = torch.einsum("eni,ehi->enh", act, w2).float()
        dense = torch.zeros(N, self.num_experts, dtype=torch.float32, device=x.device)
        if self.expert_parallel:  # the zero-weight pairs of other ranks' experts all point at expert 0
            dense.scatter_add_(1, ids, weights.float())
        else:
            dense.scatter_(1, ids, weights.float())
        return torch.einsum("enh,ne->nh", y, dense).to(out_dtype)

    def fused_forward(self, fused, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor,
                      out: torch.Tensor | None = None) -> torch.Tensor:
        """The fused kernel's forward (`ops.moe.triton.fused_moe`): same contract as `forward`."""
        beta, linear_beta = self.situ_betas
        if self.mxfp4:
            w1, w2, w3 = self.w1_packed, self.w2_packed, self.w3_packed
            scales = dict(w1_scale=self.w1_scale, w2_scale=self.w2_scale, w3_scale=self.w3_scale,
                          mxfp4_layout=self.mxfp4_layout)
        else:
            w1, w2, w3, scales = self.w1, self.w2, self.w3, {}
        return fused(x, w1, w2, w3, ids, weights.float(), activation=self.activation, situ_beta=beta,
                     situ_linear_beta=linear_beta, out=out, **scales)


class SparseMoE(nn.Module):
    """Routed experts (in latent width with LatentMoE) plus shared experts on the unprojected input.

    Tensor parallel: the router is replicated; the latent down-projection is column-parallel and its
    output all-gathered (the experts and the latent norm need the whole latent); the routed experts'
    parts are summed over the TP group (`combine_expert_outputs`), normed, and the rank's latent
    columns go through the row-parallel up-projection; its partial output, the shared experts'
    partial output (row-parallel down) and, without latent projections, the routed experts' partial
    output are added and all-reduced once.
    """

    def __init__(self, config: ModelConfig, dtype: torch.dtype, parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = p = context(parallel)
        d = config.hidden_size
        self.gate = Router(config)
        self.experts = RoutedExperts(config, dtype, p)
        if config.num_shared_experts:
            self.shared_experts = MLP(config, d, config.moe_intermediate_size * config.num_shared_experts, dtype, p,
                                      reduce=False, what="the shared experts' intermediate size")
        if config.routed_expert_hidden_size is not None:
            what = "routed_expert_hidden_size (latent-MoE projections)"
            self.latent_slice = slice(p.tp_rank * config.routed_expert_hidden_size // p.tp_size,
                                      (p.tp_rank + 1) * config.routed_expert_hidden_size // p.tp_size)
            self.routed_expert_down_proj = ColumnParallelLinear(d, config.routed_expert_hidden_size, dtype, p, what)
            self.routed_expert_up_proj = RowParallelLinear(config.routed_expert_hidden_size, d, dtype, p, False, what)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = RMSNorm(config.routed_expert_hidden_size, config.rms_norm_eps, dtype)
        self.side_stream: torch.cuda.Stream | None = None
        """The second stream of `DecodeOps.overlap_shared_experts` (made at the first such forward on CUDA)."""

    def forward(self, x: torch.Tensor, ops: DecodeOps = REFERENCE_OPS) -> torch.Tensor:
        """ops: the router's selection, the latent norm and the shared experts' activation (`DecodeOps`)."""
        p = self.parallel
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        ids, weights = self.gate(x, ops.route)
        latent = hasattr(self, "routed_expert_down_proj")
        shared = hasattr(self, "shared_experts")
        # the projections of x through `ops.linears` (one GEMM on request)
        reads = ((self.routed_expert_down_proj,) if latent else ()) + (
            (self.shared_experts.gate_proj, self.shared_experts.up_proj) if shared else ())
        projected = ops.linears(x, reads) if reads else ()
        side = self._side_stream(x) if shared and ops.overlap_shared_experts else None
        if side is not None:  # the shared experts beside everything below, joined before their add
            side.wait_stream(torch.cuda.current_stream(x.device))
            with torch.cuda.stream(side):
                shared_out = self.shared_experts.down(*projected[-2:], ops)
        h = p.tp_all_gather(projected[0], dim=-1) if latent else x
        # a partial over the TP group stays fp32 until the sum (a bf16 partial moved bf16 EP-2 results by 2e-3)
        y = self.experts(h, ids, weights, torch.float32 if p.tp_size > 1 else None)
        if latent:
            y = combine_expert_outputs(y, p).to(x.dtype)
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y, ops.rms_norm)
            if p.tp_size > 1:
                y = y[:, self.latent_slice]
            y = self.routed_expert_up_proj(y)
        if side is not None:
            torch.cuda.current_stream(x.device).wait_stream(side)
            y = y + shared_out  # as linear_ref.linear_add adds it
        elif shared:
            y = self.shared_experts.down_onto(*projected[-2:], y, ops)
        return p.tp_all_reduce(y).to(x.dtype).view(shape)

    def _side_stream(self, x: torch.Tensor) -> torch.cuda.Stream | None:
        if x.device.type != "cuda":
            return None
        if self.side_stream is None or self.side_stream.device != x.device:
            self.side_stream = torch.cuda.Stream(device=x.device)
        return self.side_stream
