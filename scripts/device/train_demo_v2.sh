#!/usr/bin/env bash
# One H200 device call (~8.3 minutes, at most ~8.9, plus the call's startup): train kimi-demo, then train its
# speculative-decoding draft kimi-demo-draft while the new kimi-demo is evaluated on the GPU, and
# pack what comes back into $OUT (at most 8 files of at most 16 MiB: two model tarballs, logs, results).
#
#   OUT=/path bash scripts/device/train_demo_v2.sh          (from the repository root; PYTHONPATH=. is set here)
#
# The training step time grows with the padded tokens (last run: 0.09 s + 8.7 us a token + an attention term
# in tokens x length, R^2 0.98 over its logged steps: the GPU
# is busy, not launch-bound), so two trainings at once would share the GPU rather than overlap: they
# run one after the other, the draft (a seventh of the active parameters, several times cheaper per
# token) beside the evaluation, which is decode-bound (its cache pool capped at 8 GiB, so the draft
# keeps its memory). Every stage has a hard time limit; a stage that
# fails or runs out of time leaves the others' results. Times (minutes) can be changed by environment:
# MAIN_MINUTES (6.3), DRAFT_MINUTES (2.2), EVAL_SECONDS (90), SLACK_SECONDS (40: a training's
# limit is its budget plus this, for startup, the final evaluation and the export); DEVICE (cuda), EVAL_N (50) and
# TRAIN_ARGS (more train_demo.py options for both runs) exist for a CPU rehearsal of the script:
#   OUT=/tmp/o DEVICE=cpu MAIN_MINUTES=0.1 DRAFT_MINUTES=0.1 EVAL_N=2 TRAIN_ARGS="--tokens-per-step 1024 \
#     --max-seq-len 320 --max-filler-tokens 50 --num-workers 0 --eval-examples 4" bash scripts/device/train_demo_v2.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the device returns}
MAIN_MINUTES=${MAIN_MINUTES:-6.3}
DRAFT_MINUTES=${DRAFT_MINUTES:-2.2}
EVAL_SECONDS=${EVAL_SECONDS:-90}
SLACK_SECONDS=${SLACK_SECONDS:-40}
DEVICE=${DEVICE:-cuda}
EVAL_N=${EVAL_N:-50}
TRAIN_ARGS=${TRAIN_ARGS:-}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then  # no internet on the device: wheels shipped in .whl/, if any
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
WORK=$(mktemp -d)  # model folders and raw logs; only the packed files go to $OUT
LOGS=$WORK/logs
mkdir -p "$OUT" "$LOGS"
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 )) s] $*"; }
limit() { python3 -c "print(int(float('$1') * 60 + $2))"; }  # a stage's hard limit: its budget + slack (s)

nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader || true
# Beside the training: the shipped kimi-demo (same shapes) through the GPU engine once, so that fla-core's
# and the Triton kernels are compiled (and autotuned) into the cache before the new model's evaluation
# (a fresh machine compiles them on first use, for minutes); decode-bound, it takes little from the training.
timeout -k 5 240 python3 benchmarks/demo_eval.py --model kimi-demo --device "$DEVICE" --kv-cache-dtypes bf16 \
  --kv-cache-memory-gib 4 --n 1 --kinds arithmetic --passkey-lengths 16384 --passkey-n 1 \
  --json "$LOGS/warmup_shipped_model.json" > "$LOGS/warmup_shipped_model.log" 2>&1 &
warmup=$!
stamp "kimi-demo: training for $MAIN_MINUTES minutes"
timeout -k 10 "$(limit "$MAIN_MINUTES" "$SLACK_SECONDS")" python3 scripts/train_demo.py --device "$DEVICE" --model demo \
  --out "$WORK/kimi-demo" --max-minutes "$MAIN_MINUTES" $TRAIN_ARGS > "$LOGS/train_demo.log" 2>&1
stamp "kimi-demo: exit $?"
wait "$warmup"
stamp "warm-up evaluation of the shipped model: exit $?"

stamp "kimi-demo-draft: training for $DRAFT_MINUTES minutes, kimi-demo evaluated beside it"
timeout -k 10 "$(limit "$DRAFT_MINUTES" "$SLACK_SECONDS")" python3 scripts/train_demo.py --device "$DEVICE" --model demo-draft \
  --out "$WORK/kimi-demo-draft" --max-minutes "$DRAFT_MINUTES" --num-workers 3 $TRAIN_ARGS \
  > "$LOGS/train_demo_draft.log" 2>&1 &
draft=$!
if [ -f "$WORK/kimi-demo/config.json" ]; then
  (
    end=$(( $(date +%s) + EVAL_SECONDS ))
    timeout -k 5 $(( end - $(date +%s) )) python3 benchmarks/demo_eval.py --model "$WORK/kimi-demo" --device "$DEVICE" \
      --kv-cache-dtypes bf16 --kv-cache-memory-gib 8 --n "$EVAL_N" --kinds arithmetic,word_problem --passkey-lengths "" \
      --json "$LOGS/eval_arithmetic_cuda.json" > "$LOGS/eval_arithmetic_cuda.log" 2>&1
    echo "arithmetic eval exit $?" >> "$LOGS/eval_arithmetic_cuda.log"
    left=$(( end - $(date +%s) ))
    if [ "$left" -gt 20 ]; then
      timeout -k 5 "$left" python3 benchmarks/demo_eval.py --model "$WORK/kimi-demo" --device "$DEVICE" \
        --kv-cache-dtypes bf16 --kv-cache-memory-gib 8 --n 0 --passkey-lengths 16384,65536 --passkey-n 10,5 \
        --json "$LOGS/eval_passkey_cuda.json" > "$LOGS/eval_passkey_cuda.log" 2>&1
      echo "passkey eval exit $?" >> "$LOGS/eval_passkey_cuda.log"
    fi
  ) &
  evaluation=$!
  wait "$evaluation"
  stamp "evaluation done"
fi
wait "$draft"
stamp "kimi-demo-draft: exit $?"

for m in kimi-demo kimi-demo-draft; do
  if [ -f "$WORK/$m/config.json" ]; then
    tar -C "$WORK" -czf "$OUT/$m.tar.gz" "$m"
  fi
done
tar -C "$WORK" -czf "$OUT/logs.tar.gz" logs
ls -l "$OUT"
# a summary in the call's output: the runs' first and last steps, final teacher-forced evals, the GPU evaluation
for f in "$LOGS"/train_demo.log "$LOGS"/train_demo_draft.log; do
  echo "== $(basename "$f")"
  grep '"event": "step", "step": 5,' "$f" | cut -c1-400
  grep -E '"event": "(final_eval|done|oom)"' "$f" | cut -c1-900
  grep -v '^{' "$f" | tail -5
done
for f in "$LOGS"/warmup_shipped_model.log "$LOGS"/eval_*_cuda.log; do
  [ -f "$f" ] && { echo "== $(basename "$f")"; grep -v '^{' "$f" | tail -6; }
done
python3 - "$LOGS" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    for kv, res in json.loads(f.read_text())["by_cache"].items():
        replies = res.pop("passkey_replies", [])
        print(f.name, kv, json.dumps(res))
        print("  missed passkeys:", [r for r in replies if r["key"] not in r["reply"]][:6])
PY
stamp "done"
