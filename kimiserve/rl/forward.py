"""The batch-invariant forward of a `KimiForCausalLM`: the same weights and math as the model's own
forward, but every op from `kimiserve.ops.batch_invariant.reference`, every token computed as a row
of its own, so a token's logits are bit-identical whatever else runs with it.

One forward serves both sides of RL:

- the engine (`PagedContext`, `--batch-invariant`): the packed tokens of a serving step, MLA latents
  and index keys written to and read back from the page pool, KDA states from the state pages;
- the trainer (`SequenceContext`, `kimiserve.rl.trainer`): whole (prompt + completion) sequences with
  autograd, latents and index keys put through the cache format's round trip as the pool would return
  them, KDA from a zero state.

Both reduce to the same per-token computation:
- each MLA query reads its sequence's context positions 0..p as the cache returns them; the indexer
  scores them (tree sums), keeps the top-k (ties to the earlier token, the list in position order) and
  the absorbed attention runs over that list (`sparse_latent_attention`), whatever the chunk;
- KDA runs the recurrent form one token at a time in both prefill and decode (the chunked form gives
  a token other bits, tied to its chunk's composition; on CUDA one Triton pass per segment), the short
  conv as a 4-tap tree sum from the conv state for every row at once; a prompt snapshot is the state
  before the last token, as the default path keeps it;
- routed experts run per (token, slot) pair (grouped by expert) and are combined over the token's slots
  in slot order.

`lora` (a `kimiserve.lora.LoRABatch`, or None) adds each row's adapter to the projections it covers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kimiserve.cache import formats
from kimiserve.model.batch import ForwardBatch
from kimiserve.model.mla import INDEX_KEY_NORM_EPS, MLAAttention
from kimiserve.model.model import KimiForCausalLM
from kimiserve.ops.batch_invariant import glue
from kimiserve.ops.batch_invariant import reference as bi
from kimiserve.ops.batch_invariant.attention import mla_attention
from kimiserve.ops.linear.merged import stacked_weight
from kimiserve.ops.mla.reference import split_kv_b
from kimiserve.ops.quant.reference import dequantize_mxfp4, hadamard
from kimiserve.utils.host_copy import queue_device_copy

@dataclass
class Segment:
    """One sequence's rows [start, end) of the packed batch, the first at position `context_start`."""

    start: int
    end: int
    context_start: int

    @property
    def length(self) -> int:
        return self.end - self.start


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """x @ matrix (the symmetric Hadamard rotation) as a batch-invariant product, in fp32."""
    return bi.linear(x.float(), matrix.float())


class SequenceContext:
    """Whole sequences from position 0 (the trainer): latents and index keys through the cache
    format's round trip (`formats`, with the pool's latent scales), KDA from zero states."""

    def __init__(self, lengths: list[int], device, kv_cache_dtype: str = "bf16",
                 latent_scales: list[float] | None = None, index_key_rotation: bool | None = None):
        formats.check_kv_cache_dtype(kv_cache_dtype)
        starts = [0]
        for n in lengths:
            starts.append(starts[-1] + n)
        self.segments = [Segment(a, b, 0) for a, b in zip(starts, starts[1:])]
        self.positions = torch.cat([torch.arange(n) for n in lengths]).to(device)
        self.row_start = torch.cat([torch.full((n,), a, dtype=torch.int64) for a, n in zip(starts, lengths)]).to(device)
        self.kv_cache_dtype, self.latent_scales = kv_cache_dtype, latent_scales
        self.rotates = formats.rotates_index_keys(kv_cache_dtype, index_key_rotation)
        self.device = device
        self._latents: dict[int, torch.Tensor] = {}
        self._keys: dict[int, torch.Tensor | None] = {}

    context_width = None
    decode = False

    def store_mla(self, layer: int, latent_rows: torch.Tensor, keys: torch.Tensor | None) -> None:
        scale = self.latent_scales[layer] if self.latent_scales else 1.0
        fmt = self.kv_cache_dtype
        self._latents[layer] = straight_through(latent_rows, lambda t: formats.roundtrip_latent(t, fmt, scale))
        self._keys[layer] = None if keys is None else straight_through(keys, self._roundtrip_key)

    def _roundtrip_key(self, keys: torch.Tensor) -> torch.Tensor:
        fmt = self.kv_cache_dtype
        if not self.rotates:
            codes, scales = formats.store_index_key(keys, fmt)
            return formats.load_index_key(codes, scales, fmt, torch.float32, keys.shape[-1]).to(keys.dtype)
        h = hadamard(keys.shape[-1], torch.float32, keys.device)
        codes, scales = formats.store_index_key(rotate(keys, h), fmt)
        back = formats.load_index_key(codes, scales, fmt, torch.float32, keys.shape[-1])
        return rotate(back, h).to(keys.dtype)

    def read_mla_flat(self, layer: int):
        """(latents [T, L + R], index keys [T, Di] or None, base [N]): row g's context position p is
        row base[g] + p of both."""
        return self._latents[layer], self._keys[layer], self.row_start

    def kda_initial(self, layer: int, num_heads: int, head_dim: int, conv_width: int, dtype):
        B = len(self.segments)
        conv = torch.zeros(B, 3, num_heads * head_dim, conv_width - 1, device=self.device)
        state = torch.zeros(B, num_heads, head_dim, head_dim, device=self.device)
        return conv, state

    def kda_snapshot_row(self, j: int) -> int | None:
        return None

    def kda_snapshot(self, layer: int, j: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pass

    def kda_final(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pass


class _StraightThrough(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn):
        return fn(x)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _kda_rows(ctx, W1: int):
    """The KDA layers' per-step indices of a context's segments (made once per step, on the host, copied
    without a host wait): each segment's base in the conv-extended inputs, each row's first tap into
    them [N], the snapshot rows (host), and the segments' starts, lengths and snapshot rows (device)."""
    cached = ctx.__dict__.get("_kda_rows")
    if cached is not None and cached[0] == W1:
        return cached[1]
    segs, device = ctx.segments, ctx.device
    base = [0]
    for s in segs:
        base.append(base[-1] + W1 + s.length)
    tap0 = torch.empty(sum(s.length for s in segs), dtype=torch.int64)
    for j, s in enumerate(segs):
        tap0[s.start : s.end] = torch.arange(base[j], base[j] + s.length)
    snap_at = [ctx.kda_snapshot_row(j) for j in range(len(segs))]
    host = (tap0, torch.tensor([s.start for s in segs]),
            torch.tensor([s.length for s in segs]), torch.tensor([-1 if t is None else t for t in snap_at]))
    taps, starts, lengths, snap_t = (queue_device_copy(t, device) for t in host)
    rows = (base, taps, snap_at, starts, lengths, snap_t)
    ctx.__dict__["_kda_rows"] = (W1, rows)
    return rows




def straight_through(x: torch.Tensor, fn) -> torch.Tensor:
    """fn(x) in value (bit for bit); the gradient passes through unchanged (the cache round trip's estimator)."""
    return _StraightThrough.apply(x, fn)


class PagedContext:
    """A serving step (`ForwardBatch`): rows' latents and index keys written to their page slots, each
    query's context read back from the pool; KDA states read from and written to the state pages."""

    def __init__(self, batch: ForwardBatch):
        self.batch, self.pool = batch, batch.pool
        chunks = batch.chunks
        self.segments = [Segment(c.start, c.end, c.context_start) for c in chunks]
        self.positions = batch.positions
        self.device = device = batch.positions.device
        # every index the layers need, made on the host once per step and copied without a host wait
        bs = self.pool.block_size
        ends = [c.context_start + (c.end - c.start) for c in chunks]
        self.context_width = max(ends)
        width = max(len(c.block_table) for c in chunks)
        tables = torch.zeros(len(chunks), width, dtype=torch.int64)
        for j, c in enumerate(chunks):
            tables[j, : len(c.block_table)] = c.block_table
        ctx = torch.cat([torch.arange(n) for n in ends])
        seg = torch.cat([torch.full((n,), j, dtype=torch.int64) for j, n in enumerate(ends)])
        pages = torch.gather(tables[seg], 1, (ctx // bs).unsqueeze(1))[:, 0]
        offsets = torch.tensor([0] + ends[:-1], dtype=torch.int64).cumsum(0)
        row_base = torch.zeros(int(batch.positions.numel()), dtype=torch.int64)
        for j, c in enumerate(chunks):
            row_base[c.start : c.end] = offsets[j]
        self.pages, self.offsets, self.base, self.state_pages = (
            queue_device_copy(t, device) for t in (pages, ctx % bs, row_base, torch.stack([c.state_pages for c in chunks])))

    def store_mla(self, layer: int, latent_rows: torch.Tensor, keys: torch.Tensor | None) -> None:
        pool = self.pool
        if keys is not None and pool.layout.index_key_rotation:
            keys = rotate(keys, pool.index_rotation)
        self.batch.ops.write_mla_tokens(
            pool.latent[layer], pool.index_key[layer] if pool.index_key else None,
            pool.index_scale[layer] if pool.index_scale else None, self.batch.write_pages, self.batch.write_offsets,
            latent_rows, keys, pool.kv_cache_dtype, pool.latent_scales[layer])

    def read_mla_flat(self, layer: int):
        """Each chunk's context 0 .. its last position read back from the pool once, the chunks one
        after the other (see `SequenceContext.read_mla_flat`)."""
        pool, pages, offs = self.pool, self.pages, self.offsets
        latents = pool.read_latents(layer, pages, offs, torch.float32)
        keys = None
        if pool.index_key:
            scales = pool.index_scale[layer][pages, offs] if pool.index_scale else None
            keys = formats.load_index_key(pool.index_key[layer][pages, offs], scales, pool.kv_cache_dtype,
                                          torch.float32, pool.layout.index_dim)
            if pool.layout.index_key_rotation:
                keys = rotate(keys, pool.index_rotation)
        return latents, keys, self.base

    decode = False
    """One token per sequence, every index on the device (`DecodeContext`)."""

    def kda_initial(self, layer: int, num_heads: int, head_dim: int, conv_width: int, dtype):
        pages = self.state_pages[:, layer]
        return self.pool.conv[pages].float(), self.pool.recurrent[pages].float()

    def kda_snapshot_row(self, j: int) -> int | None:
        c = self.batch.chunks[j]
        return None if c.snapshot_state_pages is None or c.num_tokens < 2 else c.num_tokens - 1

    def kda_snapshot(self, layer: int, j: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        page = self.batch.chunks[j].snapshot_state_pages[layer]
        self.pool.conv[page] = conv.to(self.pool.conv.dtype)
        self.pool.recurrent[page] = state

    def kda_final(self, layer: int, conv: torch.Tensor, state: torch.Tensor) -> None:
        pages = self.state_pages[:, layer]
        self.pool.conv[pages] = conv.to(self.pool.conv.dtype)
        self.pool.recurrent[pages] = state


class DecodeContext(PagedContext):
    """A decode-only step (a `ForwardBatch` of decode rows and no chunks: the runner's decode batch, or a
    captured CUDA graph's static one): one token per sequence, every index made on the device from the
    batch's tensors, with shapes fixed by the batch size and `decode_max_context` (no host sync, so a
    CUDA graph can capture it). Each row's context 0 .. `decode_max_context` - 1 is read back from its
    block table (positions past its own length are never used: the same bits as `PagedContext`)."""

    decode = True

    def __init__(self, batch: ForwardBatch):
        self.batch, self.pool = batch, batch.pool
        self.positions = batch.positions
        self.device = batch.positions.device
        n, bs = batch.positions.shape[0], batch.pool.block_size
        self.context_width = width = batch.decode_max_context
        ctx = torch.arange(width, device=self.device)
        self.pages = torch.gather(batch.decode_block_tables, 1, (ctx // bs).expand(n, width)).reshape(-1)
        self.offsets = (ctx % bs).repeat(n)
        self.base = torch.arange(n, device=self.device) * width
        self.segments = [Segment(i, i + 1, 0) for i in range(n)]
        self.state_pages = batch.decode_state_pages

    def kda_snapshot_row(self, j: int) -> int | None:
        return None


def _decode_rows(ctx):
    """A decode step's KDA segment tensors, made once per step for every KDA layer: each row its own
    segment (starts [N] int64), one token long, no snapshot (int32, the recurrence kernel's dtype)."""
    cached = ctx.__dict__.get("_decode_rows")
    if cached is None:
        starts = torch.arange(ctx.positions.shape[0], device=ctx.device)
        cached = (starts, torch.ones(starts.shape, dtype=torch.int32, device=ctx.device),
                  torch.full(starts.shape, -1, dtype=torch.int32, device=ctx.device))
        ctx.__dict__["_decode_rows"] = cached
    return cached


def _context_lens(ctx) -> torch.Tensor:
    """Each row's context length (its position + 1) as the attention kernels take it (int32), made once per
    step for every MLA layer."""
    cached = ctx.__dict__.get("_context_lens")
    if cached is None:
        cached = (ctx.positions + 1).to(torch.int32)
        ctx.__dict__["_context_lens"] = cached
    return cached


def _stackable(modules: tuple) -> bool:
    """Whether `stacked_weight` can stack the modules' weights: plain tensors of one dtype and device with
    the same trailing dims (more than one)."""
    weights = [getattr(m, "weight", None) for m in modules]
    return (len(modules) > 1 and all(isinstance(w, torch.Tensor) and w.dim() == 2 for w in weights)
            and len({(w.dtype, w.device, w.shape[1]) for w in weights}) == 1)


def _stack_columns(parts: list[torch.Tensor]) -> torch.Tensor:
    """torch.stack(parts, 1) for [N, P] parts; a view when they are adjacent column slices of one row-major
    result (`projections`' stacked q, k, v) and no autograd runs (the same values). Adjacent addresses alone
    do not make slices of one result: separate tensors can lie back to back (the CUDA caching allocator
    does that), so the parts must be views of one storage too."""
    a = parts[0]
    N, P = a.shape
    size = a.element_size()
    storage = a.untyped_storage().data_ptr()
    adjacent = (not torch.is_grad_enabled() and a.stride(1) == 1
                and all(p.shape == a.shape and p.stride() == a.stride() and p.data_ptr() == a.data_ptr() + i * P * size
                        and p.untyped_storage().data_ptr() == storage for i, p in enumerate(parts)))
    if adjacent:
        return a.as_strided((N, len(parts), P), (a.stride(0), P, 1))
    return torch.stack(parts, 1)


def check_supported(model: KimiForCausalLM) -> None:
    """ValueError for what the batch-invariant forward does not cover."""
    p = model.parallel
    if p.tp_size > 1 or p.ep_size > 1 or p.dcp_size > 1 or p.pcp_size > 1:
        raise ValueError("batch_invariant runs one process: use tensor_parallel_size 1, no expert, decode or "
                         "prefill context parallelism")
    c = model.config
    if c.num_expert_group > 1 and c.topk_group < c.num_expert_group:
        raise ValueError("batch_invariant does not support grouped expert routing (num_expert_group > 1)")


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # an inference tensor: no version counter (never changed in place by training)
        return None


def dense_experts(experts, name: str) -> torch.Tensor:
    """The MXFP4 routed experts' `name` (w1 / w2 / w3) dequantised to their dtype, [E, O, K], kept on the
    module (the engine's and a weight-sharing trainer's forwards share it) and made again when the codes
    change (another tensor or an in-place update). The grouped matmul then runs the plain tensor-core
    path: the bits of the in-kernel dequantisation (`triton.matmul_mxfp4` == `matmul` of
    `dequantize_mxfp4`, exact e2m1 values times powers of two), without its byte gathers per tile
    (24 ms per call at 8K rows on the H200). Costs 2 bytes per weight on the device beside the codes."""
    packed, scales = getattr(experts, f"{name}_packed"), getattr(experts, f"{name}_scale")
    store = experts.__dict__.setdefault("_invariant_dense", {})
    key = (packed.data_ptr(), _version(packed), scales.data_ptr(), _version(scales), experts.mxfp4_layout)
    hit = store.get(name)
    if hit is None or hit[0] != key:
        with torch.inference_mode(False), torch.no_grad():  # a plain tensor: the trainer's autograd may save it
            store[name] = (key, dequantize_mxfp4(experts.checkpoint_codes(name), scales, experts.dtype))
    return store[name][1]


class InvariantForward:
    """The batch-invariant forward over a model's own parameters (see the module doc)."""

    def __init__(self, model: KimiForCausalLM):
        check_supported(model)
        self.model, self.config = model, model.config
        self.names = {id(m): name for name, m in model.named_modules()}
        self.lora = None

    # entry points ------------------------------------------------------------------------------
    def forward_batch(self, input_ids: torch.Tensor, batch: ForwardBatch, logits_rows: torch.Tensor,
                      lora=None) -> torch.Tensor:
        """The engine's step: packed ids [N] through the pool -> fp32 logits of `logits_rows`."""
        ctx = PagedContext(batch) if batch.chunks else DecodeContext(batch)
        h = self.hidden(input_ids, ctx, lora)
        return self.logits(h[logits_rows], lora, logits_rows)

    def sequences(self, sequences: list[list[int]], kv_cache_dtype: str = "bf16", latent_scales=None,
                  index_key_rotation: bool | None = None, lora=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Whole sequences (autograd) -> fp32 logits of the packed rows `rows` (default: every row, the
        sequences' tokens one after the other) [rows, vocab]."""
        device = self.model.lm_head_weight.device
        ids = torch.tensor([t for s in sequences for t in s], dtype=torch.int64, device=device)
        self.model.check_ids(ids)
        ctx = SequenceContext([len(s) for s in sequences], device, kv_cache_dtype, latent_scales, index_key_rotation)
        h = self.hidden(ids, ctx, lora)
        return self.logits(h if rows is None else h[rows], lora, rows)

    # the stack ---------------------------------------------------------------------------------
    def hidden(self, ids: torch.Tensor, ctx, lora=None) -> torch.Tensor:
        m = self.model.model
        self.lora = lora
        h = F.embedding(ids, m.embed_tokens.weight)
        if self.config.attn_res_block_size is None:
            for layer in m.layers:
                x = self.attention(layer.self_attn, self.norm(layer.input_layernorm, h), ctx, residual=h)
                h = self.ffn(layer, self.norm(layer.post_attention_layernorm, x), residual=x)
        else:
            blocks: list[torch.Tensor] = []
            for layer in m.layers:
                h, blocks = self.attn_res_layer(layer, h, blocks, ctx)
            return self.read_norm(h, blocks, m.output_attn_res_norm, m.output_attn_res_proj, m.norm)
        return self.norm(m.norm, h)

    def logits(self, h: torch.Tensor, lora=None, rows: torch.Tensor | None = None) -> torch.Tensor:
        return bi.linear(h, self.model.lm_head_weight).float()

    def attn_res_layer(self, layer, running, blocks, ctx):
        x = self.read_norm(running, blocks, layer.self_attention_res_norm, layer.self_attention_res_proj,
                           layer.input_layernorm)
        live = running
        if layer.layer % layer.block_size == 0:
            blocks, live = [*blocks, running], None
        live = self.attention(layer.self_attn, x, ctx, residual=live)
        x = self.read_norm(live, blocks, layer.mlp_res_norm, layer.mlp_res_proj, layer.post_attention_layernorm)
        return self.ffn(layer, x, residual=live), blocks

    def read_norm(self, running, blocks, read_norm, read_proj, norm) -> torch.Tensor:
        """The attention-residual read (eps: the config's) and the RMSNorm after it (its module's eps); one
        kernel per row on CUDA when the two eps agree, as they do in the checkpoints."""
        eps = self.config.rms_norm_eps
        if norm.eps != eps:
            x = bi.attn_res_read(running, blocks, read_norm.weight, read_proj.weight, eps) if blocks else running
            return self.norm(norm, x)
        return bi.read_norm(running, blocks, read_norm.weight, read_proj.weight, norm.weight, eps)

    # pieces ------------------------------------------------------------------------------------
    @staticmethod
    def norm(module, x: torch.Tensor) -> torch.Tensor:
        return bi.rms_norm(x, module.weight, module.eps)

    def proj(self, module, x: torch.Tensor) -> torch.Tensor:
        y = bi.linear(x, module.weight)
        if self.lora is not None:
            y = self.lora.apply(self.names[id(module)], x, y)
        return y

    def proj_onto(self, module, x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """residual + `proj(module, x)` (None: the projection alone); with `glue.RESIDUAL_EPILOGUE` the add is
        the matmul's epilogue (one rounding), a row's adapter delta added after it."""
        if residual is None:
            return self.proj(module, x)
        if not glue.RESIDUAL_EPILOGUE:
            return residual + self.proj(module, x)
        y = bi.linear(x, module.weight, addend=residual)
        if self.lora is not None:
            y = self.lora.apply(self.names[id(module)], x, y)
        return y

    def projections(self, modules: tuple, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """`proj` of each module; with `glue.FEWER_KERNELS` one invariant matmul over the modules'
        weights stacked by rows (`stacked_weight`: the parameters become row views of it, as the default
        path's `merged_linears` does), each output a column slice of the one result, then each row's
        adapter per module. The stacked weight's shape picks the tiles and split-K (`triton.tile_config`),
        so the bits differ from separate products on CUDA (not on the CPU: a tree sum per element); the
        engine and the trainer both take this form, so they agree. With autograd into the weights, the
        stack is a differentiable `torch.cat` of the same values (the same bits)."""
        if not glue.FEWER_KERNELS or not _stackable(modules):
            return tuple(self.proj(m, x) for m in modules)
        if torch.is_grad_enabled() and any(m.weight.requires_grad for m in modules):
            weight = torch.cat([m.weight for m in modules])
        else:
            weight = stacked_weight(modules)
        ys = bi.linear(x, weight).split([m.weight.shape[0] for m in modules], dim=-1)
        if self.lora is not None:
            ys = tuple(self.lora.apply(self.names[id(m)], x, y) for m, y in zip(modules, ys))
        return ys

    def act(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        c = self.config
        if c.hidden_act == "situ":
            return bi.situ_and_mul(gate, up, c.activation_situ_beta, c.activation_situ_linear_beta)
        return bi.silu_and_mul(gate, up)

    def attention(self, attn, x: torch.Tensor, ctx, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The attention sublayer's output, added onto `residual` (`proj_onto`) when given."""
        return (self.mla if isinstance(attn, MLAAttention) else self.kda)(attn, x, ctx, residual)

    def mla(self, a: MLAAttention, x: torch.Tensor, ctx, residual: torch.Tensor | None = None) -> torch.Tensor:
        N, H, L = x.shape[0], a.num_heads, a.kv_lora_rank
        indexer = getattr(a, "indexer", None)
        # the projections of x (the default path's group, then the indexer's head weights), of q's latent
        gated = hasattr(a, "g_proj")
        reads = a.input_projections() + ((a.g_proj,) if gated else ()) + ((indexer.weights_proj,) if indexer is not None else ())
        first, kv, *rest = self.projections(reads, x)
        if hasattr(a, "q_a_proj"):
            q_latent = self.norm(a.q_a_layernorm, first)
            q, iq = self.projections((a.q_b_proj, indexer.wq_b), q_latent) if indexer is not None else (self.proj(a.q_b_proj, q_latent), None)
        else:
            q_latent, q = x, first
            iq = self.proj(indexer.wq_b, q_latent) if indexer is not None else None
        q = q.view(N, H, a.nope + a.rope)
        q_nope, q_pe = q[..., : a.nope], q[..., a.nope :]
        latent_rows = torch.cat([self.norm(a.kv_a_layernorm, kv[:, :L]), kv[:, L:]], dim=-1)
        keys = iw = None
        if indexer is not None:
            keys = glue.layer_norm(rest[0], indexer.k_norm.weight, indexer.k_norm.bias, INDEX_KEY_NORM_EPS)
            iq = iq.view(N, indexer.num_heads, indexer.head_dim)
            iw = rest[-1].float() * (indexer.num_heads ** -0.5 * indexer.head_dim ** -0.5)
        gate = rest[-2 if indexer is not None else -1] if gated else None
        ctx.store_mla(a.cache_index, latent_rows, keys)
        w_kc, w_vc = split_kv_b(a.kv_b_proj.weight, H, a.nope)  # [H, dn, L], [H, dv, L]
        q_abs = bi.head_linear(q_nope, w_kc.transpose(1, 2))  # [N, H, L] fp32
        latents, ctx_keys, base = ctx.read_mla_flat(a.cache_index)
        lens = _context_lens(ctx) if glue.FOLDED_CASTS else ctx.positions + 1
        out_latent = mla_attention(q_abs, q_pe, latents, ctx_keys, base, lens, iq, iw,
                                   indexer.topk if indexer is not None else 0, a.scale, ctx.context_width)  # [N, H, L]
        # the attention output in the compute dtype, as the default path's decode ops return it (bf16: the
        # tensor cores; an fp32 operand would run the IEEE fp32 product, 4 ms per prefill layer on the H200)
        o = bi.head_linear(out_latent.to(x.dtype), w_vc)  # [N, H, dv]
        o = o.to(x.dtype).reshape(N, -1) if gate is None else glue.gate_output(o, gate, x.dtype)  # [N, H * dv]
        return self.proj_onto(a.o_proj, o, residual)

    def kda(self, a, x: torch.Tensor, ctx, residual: torch.Tensor | None = None) -> torch.Tensor:
        N, H, K = x.shape[0], a.num_heads, a.head_dim
        full_rank_gate = hasattr(a, "g_proj")
        # the default path's group of x's projections (`KimiDeltaAttention.forward`)
        q, k, v, b, gate, f_low = self.projections((a.q_proj, a.k_proj, a.v_proj, a.b_proj,
                                                    a.g_proj if full_rank_gate else a.g_a_proj, a.f_a_proj), x)
        g, beta = glue.kda_gates(self.proj(a.f_b_proj, f_low), b, a.A_log, a.dt_bias, a.lower_bound, H, K)
        o = self.kda_recurrence(a, _stack_columns([q, k, v]), g, beta, ctx)  # fp32
        if not full_rank_gate:
            gate = self.proj(a.g_b_proj, gate)
        o = glue.gated_rms_norm(o, gate.view(N, H, K), a.o_norm.weight, a.eps, x.dtype)
        return self.proj_onto(a.o_proj, o.reshape(N, H * K), residual)

    def kda_recurrence(self, a, qkv: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, ctx) -> torch.Tensor:
        """Short conv from the conv state and L2 norm for every row at once, then the delta rule token
        by token per segment (`bi.kda_recurrence`). qkv [N, 3, P] (before the conv; fp32 from the
        concatenation with the fp32 conv state), g [N, H, K], beta [N, H] -> o [N, H, V]."""
        H, K, layer = a.num_heads, a.head_dim, a.cache_index
        conv_weight = self.conv_weight(a)  # [3, P, W] fp32
        if ctx.decode and glue.kda_decode_in_place_applies(qkv, ctx.pool):
            return glue.kda_decode_in_place(qkv, g, beta, ctx.pool, ctx.state_pages[:, layer], conv_weight, H, K)
        conv, state = ctx.kda_initial(layer, H, K, conv_weight.shape[-1], qkv.dtype)
        if ctx.decode:
            return self.kda_decode(qkv, g, beta, conv, state, conv_weight, H, K, layer, ctx)
        segs = ctx.segments
        W1 = conv_weight.shape[-1] - 1
        # each segment's inputs after its conv state: ext[base[j] + W1 + t] is its token t's input
        ext = torch.cat([p for j, s in enumerate(segs) for p in (conv[j].permute(2, 0, 1), qkv[s.start : s.end])])
        base, taps, snap_at, starts, lengths, snap_t = _kda_rows(ctx, W1)
        # each row's conv from its W places of ext (no [N, W, 3, P] window), the same per-row op as decode's
        qh, kh, vh = glue.kda_conv_norm(ext, taps, conv_weight, H, K)
        o, state, snaps = bi.kda_recurrence(qh, kh, vh, g, beta, state, starts, lengths, snap_t, K ** -0.5)
        for j, t in enumerate(snap_at):
            if t is not None:
                ctx.kda_snapshot(layer, j, ext[base[j] + t : base[j] + t + W1].permute(1, 2, 0), snaps[j])
        finals = torch.stack([ext[base[j + 1] - W1 : base[j + 1]].permute(1, 2, 0) for j in range(len(segs))])
        ctx.kda_final(layer, finals, state)
        return o

    @staticmethod
    def conv_weight(a) -> torch.Tensor:
        """The q, k and v short convs' weights [3, P, W] in fp32: with `glue.FEWER_KERNELS` (and no
        autograd into them) a view of their stacked storage (`stacked_weight`: no copy per step)."""
        convs = (a.q_conv1d, a.k_conv1d, a.v_conv1d)
        weights = [c.weight for c in convs]
        if (glue.FEWER_KERNELS and not (torch.is_grad_enabled() and any(w.requires_grad for w in weights))
                and _stackable(convs)):
            return stacked_weight(convs).view(3, *weights[0].shape).float()
        return torch.stack(weights).float()

    def kda_decode(self, qkv, g, beta, conv, state, conv_weight, H: int, K: int, layer: int, ctx) -> torch.Tensor:
        """`kda_recurrence` of one token per sequence, with no host work: the window is the conv state
        then the token (the values `kda_recurrence` gathers for a one-token segment), the new conv
        state its last W - 1 inputs."""
        window = torch.cat([conv.permute(0, 3, 1, 2), qkv.unsqueeze(1)], 1)  # [N, W, 3, P]
        qh, kh, vh = glue.kda_conv_norm(window, window.shape[1], conv_weight, H, K)  # row n's taps: window[n]
        starts, lengths, no_snapshot = _decode_rows(ctx)
        o, state, _ = bi.kda_recurrence(qh, kh, vh, g, beta, state, starts, lengths, no_snapshot, K ** -0.5,
                                        decode=glue.FEWER_KERNELS)
        ctx.kda_final(layer, window[:, 1:].permute(0, 2, 3, 1), state)
        return o

    def ffn(self, layer, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The FFN sublayer's output, added onto `residual` when given."""
        if hasattr(layer, "block_sparse_moe"):
            return self.moe(layer.block_sparse_moe, x, residual)
        return self.mlp(layer.mlp, x, residual=residual)

    def mlp(self, m, x: torch.Tensor, projected: tuple | None = None, residual: torch.Tensor | None = None) -> torch.Tensor:
        """projected: (gate, up) of x when computed already (the MoE's group); residual: added (`proj_onto`)."""
        gate, up = projected if projected is not None else self.projections((m.gate_proj, m.up_proj), x)
        return self.proj_onto(m.down_proj, self.act(gate, up), residual)

    def moe(self, m, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        c = self.config
        # the router's product in fp32 (with FOLDED_CASTS x cast inside the kernel: the same bits)
        logits = bi.linear(x, m.gate.weight, out_dtype=torch.float32) if glue.FOLDED_CASTS and m.gate.weight.dtype == torch.float32 \
            else bi.linear(x.float(), m.gate.weight)
        ids, weights = glue.route(logits, m.gate.e_score_correction_bias,
                                c.num_experts_per_token, score_func=c.moe_router_activation_func,
                                renormalize=c.moe_renormalize, scaling_factor=c.routed_scaling_factor)
        latent, shared = hasattr(m, "routed_expert_down_proj"), hasattr(m, "shared_experts")
        # the default path's group of x's projections (`MoE.forward`)
        reads = ((m.routed_expert_down_proj,) if latent else ()) + (
            (m.shared_experts.gate_proj, m.shared_experts.up_proj) if shared else ())
        projected = self.projections(reads, x)
        h = projected[0] if latent else x
        y = self.experts(m.experts, h, ids, weights)
        # with the epilogue: residual + routed (up projection's epilogue) + shared (down projection's)
        fused = glue.RESIDUAL_EPILOGUE and residual is not None
        if latent:
            if hasattr(m, "routed_expert_norm"):
                y = self.norm(m.routed_expert_norm, y)
            y = self.proj_onto(m.routed_expert_up_proj, y, residual if fused else None)
        elif fused:
            y = residual + y.to(x.dtype)
        if shared:
            y = self.mlp(m.shared_experts, x, projected[-2:], residual=y) if fused else y + self.mlp(m.shared_experts, x, projected[-2:])
        y = y.to(x.dtype)
        return y if fused or residual is None else residual + y

    def experts(self, experts, h: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each (token, slot) pair through its expert, combined over the slots in slot order. On the GPU
        the pairs run grouped by expert (one launch of the fixed-tiling matmul for all experts, MXFP4
        dequantised inside it); on the CPU (launch-bound) as one per-row-weight product of the gathered experts: the same
        bits as grouping there (the tree sum does not care whether a weight is shared)."""
        N, k = ids.shape
        flat = ids.reshape(-1)
        xs = h.unsqueeze(1).expand(N, k, h.shape[-1]).reshape(N * k, h.shape[-1])
        if bi.on_triton(h):
            by_expert = bi.group_rows(xs, flat, experts.num_experts)  # on the device: no host sync

            def linear(name, x, out_features):
                w = dense_experts(experts, name) if experts.mxfp4 else getattr(experts, name)
                return bi.expert_linear(x, by_expert, w, every_row=glue.FEWER_KERNELS)  # every pair has an expert
        else:
            present, index = torch.unique(flat, return_inverse=True)

            def linear(name, x, out_features):
                return bi.linear(x, experts.stacked_weight(name, present).to(x.dtype)[index])

        inter = self.config.moe_intermediate_size
        gate, up = linear("w1", xs, inter), linear("w3", xs, inter)
        lora = self.lora
        if lora is not None:
            base, slots = self.names[id(experts)], lora.row_slot.unsqueeze(1).expand(N, k).reshape(-1)
            gate = lora.apply_experts(f"{base}.w1", xs, flat, slots, gate)
            up = lora.apply_experts(f"{base}.w3", xs, flat, slots, up)
        act = self.act(gate, up)
        y = linear("w2", act, h.shape[-1])
        if lora is not None:
            y = lora.apply_experts(f"{base}.w2", act, flat, slots, y)
        return glue.combine_slots(y, weights, h.dtype)
