# Call A for an H200 (carry .whl; needs_h200 for the peer): the 1-token MoE target with the split default, the layer table with its peer, KDA, host.
set -o pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:. || exit
export PYTHONUNBUFFERED=1
git rev-parse --short HEAD > $OUT/TREE 2>/dev/null; cp scratch/TREE $OUT/TREE 2>/dev/null
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,clocks.max.mem --format=csv | tee $OUT/gpu.txt
t0=$(date +%s)
timeout 170 python3 benchmarks/moe_timeline.py --tokens 1 --layers 8 --variants default,default+sk1,default,default+sk1 --out $OUT/moe_timeline_1tok.json 2>&1 | tee $OUT/log_timeline.txt | tail -25
echo "timeline took $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 230 python3 benchmarks/moe_layer.py --routings random,zipf --today-tokens '' --tokens 1,16,64,256,1024,8192 --variants default --out $OUT/moe_layer.json 2>&1 | tee $OUT/log_layer.txt | tail -30
echo "layer took $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 60 python3 benchmarks/kda_decode_step.py --batches 1,8 --heads 96 --out $OUT/kda_decode_step.json 2>&1 | tail -12
echo "kda took $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
timeout 110 python3 benchmarks/host_overhead.py --batches 1,64 --steps 40 --async-scheduling on --out $OUT/host_overhead.json 2>&1 | tail -12
echo "host took $(( $(date +%s) - t0 )) s"
