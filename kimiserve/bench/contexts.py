"""Long contexts for decode benchmarks without prefilling each of them.

A decode step's cost depends on how long its contexts are (the index scan reads every cached
index key, the sparse attention the latents of the top-k picks, each KDA layer its state page),
not on the cached values; prefilling 256 x 128K tokens to get there would take far longer than the
steps being timed. `seed_contexts` builds such contexts from ONE real prefill:

1. The source prompt runs through the engine (prefix caching on); its prompt snapshot holds the
   attention pages of its first s - 1 tokens and the KDA state pages as of token s - 1.
2. For each target prompt (L tokens), fresh pages receive copies of the source's pages: attention
   page j <- source page j while the target is no longer than the source, else source page
   j mod (s - 1) // block_size (the source's full pages, tiled); every state page <- the source's.
   When tiled, the index-key codes of the target's pages are redrawn at random (the source's code
   spread, the source's scales): repeated pages would repeat every index score, and the top-k
   select's work depends on the scores' distribution.
3. Each target gets a prefix-cache snapshot of its first L - 1 tokens on those pages, held by the
   snapshot alone; the caller adds the request and the scheduler restores it from the snapshot like
   any prefix-cache hit, computes token L - 1 (one-token prefill) and decodes from there.

What the contexts are: every target owns distinct pages (no two sequences read the same bytes), of
the cache dtype's real formats, as long as asked. A target equal to the source holds exactly the
state a prefill of it leaves (tests: the logits equal the full forward's). Any other target's
cached values are the source's, not its own prompt's: right in size and format for timing, not for
outputs. Pages are counted first (ValueError when the pool is short), and `check_seeded` tells
whether the engine really restored every request from its snapshot.
"""

from __future__ import annotations

import torch

from kimiserve.sampling_params import SamplingParams

PAGES_PER_COPY = 64
"""Pages moved by one indexed copy (bounds the temporary of the gather)."""


class PoolTooSmall(ValueError):
    """The cache pool has fewer free pages than the seeded contexts take."""


def run_source(engine, prompt: list[int], request_id: str = "seed-source") -> None:
    """Prefill `prompt` for real (one sampled token) so that its prompt snapshot is in the prefix cache."""
    engine.add_request(request_id, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def pages_to_seed(engine, prompts: list[list[int]]) -> int:
    """Pages `seed_contexts` takes for these prompts plus what their admission copies on write (the
    last partial page, every state page and the prompt snapshot's state pages, per request) and one page
    of decode growth each."""
    bs, num_state = engine.allocator.block_size, engine.allocator.num_state_pages_per_seq
    return sum(-(-(len(p) - 1) // bs) + num_state + 2 + 2 * num_state for p in prompts)


def seed_contexts(engine, source: list[int], prompts: list[list[int]], seed: int = 0) -> None:
    """Give each prompt (>= 2 tokens, distinct in their first len - 1 ids) a prefix-cache snapshot of all
    but its last token on copies of the source's cache (module docstring). The source is prefilled here.
    Needs prefix caching on and one pool (no decode context parallelism)."""
    alloc, pool = engine.allocator, engine.pool
    if not engine.args.enable_prefix_caching:
        raise ValueError("seed_contexts needs enable_prefix_caching: the requests restore their contexts from "
                         "prefix-cache snapshots")
    if engine.block_size != pool.block_size:
        raise ValueError("seed_contexts copies whole pages of one pool: run it without decode context parallelism")
    if len(source) < 2 or any(len(p) < 2 for p in prompts):
        raise ValueError("the source and every prompt need at least 2 tokens (the last one is prefilled)")
    if len({tuple(p[:-1]) for p in prompts}) != len(prompts):
        raise ValueError("the prompts must differ in their first len - 1 tokens (each gets its own snapshot)")
    bs = alloc.block_size
    s = len(source) - 1  # tokens the source's prompt snapshot covers
    full = s // bs
    if any(len(p) - 1 > s for p in prompts) and full == 0:
        raise ValueError(f"prompts longer than the source tile its full pages: give a source of more than "
                         f"{bs} tokens (block_size {bs})")
    run_source(engine, source)
    hit = alloc.lookup(source, s)
    if hit is None or hit.num_tokens != s:
        raise RuntimeError("the source's prompt snapshot is not in the prefix cache (pool too small to keep it?)")
    alloc.acquire(hit)  # keep the source's pages while the cache is emptied
    engine.reset_prefix_cache()  # a target equal to the source may now register its own snapshot
    try:
        need = pages_to_seed(engine, prompts)
        if alloc.num_free < need:
            raise PoolTooSmall(f"seeding {len(prompts)} contexts takes {need} pages, the pool has "
                               f"{alloc.num_free} free: raise the cache memory or shorten the contexts")
        gen = torch.Generator(device=pool.data.device).manual_seed(seed)
        for prompt in prompts:
            n = len(prompt) - 1
            pages = alloc.allocate(-(-n // bs))
            states = alloc.allocate(len(hit.state_pages))
            tiled = n > s
            src = [hit.block_table[j % full if tiled else j] for j in range(len(pages))]
            _copy(pool, src + list(hit.state_pages), pages + states)
            if tiled:
                _redraw_index_keys(pool, pages, src, gen)
            if not alloc.snapshot(prompt[:-1], pages, states):
                raise RuntimeError("a snapshot for this prompt already exists")
            alloc.decref(pages + states)  # the snapshot holds them now
    finally:
        alloc.decref(hit.block_table + hit.state_pages)


def check_seeded(engine, request_ids: list[str]) -> None:
    """RuntimeError unless each request restored all but its last prompt token from the prefix cache
    (call after the step that admitted them)."""
    for rid in request_ids:
        request = engine.groups[rid].samples[0]
        if request.num_cached_tokens != len(request.prompt_ids) - 1:
            raise RuntimeError(f"request {rid} restored {request.num_cached_tokens} of {len(request.prompt_ids)} "
                               f"prompt tokens from the seeded snapshot: its context was prefilled, not seeded")


def _copy(pool, src: list[int], dst: list[int]) -> None:
    for i in range(0, len(src), PAGES_PER_COPY):
        s = torch.tensor(src[i:i + PAGES_PER_COPY], device=pool.data.device)
        d = torch.tensor(dst[i:i + PAGES_PER_COPY], device=pool.data.device)
        pool.data[d] = pool.data[s]


def _redraw_index_keys(pool, pages: list[int], src: list[int], gen: torch.Generator) -> None:
    """Random index-key codes on `pages` with the spread of the source pages' codes (scales as copied)."""
    if not pool.index_key:
        return
    device = pool.data.device
    src_pages = torch.tensor(sorted(set(src)), device=device)
    for keys in pool.index_key:
        dtype = keys.dtype
        raw = keys.view(torch.uint8) if dtype.itemsize == 1 else keys  # fp8 moved as bytes (no fp8 indexing needed)
        std = raw[src_pages].view(dtype).float().std() if dtype.is_floating_point else None
        for i in range(0, len(pages), PAGES_PER_COPY):
            dst = torch.tensor(pages[i:i + PAGES_PER_COPY], device=device)
            shape = (len(dst), *keys.shape[1:])
            if std is None:  # packed e2m1 pairs: every byte is a valid pair of codes
                raw[dst] = torch.randint(0, 256, shape, generator=gen, device=device, dtype=torch.int32).to(torch.uint8)
                continue
            codes = torch.randn(shape, generator=gen, device=device) * std
            if dtype.itemsize == 1:  # e4m3: within its range (no NaN code)
                codes = codes.clamp(-448, 448)
            codes = codes.to(dtype)
            raw[dst] = codes.view(torch.uint8) if dtype.itemsize == 1 else codes
