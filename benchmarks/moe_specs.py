"""The fused MoE's launch configs as the benchmarks name them (SPECs; `benchmarks/moe_layer.py`'s doc lists the
parts), and options applied onto a default config ("default+pdl+pa2")."""

from __future__ import annotations

import dataclasses

from kimiserve.ops.moe import triton as tt

_T = tt.WgmmaTail
# MoEConfig.wgmma_tails by name: the default (64-token tiles); with 32-token tiles for blocks of at most 32 rows
# (4 stages, capped at 128 registers: two programs an SM); every tail capped (64-token tiles on 3 stages); the
# 64-token tails on 16 warps
TAILS = {"t64": (_T(),), "t32": (_T(), _T(32, 4, 128)), "t64r": (_T(64, 3, 128),),
         "t32r": (_T(64, 3, 128), _T(32, 4, 128)), "t64w": (_T(64, 4, None, 16),)}


def parse_variant(spec: str) -> tt.MoEConfig:
    """DEQUANT-mBM-nBN-kBK-wW-sS[-dnBN][-dkBK][-dwW][-dsS][-rR][-drR][-skS][-dskS][-tNAME][-swap][-frag][-pdl]
    -> MoEConfig (frag: MoEConfig.fragments, the Gluon fragment GEMMs; pdl: MoEConfig.dependent_launch; sk / dsk:
    GemmTiles.split_k of gate/up / down; -tNAME: MoEConfig.wgmma_tails, one of TAILS)."""
    dequant, *parts = spec.split("-")
    if dequant not in tt._DEQUANT:
        raise ValueError(f"variant {spec!r}: dequant must be one of {list(tt._DEQUANT)}")
    vals, flags = {}, set()
    for p in parts:
        if p in ("swap", "frag", "pdl"):
            flags.add(p)
            continue
        if p in TAILS:
            vals["t"] = p
            continue
        key = next((pre for pre in ("dsk", "dn", "dk", "dw", "ds", "dr", "sk") if p.startswith(pre)), p[:1])
        if key not in ("m", "n", "k", "w", "s", "r", "dn", "dk", "dw", "ds", "dr", "sk", "dsk") \
                or not p[len(key):].isdigit():
            raise ValueError(f"variant {spec!r}: cannot read {p!r}")
        vals[key] = int(p[len(key):])
    missing = {"m", "n", "k", "w", "s"} - vals.keys()
    if missing:
        raise ValueError(f"variant {spec!r} lacks {sorted(missing)}")
    swap = "swap" in flags
    up = tt.GemmTiles(block_n=vals["n"], block_k=vals["k"], num_warps=vals["w"], num_stages=vals["s"], swap=swap,
                      split_k=vals.get("sk", 1), max_registers=vals.get("r"))
    down = tt.GemmTiles(block_n=vals.get("dn", vals["n"]), block_k=vals.get("dk", vals["k"]),
                        num_warps=vals.get("dw", vals["w"]), num_stages=vals.get("ds", vals["s"]), swap=swap,
                        split_k=vals.get("dsk", 1), max_registers=vals.get("dr"))
    return tt.MoEConfig(block_m=vals["m"], up=up, down=down, dequant=dequant, fragments="frag" in flags,
                        dependent_launch="pdl" in flags, wgmma_tails=TAILS[vals.get("t", "t64")])


def config_spec(cfg: tt.MoEConfig) -> str:
    u, d = cfg.up, cfg.down
    spec = f"{cfg.dequant}-m{cfg.block_m}-n{u.block_n}-k{u.block_k}-w{u.num_warps}-s{u.num_stages}"
    spec += f"-dn{d.block_n}" if d.block_n != u.block_n else ""
    spec += f"-dk{d.block_k}" if d.block_k != u.block_k else ""
    spec += f"-dw{d.num_warps}" if d.num_warps != u.num_warps else ""
    spec += f"-ds{d.num_stages}" if d.num_stages != u.num_stages else ""
    spec += f"-r{u.max_registers}" if u.max_registers else ""
    spec += f"-dr{d.max_registers}" if d.max_registers else ""
    spec += f"-sk{u.split_k}" if u.split_k > 1 else ""
    spec += f"-dsk{d.split_k}" if d.split_k > 1 else ""
    if cfg.wgmma_tails != tt.MoEConfig.wgmma_tails:
        unnamed = "tails" + ".".join(f"{t.block_m}s{t.num_stages}r{t.max_registers or 0}w{t.num_warps}"
                                     for t in cfg.wgmma_tails)
        spec += "-" + next((name for name, tails in TAILS.items() if tails == cfg.wgmma_tails), unnamed)
    return spec + ("-swap" if u.swap else "") + ("-frag" if cfg.fragments else "") + \
        ("-pdl" if cfg.dependent_launch else "")


def with_options(cfg: tt.MoEConfig, options: list[str]) -> tt.MoEConfig:
    """cfg with SPEC-style options: pdl (MoEConfig.dependent_launch), skS / dskS (GemmTiles.split_k of the gate/up /
    down GEMM), a name of TAILS (MoEConfig.wgmma_tails): "default+pdl+sk2" applies them to a default config."""
    for opt in options:
        if opt in TAILS:
            cfg = dataclasses.replace(cfg, wgmma_tails=TAILS[opt])
            continue
        key = next((pre for pre in ("pdl", "dsk", "sk") if opt.startswith(pre)), None)
        value = opt[len(key):] if key else ""
        if key is None or (key == "pdl") != (value == "") or (value and not value.isdigit()):
            raise ValueError(f"option {opt!r}: one of pdl, skS, dskS, {', '.join(TAILS)}")
        if key == "pdl":
            cfg = dataclasses.replace(cfg, dependent_launch=True)
        else:
            gemm = "up" if key == "sk" else "down"
            cfg = dataclasses.replace(cfg, **{gemm: dataclasses.replace(getattr(cfg, gemm), split_k=int(value))})
    return cfg


def default_with_options(spec: str, base: str, make_default) -> tt.MoEConfig | None:
    """`spec` "BASE+OPT+..." -> make_default() with the options (None when spec is not BASE with options)."""
    name, *options = spec.split("+")
    if name != base or not options:
        return None
    return with_options(make_default(), options)
