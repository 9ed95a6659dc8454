# Issue 15's whole e2e table for an H200 (carry .whl; needs_h200: the 256 x 128K row does not fit 80 GB). It saves
# after each row; afterwards: python3 benchmarks/e2e_table.py OUT/e2e_step.json --commit TREE --write
# benchmarks/results/e2e_step.json, and its table first in BENCHMARKS.md's "Issue 15 at a glance".
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit
export PYTHONUNBUFFERED=1
git rev-parse --short HEAD > $OUT/TREE 2>/dev/null; cp scratch/TREE $OUT/TREE 2>/dev/null
nvidia-smi --query-gpu=name,memory.total --format=csv | tee $OUT/gpu.txt
timeout 580 python3 benchmarks/e2e_step.py --quick --batches 1,8,64,256 --contexts 4096,131072 --single-contexts 1000000 --prefill 32768,131072 --out $OUT/e2e_step.json 2>&1 | tee $OUT/log_e2e.txt | tail -30
