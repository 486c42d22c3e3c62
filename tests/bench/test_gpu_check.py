"""bench/gpu_check.sh is ready to run: valid bash, at most 10 minutes of limits, full CUDA graphs and async
scheduling named, and every bench it calls accepts the flags it passes (their own argument parsers, run here)."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import subprocess
from pathlib import Path

import pytest

from bench.lib.cuda_engine import ENGINE_ARGS_ENV, engine_defaults

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
BUDGET_S = 600


class Parsed(Exception):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__("parsed")
        self.namespace = args


def dry_run(**env: str) -> list[list[str]]:
    """The script's steps and skips as it prints them with GPU_CHECK_DRY_RUN=1."""
    full = {k: v for k, v in os.environ.items() if k not in ("KVWARM_ENGINE_PYTHON", "KVWARM_LMCACHE_PYTHON")}
    out = subprocess.run(["bash", str(SCRIPT)], env={**full, "GPU_CHECK_DRY_RUN": "1", "PY": "python", **env},
                         capture_output=True, text=True, check=True, timeout=60).stdout
    return [shlex.split(line) if line.startswith("STEP") else line.split(" ", 2) for line in out.splitlines()]


def parsed(module: str, argv: list[str], monkeypatch: pytest.MonkeyPatch) -> argparse.Namespace:
    """What ``module``'s own parser makes of ``argv`` (its ``main`` stopped right after parsing)."""
    real = argparse.ArgumentParser.parse_args

    def stop(self, args=None, namespace=None):
        raise Parsed(real(self, args, namespace))

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", stop)
    with pytest.raises(Parsed) as got:
        importlib.import_module(module).main(argv)
    return got.value.namespace


def test_the_script_is_valid_bash() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=60)


def test_every_step_fits_ten_minutes_and_the_engine_steps_need_the_engine_venv() -> None:
    lines = dry_run(KVWARM_ENGINE_PYTHON="/venv/bin/python")
    steps = {line[1]: line for line in lines if line[0] == "STEP"}
    assert set(steps) == {"build", "gpu-tests", "engine-2k", "engine-8k", "engine-tests", "writeback", "lmcache"}
    assert sum(int(s[2]) for s in steps.values()) <= BUDGET_S  # each limit with its kill grace
    alone = dry_run()
    assert {line[1] for line in alone if line[0] == "STEP"} == {"build", "gpu-tests"}
    assert ["SKIP", "engine"] in alone


def test_every_engine_runs_with_full_cuda_graphs_and_async_scheduling(monkeypatch: pytest.MonkeyPatch) -> None:
    env = [line for line in dry_run() if line[0] == "ENV"]
    assert env and env[0][1] == ENGINE_ARGS_ENV
    monkeypatch.setenv(ENGINE_ARGS_ENV, env[0][2])
    assert engine_defaults() == {"enforce_eager": False, "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"},
                                 "async_scheduling": True}
    monkeypatch.setenv(ENGINE_ARGS_ENV, "[1]")
    with pytest.raises(ValueError, match="JSON object"):
        engine_defaults()


def test_every_bench_accepts_the_flags_the_script_passes(monkeypatch: pytest.MonkeyPatch) -> None:
    benches = 0
    for line in dry_run(KVWARM_ENGINE_PYTHON="/venv/bin/python"):
        if line[0] != "STEP":
            continue
        command = line[4:]
        assert command[0] == "python"
        if command[1] == "-m":  # pytest: the files it names exist
            assert command[2] == "pytest"
            assert all((ROOT / a).is_file() for a in command[3:] if a.endswith(".py")), command
            continue
        if command[1] == "setup.py":
            continue
        script = command[1]
        assert script.startswith("bench/") and (ROOT / script).is_file()
        args = parsed(script.removesuffix(".py").replace("/", "."), command[2:], monkeypatch)
        monkeypatch.undo()
        assert args.device == "cuda" and args.cudagraph_mode == "FULL_AND_PIECEWISE" and args.async_scheduling
        assert args.shape in ("8b", "8b-mini")
        benches += 1
    assert benches == 4  # engine 2k, engine 8k, write-back, LMCache


def test_the_cuda_engine_arguments_name_the_graph_mode_and_async_scheduling(monkeypatch) -> None:
    args = parsed("bench.writeback_bench", ["--device", "cuda", "--shape", "8b", "--no-async-scheduling",
                                            "--cudagraph-mode", "PIECEWISE", "--gpu-memory-utilization", "0.85"],
                  monkeypatch)
    from bench.lib.cuda_engine import cuda_engine_args

    assert cuda_engine_args(args) == {"dtype": "bfloat16", "enforce_eager": False, "async_scheduling": False,
                                      "compilation_config": {"cudagraph_mode": "PIECEWISE"},
                                      "gpu_memory_utilization": 0.85}
    assert json.loads(json.dumps(cuda_engine_args(args))) == cuda_engine_args(args)  # goes to the engine as JSON
