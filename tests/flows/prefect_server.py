"""A real Prefect server and process worker on 127.0.0.1 for integration tests.

``prefect server start`` runs from this venv's ``prefect`` executable with its own
``PREFECT_HOME`` and SQLite database in a temporary directory, analytics off and no
background services (no cron scheduler: the deployments' cron schedules would
otherwise create runs with the production parameters in prefect.yaml). Every process
is started in its own session and stopped by its process group id: SIGTERM, then
SIGINT (a worker ignores one SIGTERM), then SIGKILL after a grace period
(shared/STACK-NOTES.md).

Nothing may reach beyond 127.0.0.1: the child processes get HTTP(S) proxies that
point at a closed loopback port, with only loopback exempt, so any attempt to reach
the internet (the server's fetch of Prefect's collection registry, for one) fails at
once on this machine instead of leaving it.

The fixtures that start them (one server for the package, lent to each module) are in
tests/flows/conftest.py.
"""
from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
#: the venv's prefect executable (next to the interpreter running the tests)
PREFECT = Path(sys.executable).parent / "prefect"
#: a loopback port nothing listens on: the proxy every outbound HTTP request is sent to
DEAD_PROXY = "http://127.0.0.1:9"
LOOPBACK_ONLY = {name: DEAD_PROXY for name in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "http_proxy", "https_proxy",
                                                "all_proxy")}
LOOPBACK_ONLY.update({"NO_PROXY": "127.0.0.1,localhost", "no_proxy": "127.0.0.1,localhost"})
POOLS = {"kvwarm-cpu": "process", "kvwarm-gpu": "process"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Managed:
    """A child process started in its own session, its output in a log file; stopped by process group."""

    def __init__(self, name: str, args: Sequence[str], env: dict[str, str], log: Path, cwd: Path) -> None:
        self.name, self.log = name, log
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(list(args), env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        self.pid = self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def tail(self, chars: int = 6000) -> str:
        try:
            text = self.log.read_text(errors="replace")
        except OSError as exc:
            return f"<{self.name} log {self.log} unreadable: {exc}>"
        return text[-chars:]

    def stop(self, grace_s: float = 5.0) -> None:
        """SIGTERM, SIGINT, then SIGKILL to the process group; waits for the leader; idempotent."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        # The leader may be gone while its children (a worker's flow run, the server's
        # subprocesses) still hold the group: kill whatever is left of it.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)


class PrefectServer:
    """``prefect server start`` on a free loopback port, its state under ``root``.

    Use :meth:`start` and :meth:`stop` (the fixtures do), :meth:`cli` to run the
    ``prefect`` CLI against it, :meth:`start_worker` for a process worker and
    :meth:`api` to point this process's Prefect client at it.
    """

    def __init__(self, root: Path) -> None:
        if not PREFECT.exists():
            raise RuntimeError(f"{PREFECT} is missing: install the pipeline extra (pip install -e '.[pipeline]')")
        self.root = root
        self.home = root / "prefect-home"
        self.home.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.server: Managed | None = None
        self.workers: list[Managed] = []

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/api"

    def env(self, **extra: str) -> dict[str, str]:
        """The environment of every child: this repo's venv, an isolated Prefect home, loopback only."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env.update(LOOPBACK_ONLY)
        env.update({
            "PREFECT_HOME": str(self.home),
            "PREFECT_PROFILES_PATH": str(self.home / "profiles.toml"),
            "PREFECT_API_URL": self.api_url,
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.root / 'prefect.db'}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_UI_ENABLED": "false",
            "PREFECT_LOGGING_LEVEL": "INFO",
            "PYTHONUNBUFFERED": "1",
        })
        env.update(extra)
        return env

    # -- lifecycle ------------------------------------------------------------
    def start(self, timeout_s: float = 120.0, attempts: int = 2) -> "PrefectServer":
        """Start the server and wait until ``/api/health`` answers; retries once on a fresh port."""
        for attempt in range(1, attempts + 1):
            log = self.root / f"server-{attempt}.log"
            self.server = Managed("server", [str(PREFECT), "server", "start", "--host", "127.0.0.1", "--port",
                                             str(self.port), "--no-services"], self.env(), log, self.root)
            if self._wait_healthy(timeout_s):
                return self
            tail = self.server.tail()
            self.server.stop()
            if attempt == attempts:
                raise RuntimeError(f"prefect server did not answer {self.api_url}/health within {timeout_s} s; "
                                   f"its log ends:\n{tail}")
            self.port = free_port()
        raise AssertionError("unreachable")

    def _wait_healthy(self, timeout_s: float) -> bool:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # loopback, never via a proxy
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.server is not None
            if not self.server.alive():
                return False
            with contextlib.suppress(OSError):
                with opener.open(f"{self.api_url}/health", timeout=2) as r:
                    if r.status == 200:
                        return True
            time.sleep(0.3)
        return False

    def stop_workers(self) -> None:
        """Stop every worker started here (each by process group)."""
        while self.workers:
            self.workers.pop().stop()

    def stop(self) -> None:
        """Stop every worker, then the server (each by process group)."""
        self.stop_workers()
        if self.server is not None:
            self.server.stop()
            self.server = None

    def reset(self) -> None:
        """Stop the workers and delete every flow run: what the next user finds is a server with no worker
        and no run (the pools and deployments stay; :meth:`create_pools` and ``prefect deploy`` overwrite them)."""
        from prefect import get_client

        self.stop_workers()
        with self.api(), get_client(sync_client=True) as client:
            while runs := client.read_flow_runs(limit=200):
                for run in runs:
                    client.delete_flow_run(run.id)

    # -- CLI, workers, client ------------------------------------------------------
    def create_pools(self) -> None:
        """The work pools prefect.yaml names (:data:`POOLS`), with the CLI; an existing one is overwritten."""
        self.cli_all([["work-pool", "create", name, "--type", kind, "--overwrite"] for name, kind in POOLS.items()])

    def cli(self, *args: str, timeout_s: float = 120.0, **extra_env: str) -> str:
        """Run ``prefect ARGS`` against this server from the repository root; returns its output.

        Raises AssertionError with the output when it fails.
        """
        try:
            done = subprocess.run([str(PREFECT), *args], env=self.env(**extra_env), cwd=ROOT, capture_output=True,
                                  text=True, timeout=timeout_s, stdin=subprocess.DEVNULL, start_new_session=True)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"prefect {' '.join(args)} ran past {timeout_s} s: {exc.output}") from None
        out = done.stdout + done.stderr
        if done.returncode != 0:
            raise AssertionError(f"prefect {' '.join(args)} exited {done.returncode}:\n{out[-6000:]}")
        return out

    def cli_all(self, commands: Sequence[Sequence[str]], timeout_s: float = 120.0, **extra_env: str) -> None:
        """Run several independent ``prefect`` commands side by side; fail with the output of any that fails."""
        procs = [(c, subprocess.Popen([str(PREFECT), *c], env=self.env(**extra_env), cwd=ROOT, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True)) for c in commands]
        failed = []
        for c, p in procs:
            try:
                out, _ = p.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
                failed.append(f"prefect {' '.join(c)} ran past {timeout_s} s:\n{out[-3000:]}")
                continue
            if p.returncode != 0:
                failed.append(f"prefect {' '.join(c)} exited {p.returncode}:\n{out[-3000:]}")
        if failed:
            raise AssertionError("\n".join(failed))

    def start_worker(self, pool: str, *, name: str | None = None, args: Sequence[str] = (),
                     **extra_env: str) -> Managed:
        """``prefect worker start --pool POOL [ARGS]`` from a scratch directory (the deployment's pull step must
        bring the flow's code); polls every second. ``name`` tells several workers of a pool apart (their
        log files and directories). Stopped by :meth:`stop`."""
        label = name or pool
        cwd = self.root / f"worker-{label}"
        cwd.mkdir(exist_ok=True)
        named = ["--name", name] if name else []
        worker = Managed(f"worker {label}", [str(PREFECT), "worker", "start", "--pool", pool, *named, *args],
                         self.env(PREFECT_WORKER_QUERY_SECONDS="1", PREFECT_WORKER_HEARTBEAT_SECONDS="5",
                                  **extra_env), self.root / f"worker-{label}.log", cwd)
        self.workers.append(worker)
        return worker

    @contextlib.contextmanager
    def api(self) -> Iterator[None]:
        """Point this process's Prefect client at the server for the duration of the block."""
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: self.api_url}):
            yield

    def wait_for_run(self, flow_run_id: object, timeout_s: float = 60.0, poll_s: float = 0.5):
        """Poll the flow run until its state is final or ``timeout_s`` passes; returns the last flow run read."""
        from prefect import get_client

        deadline = time.monotonic() + timeout_s
        with self.api(), get_client(sync_client=True) as client:
            while True:
                run = client.read_flow_run(flow_run_id)
                if (run.state is not None and run.state.is_final()) or time.monotonic() > deadline:
                    return run
                time.sleep(poll_s)
