"""The scheduler role with a real S3 tier (SeaweedFS): background and waited copies, and S3 killed mid-run."""
from __future__ import annotations

import time
import uuid

import pytest

from tests.seaweedfs import SeaweedFS
from tests.store.engines.vllm.scheduler_fakes import KB, Req, config, role, store_prefix, tokens

SLACK_S = 10.0


@pytest.fixture
def own_s3(tmp_path, monkeypatch):
    monkeypatch.setenv("KVWARM_TEST_KEY", "test")
    monkeypatch.setenv("KVWARM_TEST_SECRET", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    server = SeaweedFS(workdir=str(tmp_path / "weed")).start()
    try:
        yield server
    finally:
        server.stop()


def ask_until(r, req, timeout_s: float = 60.0):
    """Ask as vLLM does, once per step, until the answer is not "ask again"."""
    deadline = time.monotonic() + timeout_s
    while True:
        n, _ = r.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        assert time.monotonic() < deadline, "the request waited past its timeout"
        time.sleep(0.02)


@pytest.mark.s3
def test_s3_hits_follow_fetch_mode_and_s3_killed_is_a_counted_miss(tmp_path, own_s3) -> None:
    s3 = {"endpoint_url": own_s3.endpoint, "access_key_env": "KVWARM_TEST_KEY", "secret_key_env": "KVWARM_TEST_SECRET",
          "op_timeout_s": 3, "connect_timeout_s": 1, "read_timeout_s": 2, "retries": 0}
    timeout = 8.0  # generous: the copy must land within it on a busy host
    url = f"s3://kvwarm-conn/{uuid.uuid4().hex[:8]}"
    p1, p2, p3 = (tokens(3 * KB + 1, seed=s) for s in (50, 51, 52))
    for ids in (p1, p2, p3):
        store_prefix(tmp_path, ids, url=f"file://{tmp_path}/writer,{url}", cfg=config(s3))

    bg = role(tmp_path / "bg", url=f"file://{tmp_path}/bg,{url}", cfg=config(s3))
    assert bg.get_num_new_matched_tokens(Req("a", p1), 0) == (0, False)  # answered now ...
    assert bg.stats()["misses:fetch_scheduled"] == 1
    deadline = time.monotonic() + 60
    while bg.get_num_new_matched_tokens(Req(f"c{time.monotonic()}", p1), 0)[0] == 0:  # ... and local next time
        assert time.monotonic() < deadline, "the background copy did not land"
        time.sleep(0.1)

    sync = role(tmp_path / "sync", url=f"file://{tmp_path}/sync,{url}", cfg=config(s3, fetch_mode="sync",
                                                                              sync_fetch_timeout_s=timeout), rate=100)
    t0 = time.monotonic()
    assert ask_until(sync, Req("s1", p2)) == 3 * KB  # waited for the copy, then loaded from NVMe
    assert time.monotonic() - t0 < timeout + SLACK_S

    own_s3.stop()  # S3 gone mid-run
    for r in (bg, sync):
        t0 = time.monotonic()
        assert ask_until(r, Req(f"k-{id(r)}", p3)) == 0  # only in S3: a miss, never an exception, never a hang
        assert time.monotonic() - t0 < timeout + SLACK_S
    assert ask_until(sync, Req("s2", p2)) == 3 * KB  # NVMe keeps serving
    misses = {k: v for k, v in sync.stats().items() if k.startswith("misses:")}
    assert set(misses) <= {"misses:fetch_timeout", "misses:store_unavailable"} and misses
    bg.close()
    sync.close()
