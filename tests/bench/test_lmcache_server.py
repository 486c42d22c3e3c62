"""LMCache's server launcher (bench/lib/lmcache_server.py): its command lines, without starting one."""
from __future__ import annotations

import json
import os

import pytest

from bench.lib import lmcache_server as lm


@pytest.fixture
def fake_python(tmp_path, monkeypatch):
    py = tmp_path / "python"
    py.write_text("#!/bin/sh\n")
    py.chmod(0o755)
    monkeypatch.setenv(lm.LMCACHE_ENV, str(py))
    return py


def test_missing_venv_says_how_to_build_it(tmp_path, monkeypatch):
    monkeypatch.setenv(lm.LMCACHE_ENV, str(tmp_path / "nope"))
    with pytest.raises(lm.LMCacheUnavailable, match="make bench"):
        lm.lmcache_python()


def test_every_listener_is_on_loopback_and_its_own_port(tmp_path, fake_python):
    cmd = lm.LMCacheServer(tmp_path, l2=lm.fs_l2(tmp_path / "l2")).command()
    assert cmd[0] == str(fake_python)
    args = dict(zip(cmd[::1], cmd[1:]))
    assert args["--host"] == "127.0.0.1" and args["--http-host"] == "127.0.0.1"
    ports = {args["--port"], args["--http-port"], args["--prometheus-port"]}
    assert len(ports) == 3 and "8080" not in ports and "9090" not in ports  # LMCache's fixed defaults
    assert args["--supported-transfer-mode"] == "auto"  # without it vLLM's worker hangs (STACK-NOTES)
    assert json.loads(args["--l2-adapter"]) == {"type": "fs", "base_path": str(tmp_path / "l2")}


def test_s3_adapter_is_addressed_by_virtual_host_on_loopback(tmp_path, fake_python):
    l2 = lm.s3_l2("http://127.0.0.1:8333", "kv")
    assert l2["s3_endpoint"] == f"kv.{lm.S3_DOMAIN}:8333" and l2["disable_tls"] is True
    if os.geteuid() != 0:
        with pytest.raises(lm.LMCacheUnavailable, match="root"):
            lm.LMCacheServer(tmp_path, l2=l2).command()
        return
    cmd = lm.LMCacheServer(tmp_path, l2=l2).command()
    assert cmd[:2] == ["unshare", "-m"]
    hosts = (tmp_path / "hosts").read_text().split("\n")
    assert f"127.0.0.1 kv.{lm.S3_DOMAIN}" in hosts
    assert all(line.startswith("127.0.0.1 ") for line in hosts if line)
