"""Launch configs of the fused MoE (`ops.moe.triton`, `ops.moe.gluon_decode`): the tilings of its two grouped GEMMs
and the default for a batch. Plain Python (no Triton needed to read or build one)."""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
from dataclasses import dataclass, field

import torch

from kimiserve.ops.moe.fragment_order import FRAGMENT_BLOCK_M, SWAPPED_BLOCK_M

DECODE_MAX_ROWS = 8  # mean routed rows per expert up to which `default_config` takes its decode tiles
SWAPPED_DECODE_MAX_ROWS = 5  # ... and up to which the decode fragment GEMMs swap operands (blocks of 8 pairs)
WGMMA_MIN_ROWS = 16  # above this many, the prefill (wgmma) fragment GEMMs


def hopper_programs_an_sm(registers: int, num_warps: int, shared_bytes: int = 0) -> int:
    """Programs of a kernel resident at once on one sm_90 SM: registers are handed out a warp at a time in units of
    256 (a thread's count rounded up to a multiple of 8: 84 takes what 88 does), 65536 an SM; at most 64 warps and
    32 programs; 228 KB of shared memory, of which each program's share also takes 1 KB the hardware reserves."""
    if registers < 1 or num_warps < 1 or shared_bytes < 0:
        raise ValueError(f"registers and num_warps must be >= 1 and shared_bytes >= 0; got {registers}, {num_warps}, "
                         f"{shared_bytes}")
    warp_registers = -(-registers * 32 // 256) * 256
    by_registers = 65536 // warp_registers // num_warps
    by_shared = 228 * 1024 // (shared_bytes + 1024)
    return min(by_registers, 64 // num_warps, 32, by_shared)


# The decode down GEMM (`ops.moe.gluon_decode`, 64 x 256 tiles, 4 warps) builds to 94 registers (96 swapped), 5
# programs an SM; capped at 72 (a few spill) 7 fit. Where its grid fits one wave of 7 but not of 5 the cap pays: K3.1
# at 1 token, 896 programs on the H200's 132 SMs, 0.041 -> 0.038 ms (session 18; swapped, 0.105 -> 0.101 ms a layer,
# session 21); over several waves the spills cost more (16 and 64 tokens 5-6% slower; session 18).
DOWN_REGISTERS, DOWN_CAPPED_REGISTERS = 96, 72
DOWN_PROGRAMS_AN_SM = hopper_programs_an_sm(DOWN_REGISTERS, 4)  # 5
DOWN_CAPPED_PROGRAMS_AN_SM = hopper_programs_an_sm(DOWN_CAPPED_REGISTERS, 4)  # 7
# The swapped decode gate/up GEMM builds to 126 registers, 4 programs an SM. A grid of over one wave and under two
# (K3.1 at 1 token: 768 programs, 1.45 waves on 132 SMs) is split along K in two (`GemmTiles.split_k`), so that its
# last wave is about as full as its first: on the H200 the same program streams its weights at 92% of the copy rate
# at 16 tokens (20 waves) and at 68% at 1 token (session 21); split, 0.1245 -> 0.1143-0.1180 ms a layer in graphs of
# 8 on an H100 (session 22). At one wave or under (all programs resident at once) splitting did not pay: the `small`
# preset's MoE at 1 and 2 tokens (192 and 384 programs) -1 to -3%, at 8 tokens (864) +6%.
UP_REGISTERS = 126
UP_PROGRAMS_AN_SM = hopper_programs_an_sm(UP_REGISTERS, 4)  # 4

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # Triton's CPU interpreter: no Gluon, no inline PTX


@dataclass(frozen=True)
class GemmTiles:
    """Tiling of one of the two grouped GEMMs. split_k > 1: each (block, column tile) split over that many
    programs along K, fp32 partials reduced in a fixed order (`ops.moe.epilogue`; the decode fragment GEMMs too,
    where a grid of few programs would leave the SMs a partial last wave). max_registers: a cap on the compiled
    kernel's registers per thread (Triton's maxnreg; more programs per SM, spills past it), None for the compiler's
    choice. swap: the weights as the MMA's A operand and the block's pairs as N (the Triton tiles: wgmma N = 32; the
    decode fragment GEMMs: mma.sync with 16 weight rows a warp, block_n = 16 num_warps, blocks of 8 or 16 pairs, both
    GEMMs or neither)."""

    block_n: int = 64
    block_k: int = 128
    num_warps: int = 4
    num_stages: int = 3
    swap: bool = False
    split_k: int = 1
    max_registers: int | None = None

    def compile_options(self) -> dict:
        """Triton's compile options for this tiling: warps, stages, and maxnreg where capped."""
        options = dict(num_warps=self.num_warps, num_stages=self.num_stages)
        if self.max_registers:
            options["maxnreg"] = self.max_registers
        return options


@dataclass(frozen=True)
class WgmmaTail:
    """One launch of the wgmma fragment GEMMs' tail tiles (`MoEConfig.wgmma_tails`): block_m tokens a tile (64 or
    32: wgmma N), num_stages shared-memory stages (>= 3), max_registers a cap on its registers per thread (Triton's
    maxnreg; 128 lets two 8-warp programs share an SM where their stages fit twice in its shared memory; None: the
    compiler's choice, 146-172 registers at 32-64 tokens on 8 warps, one program an SM), num_warps 8 or 16 (as
    `GemmTiles.num_warps` of the wgmma GEMMs: two weight tiles as one on four warpgroups, 82-108 registers)."""

    block_m: int = 64
    num_stages: int = 4
    max_registers: int | None = None
    num_warps: int = 8


@dataclass(frozen=True)
class MoEConfig:
    """block_m: rows (routed pairs) per block, shared by both GEMMs; up: the gate/up GEMM (N = the
    intermediate dim, K = hidden); down: the down GEMM (N = hidden, K = intermediate); dequant:
    "exact", "lut" or "dot_scaled" (the last two for bf16 inputs only; see the module doc);
    combine_block: hidden columns per program of the combine; fragments: both GEMMs as Gluon kernels whose
    dequantised weights are register fragments of the MMA (CUDA, bf16, the shift layout; the activation between
    them kept in `ops.moe.fragment_order`'s MMA-k order): with block_m 16 `ops.moe.gluon_decode`'s (mma.sync,
    block_k 128 or 256, num_stages not used; with swapped tiles block_m 8 too), with block_m 64 or 128
    `ops.moe.gluon_prefill`'s (wgmma, tiles of 128 x 128 on 8 warps, or on 16 where a program has two weight tiles
    (the gate/up GEMM, the down GEMM where h is a multiple of 256: one 256-row tile on four warpgroups, the main
    launches only), num_stages shared-memory stages, max_registers a cap on the launch: 128 fits two 8-warp programs
    an SM where their stages fit, 3 of block_m 64; at block_m 128 both GEMMs run each expert's tail, its last block
    where it holds at most 64 rows, in launches of their own, `wgmma_tails`); dependent_launch: the decode chain
    (align, x's MMA-k copy, the fragment GEMMs, combine) launched with programmatic dependent launch (CUDA, sm_90+):
    each kernel may start while the one before it finishes, and waits for it (`griddepcontrol.wait`) only before it
    reads that kernel's output; the fragment GEMMs load their first weights before the wait (see
    `ops.moe.gluon_decode`); wgmma_tails: with the wgmma fragment GEMMs on
    128-row blocks, the launches (`WgmmaTail`) that take each expert's last block where it holds few rows, largest
    tile first, each the blocks of more rows than the next one's tile holds (the 128-token launch: more than the
    first one's): by default those of at most 64 rows as 64-token tiles (`ops.moe.gluon_prefill.wgmma_gemm_tails`)."""

    block_m: int = 16
    up: GemmTiles = field(default_factory=GemmTiles)
    down: GemmTiles = field(default_factory=GemmTiles)
    dequant: str = "exact"
    combine_block: int = 512
    fragments: bool = False
    dependent_launch: bool = False
    wgmma_tails: tuple[WgmmaTail, ...] = (WgmmaTail(),)


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks N k pairs over E experts can need: each used expert pads < BLOCK_M rows."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def default_config(num_tokens: int, top_k: int, num_experts: int, dtype: torch.dtype, mxfp4: bool,
                   mxfp4_layout: str = "checkpoint", dims: tuple[int, int] | None = None,
                   num_sms: int | None = None, dependent_launch: bool = False) -> MoEConfig:
    """The launch config for a batch: BLOCK_M from the mean rows per expert, tiles by regime. dims: the experts'
    (hidden, intermediate) sizes, which decide whether the fragment GEMMs fit (None: they are not considered).
    num_sms: the GPU's SM count, for the decode down GEMM's one-wave register cap and the gate/up GEMM's split
    (None: neither).
    dependent_launch: the device runs programmatic dependent launch (CUDA sm_90+), which the decode fragment chain
    then takes.

    The MXFP4 choices are the fastest of benchmarks/moe_layer.py's H200 sweeps at the K3.1 shape (BENCHMARKS.md):
    - up to DECODE_MAX_ROWS rows per expert (448 tokens), where the Gluon fragment GEMMs fit (shift layout,
      compiled, dims multiples of 256): `ops.moe.gluon_decode`'s, 256-wide K steps, 64 columns, 4 warps, the
      launches chained with PDL where the device has it; up to SWAPPED_DECODE_MAX_ROWS (K3.1: 280 tokens) with
      swapped operands on blocks of 8 pairs (session 21, one call a replay in two runs: 0.115 -> 0.096-0.107 ms
      at 1 token, 1.24 -> 1.03-1.08 at 16, 3.44 -> 2.90-2.93 at 64, 5.09 -> 4.40-4.87 at 256, random routing;
      the `small` preset's engine step at batch 8 1.3% faster without PDL), above it 16-row blocks unswapped
      (1.13-1.27x the Triton tile at 1-64 tokens, session 14; PDL there not timed); a swapped gate/up grid of
      over one wave and under two split along K in two (session 22: 5-9% off K3.1's 1-token layer on an H100);
    - else in the decode regime 16-row Triton blocks, unswapped (~15% under the swapped form): of 64 or more
      experts 128 weight rows x 128 K a step (3-6% under 64 x 256 at 1-256 tokens, sessions 8 and 13), of fewer 64 x
      256 (the 128-row tile was 0.6% slower in the `small` preset's engine steps, session 13);
    - above WGMMA_MIN_ROWS, where they fit, `ops.moe.gluon_prefill`'s wgmma fragment GEMMs on 128-row blocks: below
      256 rows a program's two weight tiles as one on 16 warps, and each expert's last block as a 32-token tile (at
      most 32 rows; two programs an SM at 128 registers) or a 64-token tile (session 21, K3.1: 28.82 -> 25.42 ms at
      8192 tokens, 45.0% of the matmul rate, random routing; 24.10 -> 24.00 zipf; 9.41 -> 7.88 ms at 1024); from 256
      rows 8 warps, 64-token tails and 4 stages for the down GEMM (the `small` preset's prefill chunks, 1.4-1.8x the
      Triton tile, session 16);
    - else up to 24 rows 32-row Triton blocks, 64 (gate/up) and 128 (down) columns x 128 K (7% under the swapped
      32-row tile), and above 64-row blocks on 4 warps.
    bf16 weights keep the swapped Triton form for decode (not re-measured). The shift layout takes dequant "shift"."""
    if dtype != torch.bfloat16:  # fp32 (the CPU-sized models) and fp16: exact dequant, IEEE or fp16 dots
        small = GemmTiles(block_n=32, block_k=32, num_warps=4, num_stages=2)
        return MoEConfig(block_m=16, up=small, down=small, dequant="exact")
    dequant = "exact" if not mxfp4 else "shift" if mxfp4_layout == "shift" else "lut"
    mean_rows = num_tokens * top_k / max(1, num_experts)
    if mean_rows <= DECODE_MAX_ROWS and dequant == "shift" and dims is not None and _fragments_fit(*dims):
        swap = mean_rows <= SWAPPED_DECODE_MAX_ROWS
        block_m = SWAPPED_BLOCK_M if swap else FRAGMENT_BLOCK_M
        tiles = GemmTiles(block_n=64, block_k=256, num_warps=4, num_stages=2, swap=swap)
        up = down = tiles
        blocks = max_blocks(num_tokens * top_k, num_experts, block_m)
        down_programs = blocks * -(-dims[0] // tiles.block_n)
        if num_sms and DOWN_PROGRAMS_AN_SM * num_sms < down_programs <= DOWN_CAPPED_PROGRAMS_AN_SM * num_sms:
            down = dataclasses.replace(tiles, max_registers=DOWN_CAPPED_REGISTERS)  # one wave instead of two
        up_slots = UP_PROGRAMS_AN_SM * (num_sms or 0)
        if swap and up_slots < blocks * -(-dims[1] // tiles.block_n) < 2 * up_slots and dims[0] >= 2 * tiles.block_k:
            up = dataclasses.replace(tiles, split_k=2)  # a last wave as full as the first
        return MoEConfig(block_m=block_m, up=up, down=down, dequant=dequant, fragments=True,
                         dependent_launch=dependent_launch)
    if mean_rows <= DECODE_MAX_ROWS and mxfp4 and num_experts >= 64:
        tiles = GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=3)
        return MoEConfig(block_m=16, up=tiles, down=tiles, dequant=dequant)
    if mean_rows <= DECODE_MAX_ROWS:  # bf16 weights: 128-wide K steps (shared memory: two weight tiles per stage)
        tiles = GemmTiles(block_n=64, block_k=256 if mxfp4 else 128, num_warps=4, num_stages=3, swap=not mxfp4)
        return MoEConfig(block_m=16, up=tiles, down=tiles, dequant=dequant)
    if mean_rows > WGMMA_MIN_ROWS and dequant == "shift" and dims is not None and _wgmma_fragments_fit(*dims):
        if mean_rows >= 256:
            up = GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3)
            return MoEConfig(block_m=128, up=up, down=dataclasses.replace(up, num_stages=4), dequant=dequant,
                             fragments=True)
        tiles = GemmTiles(block_n=128, block_k=128, num_warps=16, num_stages=3)
        tails = (WgmmaTail(), WgmmaTail(block_m=32, num_stages=4, max_registers=128))
        return MoEConfig(block_m=128, up=tiles, down=tiles, dequant=dequant, fragments=True, wgmma_tails=tails)
    if mean_rows <= 24 and not mxfp4:  # still one weight tile per block: the swapped form, wgmma N = 32
        tiles = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3, swap=True)
        return MoEConfig(block_m=32, up=tiles, down=tiles, dequant=dequant)
    up = GemmTiles(block_n=64, block_k=128, num_warps=4, num_stages=3)
    down = GemmTiles(block_n=128, block_k=128, num_warps=4, num_stages=3)
    if mean_rows <= 24:
        return MoEConfig(block_m=32, up=up, down=down, dequant=dequant)
    if mean_rows <= 48 or mxfp4:
        return MoEConfig(block_m=64, up=up, down=down, dequant=dequant)
    up = GemmTiles(block_n=64, block_k=128, num_warps=8, num_stages=3)
    down = GemmTiles(block_n=128, block_k=128, num_warps=8, num_stages=3)
    return MoEConfig(block_m=128, up=up, down=down, dequant=dequant)


def _fragments_fit(h: int, inter: int) -> bool:
    """The default takes the decode fragment GEMMs for experts of these dims: compiled (not the interpreter), Gluon
    importable, both dims multiples of 256 (the measured 256-wide K steps; 128-wide steps, which smaller experts
    such as kimi-demo's 128 x 128 would take, stay opt-in: not timed against the Triton tiles)."""
    return h % 256 == 0 and inter % 256 == 0 and _gluon_kernels("gluon_decode")


def _wgmma_fragments_fit(h: int, inter: int) -> bool:
    """The default takes the prefill (wgmma) fragment GEMMs for experts of these dims: compiled, Gluon importable,
    both dims multiples of 256 (the kernels take multiples of 128; the default keeps to the measured shapes, as the
    decode rule does: kimi-demo's 128 x 128 experts keep the Triton tiles, untimed against these)."""
    return h % 256 == 0 and inter % 256 == 0 and _gluon_kernels("gluon_prefill")


@functools.cache
def _gluon_kernels(module: str) -> bool:
    if _INTERPRET:
        return False
    try:
        importlib.import_module(f"kimiserve.ops.moe.{module}")
    except ImportError:
        return False
    return True


__all__ = ["DECODE_MAX_ROWS", "SWAPPED_DECODE_MAX_ROWS", "WGMMA_MIN_ROWS", "GemmTiles", "MoEConfig", "WgmmaTail",
           "default_config", "hopper_programs_an_sm", "max_blocks"]
