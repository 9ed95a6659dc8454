#!/usr/bin/env bash
# The GPU checks and measurements, in stages that each fit one device call (see README: GPU kernels):
#   bash scripts/gpu_checks.sh tests|bench|accuracy|timing [OUT_DIR]
# tests:    every GPU test (kernels vs references incl. the fused MoE, the engine vs the full forward, CUDA
#           graphs, fla KDA)
# bench:    decode_attention.py (fp8 and fp4 rows), step_profile.py, capacity.py, kda.py, moe_layer.py,
#           e2e_step.py (more than one device call: run the scripts one by one)
# accuracy: cache_accuracy.py (index recall, MLA error, greedy agreement of the small preset)
# timing:   scan_variants.py (e4m3-query scans against the library, fp8 and fp4), the kernels' timing sweeps
#           (-m timing) and the launch-knob sweep of top-k
# Each test file runs under its own time limit, so one slow compile does not cost the other files'
# failure reports (pytest prints them only at the end of a run).
# With wheels in .whl/ (no internet on the device) they are installed to /tmp/site first.
set -euo pipefail
stage=${1:?usage: gpu_checks.sh tests|bench|accuracy|timing [OUT_DIR]}
out=${2:-${OUT:-benchmarks/results}}
mkdir -p "$out"
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
export PYTHONUNBUFFERED=1
case "$stage" in
  tests)
    for f in tests/test_triton_cache_write.py tests/test_gpu.py tests/test_triton_indexer.py tests/test_triton_mla.py \
             tests/test_triton_topk.py tests/test_triton_moe.py \
             tests/test_triton_moe_shapes.py tests/test_fla_kda.py tests/test_glue_ops.py; do
      timeout "${GPU_TEST_FILE_SECONDS:-240}" python3 -m pytest -q -rf --tb=short -p no:cacheprovider \
        -m "gpu and not timing" "$f" 2>&1 | tee -a "$out/gpu_tests.txt" | tail -15 || true
    done ;;
  bench)
    python3 benchmarks/decode_attention.py --kv-cache-dtypes fp8,fp4 --out "$out/decode_attention.json"
    python3 benchmarks/step_profile.py --out "$out/step_profile.json"
    python3 benchmarks/capacity.py --out "$out/capacity.json"
    python3 benchmarks/kda.py --out "$out/kda.json"
    python3 benchmarks/moe_layer.py --check --out "$out/moe_layer.json"
    python3 benchmarks/e2e_step.py --out "$out/e2e_step.json" ;;
  accuracy)
    python3 benchmarks/cache_accuracy.py --out "$out/cache_accuracy.json" ;;
  timing)
    python3 benchmarks/scan_variants.py --contexts 1048576 --batches 1,64 --kv-cache-dtypes fp8,fp4 \
      --out "$out/scan_variants.json"
    python3 -m pytest -q -s -p no:cacheprovider -m timing tests/test_triton_mla.py tests/test_triton_indexer.py \
      tests/test_triton_topk.py 2>&1 | tee "$out/kernel_timings.txt"
    python3 benchmarks/sweep_decode.py --kernels topk --out "$out/sweep_topk.json" ;;
  *) echo "unknown stage $stage (tests, bench, accuracy, timing)" >&2; exit 2 ;;
esac
