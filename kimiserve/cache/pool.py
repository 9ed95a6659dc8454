"""The page pool: one uint8 tensor of equal pages per device, with typed views into it."""

from __future__ import annotations

import torch

from kimiserve.cache import formats
from kimiserve.cache.layout import CacheLayout
from kimiserve.ops.cache_write.reference import write_mla_tokens
from kimiserve.ops.quant.reference import hadamard


class PagePool:
    """`num_pages` pages of `layout.page_bytes` bytes. Any page can serve as an attention page or a state page.

    Token slots are addressed by (page, offset-in-page) pairs; a page is contiguous, so moving a
    sequence is one copy per page (`copy_pages`).
    """

    def __init__(self, layout: CacheLayout, num_pages: int, device: str | torch.device = "cpu",
                 latent_scales: list[float] | None = None):
        if num_pages < 1:
            raise ValueError(f"the cache needs at least one page, got num_pages={num_pages}")
        self.layout, self.num_pages = layout, num_pages
        self.kv_cache_dtype = layout.kv_cache_dtype
        self.data = torch.empty(num_pages, layout.page_bytes, dtype=torch.uint8, device=device)
        self.latent = [r.view(self.data) for r in layout.latent]
        self.index_key = [r.view(self.data) for r in layout.index_key]
        self.index_scale = [r.view(self.data) for r in layout.index_scale]
        self.recurrent = layout.recurrent.view(self.data) if layout.recurrent else None
        self.conv = layout.conv.view(self.data) if layout.conv else None
        scales = [1.0] * layout.num_mla_layers if latent_scales is None else latent_scales
        if len(scales) != layout.num_mla_layers or min(scales, default=1.0) <= 0:
            raise ValueError(f"latent_scales needs one positive scale per MLA layer ({layout.num_mla_layers})")
        self.latent_scales = list(scales)
        """Per MLA layer: fp8's latent scale (stored value = latent / scale), fp4's NVFP4 global scale."""
        self.index_rotation = hadamard(layout.index_dim, torch.float32, device) if layout.index_key_rotation else None
        """The Hadamard matrix rotated index keys are stored with (None when they are not rotated)."""

    @property
    def block_size(self) -> int:
        return self.layout.block_size

    @property
    def nbytes(self) -> int:
        return self.data.numel()

    # attention pages ---------------------------------------------------------------------------
    def write_mla(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, latent: torch.Tensor,
                  index_key: torch.Tensor | None, write=write_mla_tokens) -> None:
        """Store tokens' latents [N, latent_dim] (and index keys [N, index_dim]) of MLA layer `layer`
        with `write` (the reference, or a kernel of the same contract); index keys are rotated first
        when the layout stores them rotated."""
        if index_key is not None and self.layout.index_key_rotation:
            index_key = formats.rotate_index_keys(index_key, self.index_rotation)  # fp32: rounded once, by the store
        write(
            self.latent[layer], self.index_key[layer] if self.index_key else None,
            self.index_scale[layer] if self.index_scale else None, pages, offsets, latent, index_key,
            self.kv_cache_dtype, self.latent_scales[layer],
        )

    def read_latents(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        codes = self.latent[layer][pages, offsets]
        return formats.load_latent(codes, self.kv_cache_dtype, self.latent_scales[layer], dtype, self.layout.latent_dim)

    def read_index_keys(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Dequantised index keys in the model's basis (rotated back when stored rotated)."""
        scales = self.index_scale[layer][pages, offsets] if self.index_scale else None
        keys = formats.load_index_key(self.index_key[layer][pages, offsets], scales, self.kv_cache_dtype,
                                      torch.float32, self.layout.index_dim)
        return (formats.rotate_index_keys(keys, self.index_rotation) if self.layout.index_key_rotation else keys).to(dtype)

    # state pages -------------------------------------------------------------------------------
    def zero_state(self, pages: torch.Tensor) -> None:
        """A fresh sequence starts from zero KDA state."""
        self.recurrent[pages] = 0
        self.conv[pages] = 0

    # whole pages -------------------------------------------------------------------------------
    def copy_pages(self, src: list[int], dst: list[int]) -> None:
        """Copy whole pages in list order (copy-on-write, snapshots, swaps)."""
        for s, d in zip(src, dst):
            self.data[d].copy_(self.data[s])
