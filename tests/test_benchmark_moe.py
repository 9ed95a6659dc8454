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


def test_moe_layer_dry_run(tmp_path):
    out = tmp_path / "moe.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_layer.py"), "--dry-run", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any("best variant" in ln for ln in lines[-15:])  # the tables are printed last
    assert lines[-1].startswith("exact-m32") and "*" in proc.stdout.split("per variant")[-1]  # the variant table
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
    random_rows = [r for r in data["rows"] if r["routing"] == "random"]
    assert all(positive(r["today_ms"]) and r["peer_rel_rms"] < 1e-2 for r in random_rows)
