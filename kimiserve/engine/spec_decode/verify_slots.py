"""Per-position KDA state slots of a verify step (`DecodeOps.kda_verify_steps`): the verify forward saves each
KDA layer's conv and recurrent state after every verify position of every chunk, so that committing a chunk's
accepted tokens copies the slot of its last kept position into its state pages (all layers at once: a gather
and an index copy each for the recurrent and the conv state), instead of replaying the decode op over them.

The slots are one buffer per kind for all KDA layers, [layers, T x chunks, ...], allocated once on first use
at a fixed capacity: `max_chunks` chunks of `num_tokens` positions, capped so that both buffers together stay
within `MAX_SLOT_BYTES`. A step with more chunks (or longer ones) runs the per-position path and its replay.
"""

from __future__ import annotations

import torch

MAX_SLOT_BYTES = 1 << 30
"""The most the slots of one model may take (both kinds, all layers): kimi-demo at 64 chunks of 4 positions
needs 103 MiB; a `small` (96 heads of 128 x 128) chunk of 4 positions needs 150 MiB, so `small` keeps 6 chunks."""


def max_verify_chunks(max_num_seqs: int, num_tokens: int) -> int:
    """The most chunks of `num_tokens` a verify step batches in a graph (`VerifyGraphs`' largest size)."""
    from kimiserve.model.moe import STATIC_MOE_TOKENS

    return max(1, min(max_num_seqs, STATIC_MOE_TOKENS // num_tokens))


class KDAVerifySlots:
    """Slots for up to `max_chunks` verify chunks of up to `num_tokens` positions, for the KDA layers of `pool`
    (its state page layout); `num_layers` of them."""

    def __init__(self, pool, num_layers: int, num_tokens: int, max_chunks: int, max_bytes: int = MAX_SLOT_BYTES):
        H, K, V = pool.recurrent.shape[1:]
        self.conv_shape, self.conv_dtype = tuple(pool.conv.shape[1:]), pool.conv.dtype
        self.state_shape = (H, K, V)
        self.num_layers, self.num_tokens = num_layers, num_tokens
        conv_bytes = self.conv_dtype.itemsize
        for s in self.conv_shape:
            conv_bytes *= s
        self.bytes_per_item = num_layers * (4 * H * K * V + conv_bytes)
        self.max_chunks = max(0, min(max_chunks, max_bytes // (self.bytes_per_item * num_tokens)))
        self.device = pool.data.device
        self.states: torch.Tensor | None = None
        """[layers, T x chunks, H, K, V] fp32: item t * B + j holds chunk j's state after its position t
        (B the step's chunks)"""
        self.conv: torch.Tensor | None = None
        """[layers, T x chunks, 3, H * K, W - 1] in the conv pages' dtype, likewise"""

    @property
    def nbytes(self) -> int:
        return self.bytes_per_item * self.num_tokens * self.max_chunks

    def fits(self, num_chunks: int, num_tokens: int) -> bool:
        return 0 < num_chunks <= self.max_chunks and num_tokens <= self.num_tokens

    def allocate(self) -> None:
        if self.states is None:
            items = self.num_tokens * self.max_chunks
            # zeros: a slot no position wrote (a graph capture's commit copies one to the reserved pages) is finite
            self.states = torch.zeros(self.num_layers, items, *self.state_shape, dtype=torch.float32, device=self.device)
            self.conv = torch.zeros(self.num_layers, items, *self.conv_shape, dtype=self.conv_dtype, device=self.device)

    def layer(self, i: int, num_chunks: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's (conv slots [T, B, 3, H * K, W - 1], state slots [T, B, H, K, V]) for a step of B chunks of T
        positions (contiguous views)."""
        self.allocate()
        n = num_chunks * num_tokens
        return (self.conv[i, :n].view(num_tokens, num_chunks, *self.conv_shape),
                self.states[i, :n].view(num_tokens, num_chunks, *self.state_shape))

    def commit(self, pool, items: torch.Tensor, pages: torch.Tensor) -> None:
        """Copy slot item items[r] (t * B + j: chunk j's state after its position t) of every layer i to the state
        page pages[i, r] (pages [layers, r], contiguous; distinct but for padding): 4 kernels for all layers."""
        self.allocate()
        dst = pages.reshape(-1)  # layer-major, as the gathered slots
        pool.recurrent[dst] = self.states.index_select(1, items).flatten(0, 1)
        pool.conv[dst] = self.conv.index_select(1, items).flatten(0, 1)
