"""Smoke test of benchmarks/dcp_traffic.py --quick: two gloo ranks count what the decode step's
collectives send, every count equals the formula, the capacity rows equal `kimiserve plan`.

Byte counts, not timings: the figures are exact and asserted."""

import json
import os
import subprocess
import sys
import pytest
from pathlib import Path

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "dcp_traffic.py"

TOP_KEYS = {"benchmark", "model", "quick", "device", "cpu_model", "cpu_count", "torch_version", "date", "git_commit",
            "command", "sizes", "convention", "traffic", "capacity", "all_measured_equal_formula", "wall_seconds"}
ROW_KEYS = {"D", "tp", "heads_per_rank", "context", "batch", "key_format", "interleave", "S0", "candidates",
            "queries", "partials", "a_selection", "a_total", "b_selection", "b_total", "c_selection", "c_total"}


def test_dcp_traffic_quick(tmp_path):
    out = tmp_path / "dcp_traffic.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--out", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "bytes each rank sends" in proc.stdout and "full 1,048,576-token contexts" in proc.stdout
    data = json.loads(out.read_text())
    assert TOP_KEYS <= data.keys(), TOP_KEYS - data.keys()
    assert data["quick"] is True and data["all_measured_equal_formula"] is True and "--quick" in data["command"]

    rows = data["traffic"]
    assert {(r["context"], r["D"]) for r in rows if r["batch"] == 1} >= {
        (S, D) for S in (131072, 340000, 1048576) for D in (2, 4, 8)}
    measured = [r for r in rows if "measured" in r]
    assert {(r["context"], r["batch"]) for r in measured} == {(4096, 1), (4096, 3)}
    for r in rows:
        assert ROW_KEYS <= r.keys(), ROW_KEYS - r.keys()
        D, B = r["D"], r["batch"]
        assert r["candidates"] == min(2048, r["S0"])
        # the formula itself: k candidates of 8 bytes, queries and partials of the rank's 96 / D heads, fp32
        assert r["a_selection"] == B * (D - 1) * r["candidates"] * 8
        assert r["queries"] == B * (D - 1) * (96 // D) * (512 + 64) * 4
        assert r["partials"] == B * (D - 1) * (96 // D) * (512 + 1) * 4
        assert r["b_selection"] == B * (D - 1) * r["S0"] * 4
        assert r["c_selection"] == B * (D - 1) * r["S0"] * {"fp8": 132, "fp4": 68}[r["key_format"]]
        assert r["a_total"] == r["queries"] + r["a_selection"] + r["partials"]
    for r in measured:
        m = r["measured"]
        assert r["measured_equals_formula"] and m["b_selection_equals_a"] and m["b_output_equals_a"]
        for scheme in ("a", "b", "c"):
            assert m["per_rank_sent"][scheme] == [r[f"{scheme}_total"]] * r["D"]
        # the exact merge issues three collectives: queries, candidates, partials
        assert [(c["op"], c["dtype"]) for c in m["a_calls"]] == [
            ("all_gather_single", "float32"), ("all_gather_single", "int32"), ("all_to_all_single", "float32")] or \
            [c["op"] for c in m["a_calls"]] == ["all_gather_into_tensor", "all_gather_into_tensor", "all_to_all_single"]
    one = {r["key_format"]: r for r in measured if r["batch"] == 1}
    three = {r["key_format"]: r for r in measured if r["batch"] == 3}
    for kv in one:  # linear in the batch
        for key in ("a_total", "b_total", "c_total"):
            assert three[kv][key] == 3 * one[kv][key]
    big = next(r for r in rows if r["context"] == 1048576 and r["D"] == 8 and r["key_format"] == "fp8")
    assert big["b_selection"] == 32 * big["a_selection"] and big["b_total"] > 8 * big["a_total"]

    cap = data["capacity"]
    assert cap["context"] == 1048576 and cap["budget_bytes_per_rank"] > 0
    assert {(r["mode"], r["D"], r["kv_cache_dtype"]) for r in cap["rows"]} == {
        ("dcp", D, kv) for D in (1, 2, 4, 8) for kv in ("fp8", "fp4")} | {("tp", 8, "fp8"), ("tp", 8, "fp4")}
    for r in cap["rows"]:
        assert r["matches_plan"] and r["full_contexts"] == r["pages"] // r["pages_per_seq"], r
        assert r["pages_per_seq"] == -(-r["tokens_rank0"] // r["block_size"]) + r["state_pages_per_seq"]
    by = {(r["mode"], r["D"], r["kv_cache_dtype"]): r["full_contexts"] for r in cap["rows"]}
    assert by[("dcp", 8, "fp4")] > by[("dcp", 8, "fp8")] > by[("tp", 8, "fp8")]
