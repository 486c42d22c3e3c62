#!/usr/bin/env bash
# GPU check of the prefill issue (done-when 6): the prefill bench on CUDA with an
# 8B-shaped model initialised randomly in bf16 (32 layers, 8 KV heads, head dim 128)
# at 2k and 8k tokens, within 10 minutes. Needs a CUDA build of torch in $PY's env.
# The last line of bench/out/gpu_check.log is the JSON to copy into docs/benchmarks.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
mkdir -p bench/out
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')"
timeout 570 "$PY" bench/prefill_bench.py --shape 8b --device cuda --tokens 2048,8192 --reps 3 \
  2>&1 | tee bench/out/gpu_check.log
