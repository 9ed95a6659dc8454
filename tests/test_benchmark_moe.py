"""Smoke test of benchmarks/moe_layer.py --dry-run: tiny shapes on the CPU under Triton's interpreter,
every stage (checks, kernel and variants, today's path, the peer) runs and writes complete JSON.

Skipped unless KIMISERVE_TRITON_INTERPRET=1 (it needs Triton; the script turns the interpreter on
itself). No timing is asserted: only that the keys are there and the figures are positive.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

if os.environ.get("KIMISERVE_TRITON_INTERPRET") != "1":
    pytest.skip("set KIMISERVE_TRITON_INTERPRET=1 to run the Triton interpreter checks", allow_module_level=True)

REPO = Path(__file__).resolve().parent.parent
TOP_KEYS = {"benchmark", "device", "date", "commit", "command", "dry_run", "shape", "copy_gbps", "matmul_tflops",
            "variants", "checks", "rows"}
ROW_FIGURES = ("bytes", "bytes_with_workspace", "roofline_ms", "flops", "flop_roofline_ms", "kernel_ms",
               "bytes_roofline_fraction", "matmul_fraction", "tflops", "best_ms", "peer_ms", "experts_hit")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def last_dry_variant() -> str:
    sys.path.insert(0, str(REPO / "benchmarks"))
    from moe_layer import DRY_VARIANTS

    return DRY_VARIANTS[-1]


def test_moe_layer_dry_run(tmp_path):
    out = tmp_path / "moe.json"
    fake = tmp_path / "bin" / "nvidia-smi"  # a stand-in: one power-capped sample every 50 ms, the real CSV format
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\nwhile true; do echo \"$(date '+%Y/%m/%d %H:%M:%S.%3N'), 1500, 3201, 650.00, 60, "
                    "0x0000000000000004\"; sleep 0.05; done\n")
    fake.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PATH": f"{fake.parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_layer.py"), "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any("best variant" in ln for ln in lines[-15:])  # the tables are printed last
    assert lines[-1].startswith(last_dry_variant()) and "*" in proc.stdout.split("per variant")[-1]  # the table
    data = json.loads(out.read_text())
    assert TOP_KEYS <= data.keys(), TOP_KEYS - data.keys()
    assert data["device"] == "cpu" and data["dry_run"] is True and data["commit"] and data["date"]
    assert positive(data["copy_gbps"]) and positive(data["matmul_tflops"])
    assert data["checks"] and all(c["ok"] for c in data["checks"])
    assert data["defaults"] == ["default", "default-shift"]  # the checkpoint layout's default and the shift layout's
    assert {c["variant"] for c in data["checks"]} == {*data["defaults"], *data["variants"]}
    assert {(r["routing"], r["tokens"]) for r in data["rows"]} == {(r, n) for r in ("random", "zipf") for n in (1, 5)}
    for r in data["rows"]:
        for key in ROW_FIGURES:
            assert positive(r[key]), (r["routing"], r["tokens"], key)
        assert len(r["variants"]) == 2 + len(data["variants"])  # both defaults and every variant, all timed
        assert all(positive(v["ms"]) for v in r["variants"])
        assert r["stages"]["ms"].keys() == {"align", "up", "down", "combine"}
        assert all(positive(v) for v in r["stages"]["ms"].values()) and positive(r["stages"]["up_gbps"])
        assert r["peer"] in ("torch._grouped_mm", "torch.mm loop")
        assert r["clocks"]["samples"] > 0 and r["clocks"]["sm_mhz_mean"] == 1500 and r["clocks"]["power_capped"] == 1
        assert "_span" not in r
    random_rows = [r for r in data["rows"] if r["routing"] == "random"]
    assert all(positive(r["today_ms"]) and r["peer_rel_rms"] < 1e-2 for r in random_rows)


def test_variant_specs_carry_the_down_gemm_and_register_caps():
    """moe_layer.py SPECs: dn/dk/dw/ds set the down GEMM's tile, warps and stages apart, r/dr cap the registers
    (GemmTiles.max_registers), sk/dsk GemmTiles.split_k, pdl
    MoEConfig.dependent_launch, tNAME MoEConfig.wgmma_tails by moe_specs.TAILS' names; config_spec writes back the
    same SPEC; unknown parts are refused; the two defaults' names add no variant (both are always timed)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from moe_layer import config_spec, parse_variant, variants_for, with_options

    assert variants_for("default-shift,default", False) == []

    spec = "shift-m16-n128-k128-w4-s3-dn256-dk64-dw8-ds4-r128-dr96"
    cfg = parse_variant(spec)
    assert (cfg.up.block_n, cfg.up.block_k, cfg.up.num_warps, cfg.up.num_stages, cfg.up.max_registers) == \
        (128, 128, 4, 3, 128)
    assert (cfg.down.block_n, cfg.down.block_k, cfg.down.num_warps, cfg.down.num_stages, cfg.down.max_registers) == \
        (256, 64, 8, 4, 96)
    assert config_spec(cfg) == spec
    assert parse_variant("lut-m16-n64-k256-w4-s3").down.max_registers is None
    pdl = parse_variant("shift-m16-n64-k256-w4-s2-dr72-frag-pdl")
    assert pdl.dependent_launch and pdl.fragments and config_spec(pdl) == "shift-m16-n64-k256-w4-s2-dr72-frag-pdl"
    assert not cfg.dependent_launch
    split = parse_variant("shift-m8-n64-k256-w4-s2-dr72-sk2-dsk3-swap-frag-pdl")
    assert (split.up.split_k, split.down.split_k) == (2, 3)
    assert config_spec(split) == "shift-m8-n64-k256-w4-s2-dr72-sk2-dsk3-swap-frag-pdl"
    base = parse_variant("shift-m8-n64-k256-w4-s2-dr72-swap-frag")  # "default+sk2+dsk3+pdl" onto a default
    assert with_options(base, ["sk2", "dsk3", "pdl"]) == split
    for bad in ("pdl1", "lsr", "lpc", "sk", "skx", "pa2", "pf4"):
        with pytest.raises(ValueError, match=f"option {bad!r}"):
            with_options(base, [bad])
    for bad in ("pa2", "pf4", "lsr", "lpc"):  # options removed after they lost on the GPU
        with pytest.raises(ValueError, match="cannot read"):
            parse_variant(f"shift-m16-n64-k256-w4-s2-{bad}-frag")
    prefill = parse_variant("shift-m128-n128-k128-w8-s3-frag")
    tails = parse_variant("shift-m128-n128-k128-w8-s3-t32-frag")
    assert [t.block_m for t in prefill.wgmma_tails] == [64] and tails.wgmma_tails[1].max_registers == 128
    assert config_spec(tails) == "shift-m128-n128-k128-w8-s3-t32-frag" and with_options(prefill, ["t32"]) == tails
    assert with_options(tails, ["t64"]) == prefill and config_spec(prefill) == "shift-m128-n128-k128-w8-s3-frag"
    with pytest.raises(ValueError, match="option 't16'"):
        with_options(prefill, ["t16"])
    with pytest.raises(ValueError, match="cannot read"):
        parse_variant("shift-m16-n64-k256-w4-s3-q2")


def test_moe_layer_dry_run_times_each_variants_stages(tmp_path):
    """--stages-each: every variant after the checkpoint default has its gate/up and down times, and the stage
    table is printed last."""
    out = tmp_path / "moe.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_layer.py"), "--dry-run", "--stages-each",
                           "--routings", "random", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "gate/up ms / down ms per variant" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["routing"] for r in rows] == ["random", "random"]  # the dry run's 1 and 5 tokens
    for row in rows:
        timed = [v for v in row["variants"] if v["variant"] != "default"]
        assert timed and all(positive(v["stages_ms"]["up"]) for v in timed)
        # the down GEMM apart where it is not split along K (split, its partials are reduced in the combine)
        unsplit = [v for v in timed if "-dsk" not in v["variant"]]
        assert unsplit and all(positive(v["stages_ms"]["down"]) for v in unsplit)
