"""The tiered Store over [LocalTier, S3Tier] when the S3 tier is down or hanging, each test on a
SeaweedFS server of its own: NVMe keeps serving, and every S3 call fails within the deadline.
"""
from __future__ import annotations

import os
import signal
import time

import pytest

from store.config import S3Config
from store.errors import StoreUnavailable
from store.tiers.local import LocalTier
from store.tiers.s3 import S3Tier
from store.tiers.store import Probe, Store
from tests.hang_guard import HANG_S, returns
from tests.seaweedfs import SeaweedFS
from tests.store.factories import ACME
from tests.store.tiers.s3_nodes import assert_same, chain_of, node

pytestmark = pytest.mark.s3

OUTAGE_BUCKET = "kvwarm-outage"


@pytest.fixture
def dedicated(s3_credentials):
    """A SeaweedFS of this test's own (the session server is never touched), with a
    short hard deadline and a read timeout longer than it, so the deadline is what bounds."""
    import s3fs

    server = SeaweedFS().start()
    try:
        fs = s3fs.S3FileSystem(key="test", secret="test", client_kwargs={"endpoint_url": server.endpoint},
                               skip_instance_cache=True)
        fs.mkdir(OUTAGE_BUCKET)
        fs.pipe(f"{OUTAGE_BUCKET}/warm", b"x")  # grows the bucket's volumes before the calls under test
        # our own server answered (not another one that raced us for the port)
        assert server.proc.poll() is None, f"SeaweedFS exited; see {server.dir / 'weed.log'}"
        cfg = S3Config(endpoint_url=server.endpoint, op_timeout_s=4, connect_timeout_s=1, read_timeout_s=60,
                       retries=2, **s3_credentials)
        yield server, cfg
    finally:
        if server.proc is not None:
            try:
                os.killpg(server.proc.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


def outage_node(tmp_path, url: str, cfg: S3Config) -> tuple[Store, LocalTier, S3Tier]:
    """A node for an outage test, its S3 calls under a roomy deadline until the test sets ``cfg``'s.

    The calls that set a test up (the bucket, the puts, a first probe) go to a server that
    is up, only slow on a loaded machine: the short deadline under test is for the outage.
    """
    return node(tmp_path, "a", url, cfg.model_copy(update={"op_timeout_s": 120.0}))


def s3_requests(monkeypatch, s3: S3Tier) -> list[str]:
    """What each request ``s3`` makes from now on was for (``GET <name>``, ``probe of 4 blocks``...)."""
    made: list[str] = []
    real = s3._call

    def counted(coro, what):  # type: ignore[no-untyped-def]
        made.append(what)
        return real(coro, what)

    monkeypatch.setattr(s3, "_call", counted)
    return made


def assert_unavailable(url: str, fn, *args, **kwargs) -> StoreUnavailable:
    """``fn(*args, **kwargs)`` raises StoreUnavailable naming ``url`` (and does not hang)."""
    with pytest.raises(StoreUnavailable) as err:
        returns(fn, *args, **kwargs)
    assert url in str(err.value)
    return err.value


def test_s3_down_nvme_keeps_serving_and_s3_calls_fail_fast(tmp_path, dedicated, monkeypatch):
    server, cfg = dedicated
    url = f"s3://{OUTAGE_BUCKET}/down"
    store, local, s3 = outage_node(tmp_path, url, cfg)
    root, chain, snaps, names = chain_of(ACME, 4)
    for s in snaps:
        store.put(ACME, s)
    for n in names[2:]:
        local.delete(n)  # blocks 2 and 3 now live only in S3
    assert store.probe(ACME, chain, root) == Probe(4, "s3")
    requests = s3_requests(monkeypatch, s3)
    s3.options = cfg  # the deadline under test

    server.stop()

    for b, s in zip(chain[:2], snaps[:2]):
        assert_same(returns(store.get, ACME, b, root), s)
    assert requests == []  # served from NVMe: never waited on S3
    err = assert_unavailable(url, store.get, ACME, chain[2], root)
    assert store.stats["unavailable"] >= 1
    assert not local.exists(names[2])
    assert "GET" in str(err)

    assert_unavailable(url, s3.exists, names[0])
    assert_unavailable(url, s3.probe, names)
    assert_unavailable(url, s3.write, names[0], snaps[0], expires_at=0)

    before = store.stats["unavailable"]
    probe = returns(store.probe, ACME, chain, root)
    assert probe == Probe(2, "nvme", ("s3",))  # degrades to the local count instead of raising, and says why
    assert store.stats["unavailable"] == before + 1


def wait_stopped(pid: int, timeout_s: float = HANG_S) -> None:
    """Wait until every thread of ``pid`` is stopped (SIGSTOP takes effect asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = set()
        for task in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{task}/stat") as f:
                    states.add(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass
        if states <= {"T", "t"}:
            return
        assert time.monotonic() < deadline, f"server {pid} did not stop: thread states {states}"
        time.sleep(0.05)


def test_s3_hanging_fails_within_the_deadline(tmp_path, dedicated, monkeypatch):
    server, cfg = dedicated
    url = f"s3://{OUTAGE_BUCKET}/hang"
    store, local, s3 = outage_node(tmp_path, url, cfg)
    roomy = s3.options
    root, chain, snaps, names = chain_of(ACME, 2)
    for s in snaps:
        store.put(ACME, s)
    local.delete(names[1])  # block 1 only in S3
    requests = s3_requests(monkeypatch, s3)
    s3.options = cfg  # the deadline under test

    os.killpg(server.proc.pid, signal.SIGSTOP)  # connections are accepted, never answered
    try:
        wait_stopped(server.proc.pid)
        assert_same(returns(store.get, ACME, chain[0], root), snaps[0])
        assert requests == []  # served from NVMe: never waited on S3
        # Nothing answers and the read timeout (60 s) is longer than the deadline (4 s):
        # each call that does end, ends by the deadline.
        deadline = f"did not finish within {cfg.op_timeout_s:g} s"
        err = assert_unavailable(url, store.get, ACME, chain[1], root)
        assert deadline in str(err)  # the hard deadline, not a refused connection
        before = store.stats["unavailable"]
        assert returns(store.probe, ACME, chain, root) == Probe(1, "nvme", ("s3",))
        assert store.stats["unavailable"] == before + 1  # the S3 probe ran into the deadline, and was counted
        assert deadline in str(assert_unavailable(url, s3.write, names[0], snaps[0], expires_at=0))
    finally:
        os.killpg(server.proc.pid, signal.SIGCONT)

    # the endpoint is back: the same tier and store work again (no poisoned client), given
    # the time a server just woken up may take to answer on a loaded machine
    s3.options = roomy
    assert s3.exists(names[1])
    assert_same(store.get(ACME, chain[1], root), snaps[1])
    assert store.stats["read_through"] == 1
