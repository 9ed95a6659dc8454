"""Smoke test of benchmarks/ep_dispatch.py --quick (2 gloo ranks, N = 1 and 4, both shapes, 3 iterations:
a few seconds): every scheme runs, its output equals the stand-in's exact answer, the bytes model holds
(and matches what the processes wrote to their sockets up to gloo's framing), the JSON is complete and
the table is printed. No timing is asserted."""

import json
import math
import os
import subprocess
import sys
import pytest
from pathlib import Path

pytestmark = pytest.mark.fixed_threads  # ranks / servers run with one torch thread: OMP_NUM_THREADS changes nothing

REPO = Path(__file__).resolve().parent.parent
TOP_KEYS = {"benchmark", "device", "date", "commit", "command", "quick", "shapes", "iters", "expert_compute", "limits",
            "rows"}
TIMES = ("median_ms", "min_ms", "p90_ms", "comm_median_ms", "bookkeeping_min_ms", "floor_ms")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def test_ep_dispatch_quick(tmp_path):
    out = tmp_path / "ep.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "ep_dispatch.py"), "--quick", "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert TOP_KEYS <= data.keys(), TOP_KEYS - data.keys()
    assert data["quick"] is True and data["commit"] and data["date"]
    lim = data["limits"][0]
    assert lim["ranks"] == 2 and positive(lim["a2a_bandwidth_gbps"]) and all(map(positive, lim["latency_ms"].values()))
    shapes = {s["name"]: s for s in data["shapes"]}
    assert shapes["kimi-k3.1-pro"] == dict(name="kimi-k3.1-pro", experts=896, top_k=16, hidden=3584, dtype="bfloat16")
    schemes = {"a_all_reduce_fp32", "a_all_reduce_bf16", "a_reduce_scatter", "b_all_to_all_replicated",
               "b_all_to_all", "a_gathered"}
    rows = {(r["shape"], r["tokens"], r["scheme"]): r for r in data["rows"]}
    assert set(rows) == {(s, n, c) for s in shapes for n in (1, 4) for c in schemes}
    for (shape, n, scheme), r in rows.items():
        assert all(positive(r[k]) for k in TIMES), (shape, n, scheme)
        assert r["rel_rms_vs_x"] < 1e-2, (shape, n, scheme)  # identity experts, weights summing to 1: out = x
        assert r["collectives"] == {"a_all_reduce_fp32": 1, "a_all_reduce_bf16": 1, "a_reduce_scatter": 1,
                                    "b_all_to_all_replicated": 4, "b_all_to_all": 3, "a_gathered": 3}[scheme]
        # the payload model against the bytes written to the sockets: never more, framing < 1.5 KB per collective
        # (gloo's reduce-scatter runs as an all-reduce: it writes twice the reduce-scatter payload)
        wire, model = r["socket_bytes_per_rank"], r["bytes_per_rank"]
        payload = model + sum(b for op, (_, b) in r["by_op"].items() if op == "reduce_scatter")
        assert payload <= wire <= payload + 1500 * r["collectives"], (shape, n, scheme, model, wire)
    h = shapes["kimi-k3.1-pro"]["hidden"]
    for n in (1, 4):  # ring all-reduce on 2 ranks sends the whole buffer once: fp32 then bf16
        assert rows[("kimi-k3.1-pro", n, "a_all_reduce_fp32")]["bytes_per_rank"] == n * h * 4
        assert rows[("kimi-k3.1-pro", n, "a_all_reduce_bf16")]["bytes_per_rank"] == n * h * 2
    assert "| shape | EP | N | scheme |" in proc.stdout and proc.stdout.rstrip().endswith("|")
