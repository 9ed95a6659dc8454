"""Smoke test of benchmarks/cache_accuracy.py: the quick configuration runs on the CPU and writes
complete, sane JSON (recalls in [0, 1], FP8 at least about as good as MXFP4, finite errors that grow
as the format narrows, generation agreement fractions)."""

import json
import math
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "benchmarks" / "cache_accuracy.py"
INDEX_FORMATS = ("fp8", "fp4", "fp4_rotated", "fp4_smoothed")
MLA_VARIANTS = ("bf16_vs_fp32", "fp8", "fp4", "fp4_calibrated", "fp4_rope_fp8", "fp4_small",
                "fp4_small_calibrated")


def fraction(x) -> bool:
    return isinstance(x, float) and 0.0 <= x <= 1.0


def finite(x) -> bool:
    return isinstance(x, float) and math.isfinite(x) and x >= 0


def test_cache_accuracy_quick(tmp_path):
    out = tmp_path / "acc.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert proc.stdout.rstrip().splitlines()[-1].lstrip().startswith("float32")  # the table comes last

    data = json.loads(out.read_text())
    assert data["benchmark"] == "cache_accuracy" and data["device"] == "cpu" and data["quick"] is True
    assert data["date"] and data["torch_version"] and data["parts"] == [1, 2, 3]

    recall = data["index_recall"]
    assert recall["topk"] == 2048 and sorted(recall["contexts"]) == sorted(str(c) for c in data["config"]["contexts"])
    for ctx, variants in recall["contexts"].items():
        assert sorted(variants) == ["no_outliers", "outliers"]
        assert len(variants["outliers"]["outlier_channels"]) == 4 and variants["no_outliers"]["outlier_channels"] == []
        for variant, res in variants.items():
            for name in INDEX_FORMATS:
                r = res[name]
                for key in ("recall_mean", "recall_min", "top256_recall_mean", "relevant_recall_mean"):
                    assert fraction(r[key]), (ctx, variant, name, key, r[key])
                assert r["recall_min"] <= r["recall_mean"] and len(r["recall_per_query"]) == recall["queries"]
                assert finite(r["key_rel_rms_error"]) and r["key_rel_rms_error"] > 0
            # FP8 is the finer format; 4 bits must lose something, but the best tokens survive
            assert res["fp8"]["recall_mean"] >= res["fp4"]["recall_mean"] - 0.02, (ctx, variant)
            assert res["fp4"]["recall_mean"] < 0.999 and res["fp8"]["recall_mean"] > 0.9
            assert res["fp4_rotated"]["top256_recall_mean"] > 0.9
        # the 4 outlier channels crush whole MXFP4 groups: every remedy does better than plain fp4
        out_res = variants["outliers"]
        assert out_res["fp4_smoothed"]["recall_mean"] > out_res["fp4"]["recall_mean"]
        assert out_res["fp4_rotated"]["recall_mean"] > out_res["fp4"]["recall_mean"]

    mla = data["mla_error"]
    assert mla["heads"] == 96 and mla["latent_dim"] == 512 and mla["rope_dim"] == 64 and mla["selected_tokens"] == 2048
    res = mla["results"]
    assert sorted(res) == sorted(MLA_VARIANTS)
    for name, r in res.items():
        for key in ("rel_rms", "rel_rms_per_head_median", "rel_rms_per_head_max", "latent_rel_rms", "nope_rel_rms",
                    "rope_rel_rms"):
            assert finite(r[key]), (name, key, r[key])
    assert 0 < res["bf16_vs_fp32"]["rel_rms"] < res["fp8"]["rel_rms"] < res["fp4"]["rel_rms"] < 0.5
    assert res["fp8"]["latent_rel_rms"] < res["fp4"]["latent_rel_rms"]
    assert math.isclose(res["fp4_rope_fp8"]["rope_rel_rms"], res["fp8"]["rope_rel_rms"], rel_tol=1e-5)  # one FP8 trip
    assert 0 < mla["nvfp4_global_scale_calibrated"] < 1

    gen = data["generation"]
    assert gen["model"] == "tiny" and gen["random_weights"] is True and gen["reference"] == "bf16"
    rows = gen["model_dtypes"]["float32"]
    # the CPU is deterministic: no rerun of the reference; in fp32 the bf16 cache's decode-time
    # tokens are its own prefill argmaxes (the calibration row of the teacher-forced measure)
    assert sorted(rows) == ["bf16_decode_vs_prefill", "fp4", "fp8"], rows
    assert rows.pop("bf16_decode_vs_prefill")["teacher_forced_agreement"] == 1.0
    for kv, r in rows.items():
        assert "error" not in r, (kv, r)
        assert fraction(r["teacher_forced_agreement"]) and r["teacher_forced_agreement"] >= r["position_agreement"]
        assert fraction(r["prefix_agreement"]) and fraction(r["position_agreement"])
        assert r["prefix_agreement"] <= r["position_agreement"]
        assert r["tokens_per_prompt"] == [gen["max_tokens"]] * len(gen["prompt_lens"])
