"""Tensor-parallel layers (DESIGN.md section 4): column- and row-parallel linears, the vocab-parallel
embedding and lm_head. Each holds only its rank's rows or columns and loads only that slice.

- `ColumnParallelLinear`: W [out, in] split by output rows; y_local = x W_r^T is this rank's block of
  the output columns (no collective).
- `RowParallelLinear`: W split by input columns; y = sum over ranks of x_r W_r^T: the forward
  all-reduces over the TP group unless told not to (`reduce=False`: the caller sums several partial
  outputs and all-reduces once).
- `VocabParallelEmbedding` / `vocab_parallel_logits`: rows of the vocabulary padded to a multiple of
  tp (padding rows zero), rank r holding rows [r * V_p / tp, (r + 1) * V_p / tp). The embedding looks up
  the ids in the rank's range (others give zero) and all-reduces; the logits are all-gathered in rank
  order and the padding columns dropped, so every rank (rank 0, the sampler's, among them) has the
  full [..., vocab] fp32 logits.

At tensor_parallel_size 1 every layer is the plain one (no padding, no collective, the same ops).
"""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.distributed.parallel_state import ParallelContext
from kimiserve.model.layers import Source, check_shape, make_param, read, sharded_loader


def context(parallel: ParallelContext | None) -> ParallelContext:
    return ParallelContext.single() if parallel is None else parallel


def divide(size: int, parts: int, what: str) -> int:
    if size % parts:
        raise ValueError(f"{what} ({size}) is not divisible by tensor_parallel_size ({parts})")
    return size // parts


class ColumnParallelLinear(nn.Module):
    """y_r = x W_r^T with W_r the rank's block of out / tp output rows (contiguous in the checkpoint)."""

    lora = None
    """The default forward's LoRA slots (`kimiserve.lora.serving.LoRALinear`; one process only), or None."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None, what: str = "output features"):
        super().__init__()
        p = context(parallel)
        local = divide(out_features, p.tp_size, what)
        self.weight = make_param(local, in_features, dtype=dtype, loader=sharded_loader(0, p.tp_rank, p.tp_size),
                                 full_shape=(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        return y if self.lora is None else self.lora(x, y)


class RowParallelLinear(nn.Module):
    """y = sum_r x_r W_r^T with W_r the rank's block of in / tp input columns; x_r is the rank's block
    of the input (what a column-parallel layer before it produced)."""

    lora = None
    """The default forward's LoRA slots (`kimiserve.lora.serving.LoRALinear`; one process only), or None."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype,
                 parallel: ParallelContext | None = None, reduce: bool = True, what: str = "input features"):
        super().__init__()
        self.parallel = context(parallel)
        local = divide(in_features, self.parallel.tp_size, what)
        self.reduce = reduce
        self.weight = make_param(out_features, local, dtype=dtype,
                                 loader=sharded_loader(1, self.parallel.tp_rank, self.parallel.tp_size),
                                 full_shape=(out_features, in_features))

    def forward(self, x: torch.Tensor, reduce: bool | None = None) -> torch.Tensor:
        """reduce: None = the layer's default; False returns this rank's partial sum."""
        y = torch.nn.functional.linear(x, self.weight.to(x.dtype))
        if self.lora is not None:
            y = self.lora(x, y)
        if self.reduce if reduce is None else reduce:
            self.parallel.tp_all_reduce(y)
        return y


def padded_vocab(vocab_size: int, tp: int) -> int:
    return -(-vocab_size // tp) * tp


def vocab_loader(vocab_size: int, rank: int, tp: int):
    """Loads the rank's rows of a [vocab, d] table; rows past the vocabulary (padding) are zero."""
    def load(param: nn.Parameter, loaded: Source, name: str) -> None:
        rows = param.shape[0]
        check_shape(loaded, (vocab_size, *param.shape[1:]), name)
        start, stop = rank * rows, min((rank + 1) * rows, vocab_size)
        if tp == 1:
            param.data.copy_(read(loaded))
            return
        param.data.zero_()
        if stop > start:
            param.data[: stop - start].copy_(read(loaded, 0, start, stop))

    load.shard = (0, rank, tp)
    return load


class VocabParallelEmbedding(nn.Module):
    """The embedding table, vocab rows split over the TP ranks (padded to a multiple of tp)."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = p = context(parallel)
        self.vocab_size = vocab_size
        self.rows = padded_vocab(vocab_size, p.tp_size) // p.tp_size
        self.start = p.tp_rank * self.rows
        self.weight = make_param(self.rows, hidden, dtype=dtype, loader=vocab_loader(vocab_size, p.tp_rank, p.tp_size),
                                 full_shape=(vocab_size, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.tp_size == 1:
            return torch.nn.functional.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        h = torch.nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        h = h.masked_fill(outside.unsqueeze(-1), 0)
        return self.parallel.tp_all_reduce(h)


class ParallelLMHead(nn.Module):
    """lm_head: the same vocab-row split as the embedding."""

    def __init__(self, vocab_size: int, hidden: int, dtype: torch.dtype, parallel: ParallelContext | None = None):
        super().__init__()
        p = context(parallel)
        rows = padded_vocab(vocab_size, p.tp_size) // p.tp_size
        self.weight = make_param(rows, hidden, dtype=dtype, loader=vocab_loader(vocab_size, p.tp_rank, p.tp_size),
                                 full_shape=(vocab_size, hidden))


def vocab_parallel_logits(h: torch.Tensor, weight: torch.Tensor, vocab_size: int,
                          parallel: ParallelContext) -> torch.Tensor:
    """fp32 logits [..., vocab] of hidden states h from the rank's vocab rows `weight` (all-gathered)."""
    local = torch.nn.functional.linear(h, weight.to(h.dtype)).float()
    if parallel.tp_size == 1:
        return local
    full = parallel.tp_all_gather(local, dim=-1)
    return full if full.shape[-1] == vocab_size else full[..., :vocab_size].contiguous()
