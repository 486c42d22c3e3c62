# Two commands on a fresh machine: `make demo` and `make test`. Each installs what it
# needs into .venv first (idempotent: a stamp file records the install).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvwarm-installed
# CPU build of torch for CI and tests; GPU users install their own torch before `pip install kvwarm`.
TORCH  ?= torch==2.13.0

.PHONY: demo test install bench clean

$(STAMP): pyproject.toml setup.py store/kernels/_fp8gather.c
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[pipeline,test]"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m flows.demo --store file://$(CURDIR)/.kvwarm-demo

test: $(STAMP)
	$(PY) -m pytest -q

# Every bench, one at a time, as docs/benchmarks.md shows it (80 minutes on 2 busy cores), each writing
# bench/results/<bench>.json; then the page is made again from those records. The bench extra adds
# statsforecast. A test checks that these lines are the commands the page's records name.
bench: $(STAMP)
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) bench/store_bench.py --no-cold
	$(PY) bench/prefill_bench.py
	$(PY) bench/loader_bench.py --threads 1 --reps 3
	$(PY) bench/mining_bench.py
	$(PY) bench/forecast_bench.py
	$(PY) bench/replay_bench.py
	$(PY) bench/report.py

clean:
	rm -rf .kvwarm-demo .pytest_cache
