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
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:?set OUT to the folder the device returns}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD
fi
common="--device cuda --warmup-steps 20 --fake-quant-from 0 --num-workers 4 --eval-every-minutes 1.5 --export-every-minutes 9"
python3 scripts/train_demo.py $common --model demo --init-from kimiserve/presets/kimi-demo --mixture edit=0.5 --lr 1e-3 \
  --sparse-from 0.4 --max-minutes 3.3 --out $OUT/A > $OUT/train_A.log 2>&1 &
python3 scripts/train_demo.py $common --model demo-draft --init-from kimiserve/presets/kimi-demo-draft --mixture edit=0.5 \
  --lr 1e-3 --sparse-from 0.4 --max-minutes 3.3 --out $OUT/kimi-demo-draft > $OUT/train_draft.log 2>&1 &
wait
python3 scripts/train_demo.py $common --num-workers 6 --eval-every-minutes 1.4 --model demo --init-from $OUT/A \
  --mixture edit=0.6 --lr 1e-3 --sparse-from 0 --max-minutes 4.2 --out $OUT/kimi-demo > $OUT/train_A2.log 2>&1
