#!/usr/bin/env bash
# The session-12 fine-tune that taught kimi-demo and kimi-demo-draft file edits (the corpus's `edit` kind: a
# settings file in the prompt, one change, the whole file written back), as it ran on one H200 in two device calls.
# Both start from the models shipped before (recipe v2's kimi-demo v3, the 2-layer draft v4) and keep training
# on every other kind at its usual share, so the earlier skills stay.
#
#   OUT=/path bash scripts/device/finetune_edits.sh        (from the repository root)
#
# Call 1 ran three fine-tunes at once (3.3 minutes each, sharing the GPU: the target made 163 steps, the draft
# 838; the third, the target at --mixture edit=0.35 --lr 2e-3, was not kept and is left out here); call 2 continued the target alone (4.2 minutes, 526 steps). The shipped kimi-demo is call 2's output
# (A2), the shipped kimi-demo-draft call 1's draft (C). Wall-clock budgets, so step counts vary with the GPU.
# Minutes can be changed by environment (MINUTES_1 3.3, MINUTES_2 4.2); DEVICE (cuda) and TRAIN_ARGS (more
# train_demo.py options for every run) exist for a CPU rehearsal:
#   OUT=/tmp/o DEVICE=cpu MINUTES_1=0.1 MINUTES_2=0.1 TRAIN_ARGS="--tokens-per-step 2048 --num-workers 0 \
#     --eval-examples 4" bash scripts/device/finetune_edits.sh
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the device returns}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
M1=${MINUTES_1:-3.3}
M2=${MINUTES_2:-4.2}
common="--device ${DEVICE:-cuda} --warmup-steps 20 --fake-quant-from 0 --eval-every-minutes 1.5 --export-every-minutes 9"
python3 scripts/train_demo.py $common --num-workers 4 --model demo --init-from kimiserve/presets/kimi-demo --mixture edit=0.5 \
  --lr 1e-3 --sparse-from 0.4 --max-minutes $M1 ${TRAIN_ARGS:-} --out $OUT/A > $OUT/train_A.log 2>&1 &
python3 scripts/train_demo.py $common --num-workers 4 --model demo-draft --init-from kimiserve/presets/kimi-demo-draft \
  --mixture edit=0.5 --lr 1e-3 --sparse-from 0.4 --max-minutes $M1 ${TRAIN_ARGS:-} --out $OUT/kimi-demo-draft \
  > $OUT/train_draft.log 2>&1 &
wait
python3 scripts/train_demo.py $common --num-workers 6 --eval-every-minutes 1.4 --model demo --init-from $OUT/A \
  --mixture edit=0.6 --lr 1e-3 --sparse-from 0 --max-minutes $M2 ${TRAIN_ARGS:-} --out $OUT/kimi-demo > $OUT/train_A2.log 2>&1
for f in train_A train_draft train_A2; do grep -E '"final_eval"' $OUT/$f.log | cut -c1-300; done
