"""Shared check that a KDA layer's speculative verify path (`KimiDeltaAttention.verify_steps`, then
`spec_decode.verify.replay_verified` over the accepted prefix) gives the very bits a plain decode step
gives: the same outputs for every verify position and, after the replay, the same conv and recurrent
state as decoding the accepted tokens one step at a time, from the same projections. Run with the
reference ops (test_spec_verify_kda.py), the fused kernel in Triton's interpreter
(test_spec_verify_kda_interpret.py) and on CUDA."""

from __future__ import annotations

import torch
from torch import nn

from kimiserve.cache.layout import CacheLayout
from kimiserve.cache.pool import PagePool
from kimiserve.config import load_preset
from kimiserve.engine.spec_decode.verify import replay_verified
from kimiserve.engine.spec_decode.verify_slots import KDAVerifySlots
from kimiserve.model.batch import ForwardBatch, SequenceChunk
from kimiserve.model.kda import KimiDeltaAttention


def make_layer(dtype, device, gen, lower_bound=-5.0, heads=4, head_dim=16):
    cfg = load_preset("tiny").replace(kda_num_heads=heads, kda_head_dim=head_dim, gate_lower_bound=lower_bound)
    layer = KimiDeltaAttention(cfg, dtype, cache_index=0)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = 0.5 if "conv" in name or name == "A_log" else 1.0
            p.copy_(torch.randn(p.shape, generator=gen) * scale + (1.0 if name.startswith("o_norm") else 0.0))
    return cfg, layer.to(device)


def check_verify_matches_decode(ops, device, dtype, lengths=(4, 1, 3, 2), accepted=(3, 1, 0, 2), seed=0,
                                lower_bound=-5.0, slots=False):
    """lengths[j]: verify chunk j's tokens (pending token + drafts); accepted[j] of them kept (0: none).
    slots: through `ops.kda_verify_steps` into per-position slots (NaN-filled) and the commit's copy."""
    gen = torch.Generator().manual_seed(seed)
    cfg, layer = make_layer(dtype, device, gen, lower_bound)
    B, P, H = len(lengths), cfg.kda_num_heads * cfg.kda_head_dim, cfg.kda_num_heads
    pool = PagePool(CacheLayout.from_config(cfg, "bf16", dtype), 4 * B + 3, device)
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen).to(pool.conv.dtype))
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen) * 0.1)
    pages = torch.randperm(pool.recurrent.shape[0], generator=gen)[:B]  # state pages; block tables below
    T = max(lengths)
    x = {n: torch.randn(B, T, c, generator=gen).to(dtype=dtype, device=device)
         for n, c in (("q", P), ("k", P), ("v", P), ("f", P), ("b", H), ("gate", P))}
    committed = pool.conv.clone(), pool.recurrent.clone()

    # decode: token t of every chunk longer than t, one decode step each, in place on the pages
    want = torch.empty(B, T, H, cfg.kda_head_dim, dtype=dtype, device=device)
    states_after = {}  # (j, tokens decoded) -> (conv, recurrent) of its page
    for t in range(T):
        live = [j for j in range(B) if lengths[j] > t]
        chunks = [SequenceChunk(r, r + 1, 10 + t, torch.zeros(4, dtype=torch.int64), pages[j : j + 1])
                  for r, j in enumerate(live)]
        batch = ForwardBatch.build(pool, chunks, device, ops)
        o = layer.paged_forward(*(x[n][live, t].unsqueeze(0) for n in x), batch)
        want[live, t] = o[0]
        for j in live:
            states_after[j, t + 1] = pool.conv[pages[j]].clone(), pool.recurrent[pages[j]].clone()

    # verify: every chunk in one forward (chunks packed back to back), pages untouched, then the replay
    pool.conv.copy_(committed[0])
    pool.recurrent.copy_(committed[1])
    chunks, row, packed = [], 0, {n: [] for n in x}
    for j, n in enumerate(lengths):
        chunks.append(SequenceChunk(row, row + n, 10, torch.zeros(4, dtype=torch.int64), pages[j : j + 1],
                                    verify=n > 1))
        for name in x:
            packed[name].append(x[name][j, :n])
        row += n
    batch = ForwardBatch.build(pool, chunks, device, ops)
    if slots:
        B_verify = sum(n > 1 for n in lengths)
        batch.verify_slots = KDAVerifySlots(pool, 1, T, B_verify)
        batch.verify_slots.allocate()
        batch.verify_slots.states.fill_(float("nan"))
        batch.verify_slots.conv.fill_(float("nan"))
    o = layer.paged_forward(*(torch.cat(packed[n]).unsqueeze(0) for n in x), batch)
    assert not slots or not batch.verify_inputs, "the slot path did not run (the per-position path kept inputs)"
    row = 0
    for j, n in enumerate(lengths):
        assert torch.equal(o[0, row : row + n], want[j, :n]), f"chunk {j}: verify outputs differ from decode's"
        row += n
    verify_order = [j for j, n in enumerate(lengths) if n > 1]
    for j in verify_order:  # the verify chunks' pages stay committed (the one-token chunk is a decode row)
        assert torch.equal(pool.conv[pages[j]], committed[0][pages[j]])
        assert torch.equal(pool.recurrent[pages[j]], committed[1][pages[j]])
    replay_verified(nn.ModuleList([layer]), batch, verify_order, {j: accepted[j] for j in verify_order})
    for j in range(B):
        if lengths[j] == 1 or accepted[j] > 0:
            conv, rec = states_after[j, 1 if lengths[j] == 1 else accepted[j]]
        else:
            conv, rec = committed[0][pages[j]], committed[1][pages[j]]
        assert torch.equal(pool.conv[pages[j]], conv), f"chunk {j}: conv state after the replay differs"
        assert torch.equal(pool.recurrent[pages[j]], rec), f"chunk {j}: recurrent state after the replay differs"
    return want
