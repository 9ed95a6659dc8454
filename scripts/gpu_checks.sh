#!/usr/bin/env bash
# The GPU checks and measurements, in stages that each fit one device call (see README: GPU kernels):
#   bash scripts/gpu_checks.sh tests|bench|accuracy|timing [OUT_DIR]
# tests:    every GPU test (kernels vs references, the engine vs the full forward, CUDA graphs, fla KDA)
# bench:    decode_attention.py (fp8 and fp4 rows), capacity.py, kda.py
# accuracy: cache_accuracy.py (index recall, MLA error, greedy agreement of the small preset)
# timing:   the kernels' timing sweeps (-m timing) and the launch-knob sweep of top-k
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
    python3 -m pytest -q -rf -p no:cacheprovider -m "gpu and not timing" 2>&1 | tee "$out/gpu_tests.txt" ;;
  bench)
    python3 benchmarks/decode_attention.py --kv-cache-dtypes fp8,fp4 --out "$out/decode_attention.json"
    python3 benchmarks/capacity.py --out "$out/capacity.json"
    python3 benchmarks/kda.py --out "$out/kda.json" ;;
  accuracy)
    python3 benchmarks/cache_accuracy.py --out "$out/cache_accuracy.json" ;;
  timing)
    python3 -m pytest -q -s -p no:cacheprovider -m timing tests/test_triton_mla.py tests/test_triton_indexer.py \
      tests/test_triton_topk.py 2>&1 | tee "$out/kernel_timings.txt"
    python3 benchmarks/sweep_decode.py --kernels topk --out "$out/sweep_topk.json" ;;
  *) echo "unknown stage $stage (tests, bench, accuracy, timing)" >&2; exit 2 ;;
esac
