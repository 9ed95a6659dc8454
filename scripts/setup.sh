#!/usr/bin/env bash
# Create .venv (if missing) and install kimiserve with its test dependencies into it.
# On a machine without CUDA it installs the CPU build of torch 2.13.0 first, so nothing pulls a
# multi-GB CUDA build; on a GPU machine an already-present torch (>= 2.9) is kept and the GPU
# extra (Triton, fla-core) is installed too.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
py=.venv/bin/python
if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    "$py" -m pip install -q "torch>=2.9"
  else
    "$py" -m pip install -q torch==2.13.0
  fi
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  "$py" -m pip install -q -e '.[test,gpu]'
else
  "$py" -m pip install -q -e '.[test]'
fi
