"""benchmarks/e2e_table.py: issue 15's engine table from e2e_step.py's JSON, each row against its target."""

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))

import e2e_table  # noqa: E402

pytestmark = pytest.mark.fixed_threads  # no torch


def _decode(batch, context, fraction, tile=None):
    row = dict(kind="decode", batch=batch, context=context, step_ms=4.0, tokens_per_s=250.0 * batch,
               tokens_per_s_per_user=250.0, experts_hit_per_step=28, bytes=13_000_000_000, roofline_ms=4.0 * fraction,
               roofline_fraction=fraction)
    return {**row, "moe_decode_tile": tile} if tile else row


def _result(rows):
    return dict(device="NVIDIA H200", date="2026-12-06", commit="abc1234", copy_gbps=4213.3, matmul_tflops=768.3,
                command="benchmarks/e2e_step.py --quick", rows=rows)


def test_rows_against_their_targets():
    rows = [_decode(1, 4096, 0.774), _decode(64, 131072, 0.45), _decode(8, 4096, 0.73, "default+sk1"),
            _decode(1, 1000000, float("nan")),
            dict(kind="prefill", prompt_tokens=32768, ttft_s=1.077, tokens_per_s=30425.0, flops=4.343e14,
                 matmul_fraction=0.51),
            dict(kind="prefill", prompt_tokens=131072, ttft_s=4.65, tokens_per_s=28187.0, flops=1.8e15,
                 matmul_fraction=None)]
    text = e2e_table.table(_result(rows))
    lines = text.splitlines()
    assert lines[0].startswith("NVIDIA H200, 2026-12-06, tree `abc1234`; copy 4213 GB/s, bf16 matmul 768.3 TFLOP/s")
    assert "| batch 1, 4K context | 4.000 ms | 250 (250.0) | 28 | 13.00 GB | 3.096 ms | 77.4% | >= 60%: met |" in lines
    assert "| batch 64, 128K context | 4.000 ms | 16000 (250.0) | 28 | 13.00 GB | 1.800 ms | 45.0% | >= 50%: not met |" \
        in lines
    assert any(ln.startswith("| batch 8, 4K context [default+sk1] |") and ln.endswith("| 73.0% |  |") for ln in lines)
    assert any(ln.startswith("| batch 1, 1M context |") and "| n/a | >= 60%: not measured |" in ln for ln in lines)
    assert "| one 32K prompt | 1.077 s | 30425 | 434.3 | 51.0% | >= 40%: met |" in lines
    assert "| one 128K prompt | 4.650 s | 28187 | 1800.0 | n/a | >= 40%: not measured |" in lines


def test_skipped_rows_are_listed_with_their_reason():
    result = _result([_decode(1, 4096, 0.8)])
    result["skipped"] = [dict(batch=256, context=131072, reason="seeding 256 contexts takes 12544 pages")]
    lines = e2e_table.table(result).splitlines()
    assert "| batch 256, 128K context | - | - | - | - | - | - | skipped: seeding 256 contexts takes 12544 pages |" in lines


def test_commit_correction_is_stated_and_written(tmp_path, capsys):
    src, dst = tmp_path / "run.json", tmp_path / "e2e_step.json"
    src.write_text(json.dumps(_result([_decode(1, 4096, 0.7)])))
    assert e2e_table.main([str(src), "--commit", "def5678", "--write", str(dst)]) == 0
    assert "tree `def5678` (the JSON said `abc1234`)" in capsys.readouterr().out
    written = json.loads(dst.read_text())
    assert written["commit"] == "def5678" and written["commit_note"] == "the run's JSON said abc1234"
    assert written["rows"] == json.loads(src.read_text())["rows"]


def test_unreadable_input_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert e2e_table.main([str(bad)]) == 2
    assert "no 'rows' list" in capsys.readouterr().err
    assert e2e_table.main([str(tmp_path / "missing.json")]) == 2
    assert "cannot read" in capsys.readouterr().err
