"""The write-back writer: partial saves, uploads on several streams, the bounds, S3's back-off,
and the upload backlog that outlives the writer.

Over real tiers on disk: NVMe, and a second directory the store takes for the remote tier,
whose writes can be held (to keep uploads in flight together) or made to fail as an
unreachable S3 does (tests/store/engines/vllm/far_tier.py). The engine's caches are CPU
tensors in vLLM's CPU layout.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from store.engines.vllm.layout import EngineLayout
from store.engines.vllm.metadata import SaveSpec
from store.engines.vllm.paging import write_layer
from store.engines.vllm.stats import Counters
from store.engines.vllm.tenancy import TenantBook
from store.engines.vllm.writeback import WriteBack
from store.identity.keys import block_chain
from store.tiers.base import object_name
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S
from tests.store.engines.vllm.far_tier import FarDir
from tests.store.engines.vllm.worker_setup import EB, IDENT, KB, NB, D, H, L, cfg, expected, tokens

RATIO = KB // EB
LAYOUT = EngineLayout("cpu_vec", NB, H, EB, D, torch.bfloat16)
#: copied bytes of one kvwarm block (every layer)
BLOCK = L * RATIO * LAYOUT.block_bytes


def _caches(blocks: int) -> list[torch.Tensor]:
    """Engine caches whose blocks ``0 .. blocks * RATIO`` hold stored blocks ``0 .. blocks`` (expected's KV)."""
    caches = [torch.full((NB, H, EB, 2 * D), -3.0, dtype=torch.bfloat16) for _ in range(L)]
    for layer in range(L):
        k = torch.cat([expected(b)[layer][0] for b in range(blocks)], dim=1)
        v = torch.cat([expected(b)[layer][1] for b in range(blocks)], dim=1)
        write_layer(caches[layer], LAYOUT, list(range(blocks * RATIO)), k, v)
    return caches


def _writer(tmp_path: Path, *, remote: FarDir | None = None, max_bytes: int, streams: int = 4,
            s3_backoff_s: float = 3600.0) -> WriteBack:
    c = cfg()
    tiers = [LocalTier(tmp_path / "nvme", cap_bytes=1 << 30)] + ([remote] if remote is not None else [])
    return WriteBack(Store(tiers), TenantBook(c, "acme"), (IDENT, None), c.kv_cache.precision(), kv_block=KB,
                     ttl_s=3600.0, layout=LAYOUT, counters=Counters(), max_bytes=max_bytes, streams=streams,
                     s3_backoff_s=s3_backoff_s)


def _save(req: str, ids: list[int], blocks: int) -> SaveSpec:
    return SaveSpec(req, "acme", False, 0, tuple(ids[: blocks * KB]), tuple(range(blocks * RATIO)))


def _names(ids: list[int], blocks: int) -> list[str]:
    c = cfg()
    root = IDENT.key_root(c.kv_cache.precision(), KB, c.tenant("acme").salt)
    return [object_name("acme", b.key) for b in block_chain(root, ids)[:blocks]]


def _wait(cond, what: str) -> None:
    deadline = time.monotonic() + HANG_S  # a hang guard, not a measure of speed
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail(f"never happened: {what}")
        time.sleep(0.005)


def test_a_save_larger_than_the_queue_keeps_its_leading_blocks_and_drops_the_tail(tmp_path) -> None:
    caches, ids = _caches(5), tokens(5 * KB + 1, seed=11)
    writer = _writer(tmp_path, max_bytes=3 * BLOCK)
    try:
        assert writer.copy_out(_save("r", ids, 5), caches) == 3  # blocks 3 and 4 are the tail not queued
        assert writer.counters.totals()["write_back_dropped:queue_full"] == 2  # counted in kvwarm blocks
        assert writer.drain(HANG_S)
        assert writer.peak_bytes == 3 * BLOCK and writer.queued_bytes == 0
        names = _names(ids, 5)
        assert [writer.local.exists(n) for n in names] == [True, True, True, False, False]
        c = cfg()
        tenant, root = c.tenant("acme"), IDENT.key_root(c.kv_cache.precision(), KB, c.tenant("acme").salt)
        for b in range(3):  # the kept blocks are the prompt's first three, whole
            snap = writer.store.get(tenant, block_chain(root, ids)[b], root)
            assert snap is not None
            for layer in range(L):
                k, v = snap.layer(layer, torch.bfloat16)
                assert torch.equal(k, expected(b)[layer][0]) and torch.equal(v, expected(b)[layer][1])
        # a save that fits whole is queued whole; one that finds the queue full queues nothing
        assert writer.copy_out(_save("s", tokens(2 * KB, seed=12), 2), caches) is None
        writer.max_bytes = BLOCK - 1
        assert writer.copy_out(SaveSpec("t", "acme", False, 2, tuple(ids[: 4 * KB]), (4, 5, 6, 7)), caches) == 2
        assert writer.drain(HANG_S)
        totals = writer.counters.totals()
        assert totals["write_back_dropped:queue_full"] == 4 and totals["written_back_blocks"] == 5
    finally:
        writer.close()


def test_uploads_to_a_slow_remote_tier_run_on_several_streams_and_never_hold_up_nvme(tmp_path) -> None:
    far = FarDir(tmp_path / "far")
    far.held.clear()  # S3 is slow: no upload ends until the test says so
    caches = _caches(2)
    saves = [(f"r{i}", tokens(2 * KB, seed=100 + i)) for i in range(10)]
    writer = _writer(tmp_path, remote=far, max_bytes=6 * BLOCK, streams=3)
    assert writer.uploads is not None
    try:
        for req, ids in saves[:2]:
            assert writer.copy_out(_save(req, ids, 2), caches) is None
        _wait(lambda: far.inflight == 3, "three uploads in flight at once")
        # while they wait, the saves that come now are written to NVMe whole; their blocks wait in
        # the upload backlog
        for i, (req, ids) in enumerate(saves[2:], start=3):
            assert writer.copy_out(_save(req, ids, 2), caches) is None
            _wait(lambda i=i: writer.counters.totals().get("written_back_blocks", 0) == 2 * i, "its NVMe writes")
        assert writer.uploads.waiting() == 2 * len(saves)  # three in flight, every other one waiting
        assert writer.uploads.queued_bytes <= writer.max_bytes and writer.queued_bytes <= writer.max_bytes
        far.held.set()
        assert writer.drain(HANG_S)
        assert far.most == 3 and writer.uploads.peak_bytes <= writer.max_bytes
        totals = writer.counters.totals()
        assert "write_back_dropped:queue_full" not in totals and "upload_dropped:evicted" not in totals
        assert totals["written_back_uploads"] == 2 * len(saves) and writer.uploads.waiting() == 0
        for _, ids in saves:  # every block on NVMe, and in S3
            assert all(writer.local.exists(x) and far.exists(x) for x in _names(ids, 2))
    finally:
        far.held.set()
        writer.close()
    assert not any(t.is_alive() for t in threading.enumerate() if t.name.startswith("kvwarm-upload"))


def test_when_s3_fails_mid_run_blocks_wait_in_the_backlog_and_a_later_writer_uploads_them(tmp_path) -> None:
    far = FarDir(tmp_path / "far")
    caches = _caches(3)
    writer = _writer(tmp_path, remote=far, max_bytes=1 << 20, streams=2)
    first, second, third = tokens(3 * KB, seed=21), tokens(3 * KB, seed=22), tokens(3 * KB, seed=23)
    try:
        assert writer.copy_out(_save("a", first, 3), caches) is None and writer.drain(HANG_S)
        assert all(far.exists(n) for n in _names(first, 3))
        far.down = True
        asked = far.attempts
        assert writer.copy_out(_save("b", second, 3), caches) is None
        assert not writer.drain(HANG_S)  # S3 rests: what is left waits
        assert writer.uploads is not None and writer.uploads.resting()
        assert far.attempts - asked <= 2  # the uploads in flight when it failed; none after
        far.down = False
        asked = far.attempts
        assert writer.copy_out(_save("c", third, 3), caches) is None and not writer.drain(HANG_S)
        assert far.attempts == asked  # S3 rests for s3_backoff_s: not asked again yet
        for ids in (second, third):  # on NVMe, not in S3: waiting in the backlog
            names = _names(ids, 3)
            assert all(writer.local.exists(n) for n in names) and not any(far.exists(n) for n in names)
        assert writer.uploads.waiting() == 6
        totals = writer.counters.totals()
        assert totals["written_back_blocks"] == 9 and totals["written_back_uploads"] == 3
        assert not any(k.startswith(("write_back_dropped", "upload_dropped")) for k in totals)
    finally:
        writer.close()
    # the node restarts: its writer finds the backlog, and drains it once S3 answers
    again = _writer(tmp_path, remote=FarDir(tmp_path / "far"), max_bytes=1 << 20, streams=2, s3_backoff_s=0.0)
    try:
        assert again.drain(HANG_S)
        totals = again.counters.totals()
        assert totals["upload_backlog_resumed"] == 6 and totals["written_back_uploads"] == 6
        assert all(far.exists(n) for ids in (second, third) for n in _names(ids, 3))
    finally:
        again.close()


def test_close_writes_and_uploads_what_is_queued_then_stops_every_thread(tmp_path) -> None:
    far = FarDir(tmp_path / "far")
    far.held.clear()
    caches, ids = _caches(3), tokens(3 * KB, seed=31)
    writer = _writer(tmp_path, remote=far, max_bytes=1 << 20, streams=2)
    assert writer.copy_out(_save("r", ids, 3), caches) is None
    _wait(lambda: far.inflight == 2, "two uploads in flight")
    closing = threading.Thread(target=writer.close, kwargs={"timeout_s": HANG_S})
    closing.start()
    far.held.set()
    closing.join(HANG_S)
    assert not closing.is_alive()
    assert all(far.exists(n) for n in _names(ids, 3)) and writer.counters.totals()["written_back_uploads"] == 3
    assert writer.uploads is not None and not any(t.is_alive() for t in writer.uploads._threads)
    assert not writer._thread.is_alive()


def test_the_uploads_s3_client_is_built_with_the_writer_not_beside_the_first_requests(tmp_path, s3_url,
                                                                                      s3_config) -> None:
    # built on first use, botocore's models and the TLS contexts (tens of ms of Python) ran beside an engine's
    # first requests after a restart, on the upload threads, holding the interpreter meanwhile
    from store.tiers.s3 import S3Tier

    S3Tier(s3_url, s3_config, create_bucket=True)
    remote = S3Tier(s3_url, s3_config)
    assert remote.fs._s3 is None  # s3fs builds its client on first use
    c = cfg()
    w = WriteBack(Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30), remote]), TenantBook(c, "acme"),
                  (IDENT, None), c.kv_cache.precision(), kv_block=KB, ttl_s=3600.0, layout=LAYOUT, counters=Counters())
    try:
        assert remote.fs._s3 is not None
    finally:
        w.close()
