"""What one serving step hands the model: packed tokens of several sequences plus their cache addresses."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kimiserve.cache.formats import rotates_index_keys
from kimiserve.cache.pool import PagePool
from kimiserve.ops.backend import REFERENCE_OPS, DecodeOps
from kimiserve.utils.host_copy import queue_device_copy


def _to_device_fn(device):
    """Host tensor -> device: through pinned memory on CUDA (the host does not wait for the device)."""
    return lambda t: queue_device_copy(t, device)


@dataclass
class SequenceChunk:
    """The new tokens of one sequence in this step: rows [start, end) of the packed batch."""

    start: int
    end: int
    context_start: int
    """Tokens of this sequence already in the cache (the chunk's first position)."""
    block_table: torch.Tensor
    """int64 attention page ids covering positions [0, context_start + end - start)."""
    state_pages: torch.Tensor
    """int64 [num_kda_layers] state page ids."""
    snapshot_state_pages: torch.Tensor | None = None
    """int64 [num_kda_layers]: where to keep the KDA state before the chunk's last token (or None)."""
    verify: bool = False
    """A speculative-decoding verify chunk (the pending token plus drafts): KDA layers leave its state
    pages as they are and keep their inputs in `ForwardBatch.verify_inputs`, replayed for the accepted
    tokens only (`kimiserve.engine.spec_decode.verify`)."""

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @property
    def context_end(self) -> int:
        return self.context_start + self.num_tokens


@dataclass
class ForwardBatch:
    """Per-step metadata, built once by the runner and read by every layer.

    Sequences with one new token (decode, or a one-token prefill chunk) form the `decode` group
    and run batched through the paged decode ops; longer chunks run one by one.
    """

    pool: PagePool
    positions: torch.Tensor
    """int64 [N]: the position of each packed token in its sequence."""
    write_pages: torch.Tensor
    write_offsets: torch.Tensor
    """int64 [N]: the cache slot (page, offset) each token's latent and index key go to."""
    chunks: list[SequenceChunk]
    decode_rows: torch.Tensor
    """int64 [Bd]: packed rows of the one-token sequences."""
    decode_block_tables: torch.Tensor
    """int64 [Bd, max pages]: their block tables, padded with page 0 (never read past context_lens)."""
    decode_context_lens: torch.Tensor
    """int64 [Bd]: their context lengths including the new token."""
    decode_state_pages: torch.Tensor
    """int64 [Bd, num_kda_layers]: their state pages."""
    decode_max_context: int = 0
    """>= every decode context length: the width of the decode ops' score rows and splits, known on
    the host (no sync); a captured CUDA graph fixes it to its context bucket."""
    ops: DecodeOps = REFERENCE_OPS
    """The paged decode ops (Triton kernels on CUDA, references elsewhere)."""
    write_rows: torch.Tensor | None = None
    """int64: the packed rows whose latents and index keys this rank stores (None: every row)."""
    pcp: object | None = None
    """Token-sharded prefill (`distributed.prefill_cp.PrefillShard`), or None. The batch is then this
    rank's contiguous share [pcp.start, pcp.end) of ONE prefill chunk (`chunks[0]`: its rows, with
    the whole chunk's pages); the layers exchange what crosses the shards (KDA states, MLA context)."""
    dcp: object | None = None
    """Decode context parallel (`distributed.dcp.DcpGroup` of size > 1), or None: a sequence's block
    table then lists virtual pages of dcp x block_size tokens; token p lives on DCP rank
    (p // block_size) % dcp, in slot p % block_size of the rank's page block_table[p // (dcp x block_size)]."""

    verify_rows: torch.Tensor | None = None
    """int64 [R]: the packed rows of the verify chunks (None without any). MLA attends them as decode rows,
    each over its sequence's context up to its own position, in one call of the paged decode ops."""
    verify_block_tables: torch.Tensor | None = None
    """int64 [R, max pages]: each verify row's block table, padded with page 0."""
    verify_context_lens: torch.Tensor | None = None
    """int64 [R]: each verify row's context length (its position + 1)."""
    verify_max_context: int = 0
    verify_inputs: dict[int, tuple[torch.Tensor, ...]] | None = None
    """Per KDA layer (cache index): the layer's inputs of the verify chunks, position-major and padded
    to the longest chunk (q, k, v before the short conv, f the gate projection [T, B, H * K], b beta's
    logits [T, B, H]); filled by the forward, read by `spec_decode.verify.replay_verified`."""
    verify_grid: torch.Tensor | None = None
    """int64 [B, T]: packed row of position t of verify chunk j (a shorter chunk repeats its last row)."""
    verify_active: list[torch.Tensor | None] | None = None
    """Per position t < T: the verify chunks (int64 indices) that have a token t, None for all of them."""
    verify_state_pages: torch.Tensor | None = None
    """int64 [B, num_kda_layers]: each verify chunk's state pages."""
    verify_lengths: torch.Tensor | None = None
    """int32 [B]: each verify chunk's tokens (None: every chunk has T), as `verify_active` counts them."""
    verify_slots: object | None = None
    """`spec_decode.verify_slots.KDAVerifySlots` when the KDA layers run `ops.kda_verify_steps` into per-position
    state slots (the commit copies from them), else None (position by position, then the replay)."""

    @classmethod
    def build(cls, pool: PagePool, chunks: list[SequenceChunk], device: torch.device | str,
              ops: DecodeOps = REFERENCE_OPS, dcp=None) -> "ForwardBatch":
        bs = pool.block_size
        positions = torch.cat([torch.arange(c.context_start, c.context_end) for c in chunks])
        span = bs * (dcp.size if dcp is not None else 1)  # tokens per (virtual) page of a block table
        pages = torch.cat([c.block_table[torch.arange(c.context_start, c.context_end) // span] for c in chunks])
        write_rows = None
        if dcp is not None:
            mine = (positions // bs) % dcp.size == dcp.rank
            write_rows = torch.nonzero(mine)[:, 0]
            pages = pages[write_rows]
        decode = [c for c in chunks if c.num_tokens == 1]
        width = max((len(c.block_table) for c in decode), default=0)
        tables = torch.zeros(len(decode), width, dtype=torch.int64)
        for i, c in enumerate(decode):
            tables[i, : len(c.block_table)] = c.block_table
        states = torch.stack([c.state_pages for c in decode]) if decode else torch.zeros(0, 0, dtype=torch.int64)
        verify = [c for c in chunks if c.verify and c.num_tokens > 1]
        verify_rows = verify_tables = verify_lens = grid = active = verify_states = verify_lengths = None
        if verify:
            lengths = [c.num_tokens for c in verify]
            T = max(lengths)
            grid = torch.tensor([[c.start + min(t, c.num_tokens - 1) for t in range(T)] for c in verify])
            active = [None if min(lengths) > t else torch.tensor([j for j, n in enumerate(lengths) if n > t]).to(device)
                      for t in range(T)]
            verify_states = torch.stack([c.state_pages for c in verify])
            verify_lengths = torch.tensor(lengths, dtype=torch.int64)
            verify_rows = torch.cat([torch.arange(c.start, c.end) for c in verify])
            verify_lens = torch.cat([torch.arange(c.context_start, c.context_end) + 1 for c in verify])
            verify_tables = torch.zeros(len(verify_rows), max(len(c.block_table) for c in verify), dtype=torch.int64)
            row = 0
            for c in verify:
                verify_tables[row : row + c.num_tokens, : len(c.block_table)] = c.block_table
                row += c.num_tokens
        to = _to_device_fn(device)
        # every layer reads each chunk's page ids: move them to the device once per step
        chunks = [replace(c, block_table=to(c.block_table), state_pages=to(c.state_pages),
                          snapshot_state_pages=None if c.snapshot_state_pages is None else to(c.snapshot_state_pages))
                  for c in chunks]
        return cls(
            pool=pool,
            positions=to(positions),
            write_pages=to(pages),
            write_offsets=to((positions if write_rows is None else positions[write_rows]) % bs),
            chunks=chunks,
            decode_rows=to(torch.tensor([c.start for c in decode], dtype=torch.int64)),
            decode_block_tables=to(tables),
            decode_context_lens=to(torch.tensor([c.context_end for c in decode], dtype=torch.int64)),
            decode_state_pages=to(states),
            decode_max_context=max((c.context_end for c in decode), default=0),
            ops=ops,
            write_rows=None if write_rows is None else to(write_rows),
            dcp=dcp,
            verify_rows=None if verify_rows is None else to(verify_rows),
            verify_block_tables=None if verify_tables is None else to(verify_tables),
            verify_context_lens=None if verify_lens is None else to(verify_lens),
            verify_max_context=max((c.context_end for c in verify), default=0),
            verify_inputs={} if verify else None,
            verify_grid=None if grid is None else to(grid),
            verify_active=active,
            verify_state_pages=None if verify_states is None else to(verify_states),
            verify_lengths=None if verify_lengths is None else to(verify_lengths),
        )

    @property
    def decode_only(self) -> bool:
        """Every packed row is a decode row, in order (decode_rows is 0..N-1; a captured decode graph's
        batch, which lists no chunks, too; not a verify graph's, which lists none either): the layers
        then take the rows as views, not gathers."""
        return self.pcp is None and self.verify_grid is None and all(c.num_tokens == 1 and c.start == i
                                                                     for i, c in enumerate(self.chunks))

    @property
    def prefill_chunks(self) -> list[SequenceChunk]:
        """Chunks of several tokens (prefill chunks and speculative verify chunks)."""
        return [c for c in self.chunks if c.num_tokens > 1]


@dataclass(frozen=True)
class CacheRoundTrip:
    """Tells the full-sequence forward to read latents and index keys as a cache of this dtype returns them."""

    kv_cache_dtype: str
    latent_scales: tuple[float, ...] | None = None
    index_key_rotation: bool | None = None
    """As `CacheLayout.from_config` takes it: None = on for fp4 index keys."""

    @property
    def rotates_index_keys(self) -> bool:
        return rotates_index_keys(self.kv_cache_dtype, self.index_key_rotation)

    def latent_scale(self, mla_layer: int) -> float:
        return self.latent_scales[mla_layer] if self.latent_scales else 1.0
