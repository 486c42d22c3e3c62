"""A lookup's fetch of a chain from the remote tier: its GETs run at once, its blocks land in prefix order.

Over two directories on disk, the second taken by the store for a remote tier whose reads
a test can hold, reorder, fail or leave a hole in; the NVMe tier in front records the
order its blocks are written in. The waits are hang guards, never measures of speed.
"""
from __future__ import annotations

import concurrent.futures as cf
import threading
import time

from store.errors import StoreUnavailable
from store.identity.keys import block_chain
from store.miss import MissReason
from store.serving.fetch import RemoteFetcher, Scope
from store.serving.metrics import LoaderMetrics
from store.tiers.local import LocalTier
from store.tiers.store import Store
from tests.hang_guard import HANG_S, returns
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16


class Nvme(LocalTier):
    """The local tier, recording the names written, in order."""

    def __init__(self, root) -> None:
        super().__init__(root, cap_bytes=1 << 30)
        self.written: list[str] = []

    def write(self, name, data, *, expires_at):  # type: ignore[no-untyped-def]
        ok = super().write(name, data, expires_at=expires_at)
        self.written.append(name)
        return ok


class Far(LocalTier):
    """A directory the store treats as a remote tier. ``hold(name)`` runs before each read
    (it may wait, or raise); every read is recorded, and the most in flight at once."""

    remote = True
    kind = "far"

    def __init__(self, root, hold=None) -> None:
        super().__init__(root, cap_bytes=1 << 30)
        self.hold = hold
        self.names: list[str] = []
        self.inflight = self.most = 0
        self._lock = threading.Lock()

    def read(self, name, *, readahead=False):  # type: ignore[no-untyped-def]
        with self._lock:
            self.names.append(name)
            self.inflight += 1
            self.most = max(self.most, self.inflight)
        try:
            if self.hold is not None:
                self.hold(name)
            return super().read(name, readahead=readahead)
        finally:
            with self._lock:
                self.inflight -= 1


def setup(tmp_path, n_blocks: int, *, hold=None, gets: int = 8):
    cfg = config(BS, "bf16")
    ids = prompt(n_blocks * BS, seed=3)
    writer = Store([LocalTier(tmp_path / "far", cap_bytes=1 << 30)])
    synthetic_prefix(writer, cfg, ids, layers=1, heads=1, head_dim=8)
    writer.close()
    nvme, far = Nvme(tmp_path / "nvme"), Far(tmp_path / "far", hold)
    store = Store([nvme, far])
    ex = cf.ThreadPoolExecutor(1)
    fetcher = RemoteFetcher(store, ACME, LoaderMetrics(store=store.stats), ex, timeout_s=HANG_S, backoff_s=3600,
                            gets=gets)
    root = TINY.key_root(cfg.kv_cache.precision(), BS, ACME.salt)
    scope = Scope(root, "acme")
    chain = block_chain(root, ids)
    assert len(chain) == n_blocks
    return fetcher, store, scope, chain, ex


def settle(fetcher, store, ex) -> None:
    """Wait for every GET thread (those past a chain's end included), then close."""
    fetcher.close()
    fetcher._gets.shutdown(wait=True)
    ex.shutdown()
    assert fetcher._copying == {}  # every claimed block was released, the discarded ones too
    store.close()


def test_gets_completing_last_first_still_land_in_prefix_order(tmp_path):
    """Four GETs in flight at once; each waits until every later block's GET has returned
    (the chain's last block comes back first): NVMe is still written block 0, 1, 2, 3."""
    done: set[int] = set()
    cond = threading.Condition()
    names: list[str] = []
    together = threading.Barrier(4, timeout=HANG_S)

    def hold(name: str) -> None:
        pos = names.index(name)
        together.wait()  # all four in flight at once (a hang guard breaks it, and the test fails)
        with cond:
            assert cond.wait_for(lambda: all(p in done for p in range(pos + 1, len(names))), HANG_S)
        with cond:
            done.add(pos)
            cond.notify_all()

    fetcher, store, scope, chain, ex = setup(tmp_path, 4, hold=hold, gets=4)
    names.extend(scope.names(chain))
    got = returns(fetcher.fetch_chain, chain, scope)
    assert got == (4, None)
    far = store.tiers[1]
    assert far.most == 4  # all four were asked at once
    assert store.tiers[0].written == names  # and landed in prefix order whatever order they came back in
    assert fetcher.metrics.as_dict()["prefetch_fetched"] == 4
    settle(fetcher, store, ex)


def test_a_hole_ends_the_chain_and_nothing_past_it_is_kept(tmp_path):
    fetcher, store, scope, chain, ex = setup(tmp_path, 6, gets=8)
    names = scope.names(chain)
    assert store.tiers[1].delete(names[2])  # S3 lacks the third block
    got = returns(fetcher.copy_chain, chain, scope)
    assert (got.count, got.fetched, got.present, got.reason) == (2, 2, 0, None)
    assert fetcher.metrics.as_dict()["prefetch_fetched"] == 2  # the GETs past the hole are not counted
    settle(fetcher, store, ex)
    assert store.tiers[0].written == names[:2]  # blocks 3..5 were read (at once) but never written
    assert sorted(e.name for e in store.tiers[0].entries()) == sorted(names[:2])


def test_one_get_at_a_time_reads_nothing_past_the_hole(tmp_path):
    fetcher, store, scope, chain, ex = setup(tmp_path, 5, gets=8)
    names = scope.names(chain)
    store.tiers[1].delete(names[1])
    got = returns(fetcher.copy_chain, chain, scope, gets=1)  # as a prefetch stream copies
    assert (got.count, got.fetched) == (1, 1)
    assert store.tiers[1].names == names[:2] and store.tiers[1].most == 1
    settle(fetcher, store, ex)


def test_s3_failing_mid_chain_backs_off_and_lands_only_the_blocks_before(tmp_path):
    bad: set[str] = set()

    def hold(name: str) -> None:
        if name in bad:
            raise StoreUnavailable(f"S3 tier: GET {name} failed (the test's)")

    fetcher, store, scope, chain, ex = setup(tmp_path, 6, hold=hold, gets=3)
    names = scope.names(chain)
    bad.add(names[2])
    got = returns(fetcher.copy_chain, chain, scope)
    assert (got.count, got.fetched, got.reason) == (2, 2, MissReason.STORE_UNAVAILABLE)
    assert not fetcher.usable()  # in its back-off
    settle(fetcher, store, ex)
    assert store.tiers[0].written == names[:2]
    assert len(store.tiers[1].names) <= 2 + 3  # the two landed, and at most one window around the failure


def test_a_stop_lands_nothing_more_and_blocks_present_are_counted(tmp_path):
    fetcher, store, scope, chain, ex = setup(tmp_path, 5, gets=4)
    names = scope.names(chain)
    assert returns(fetcher.copy_chain, chain[:2], scope).count == 2  # the head is in NVMe already
    asked = iter([False, False, False, True])  # three blocks, then a stop
    got = returns(fetcher.copy_chain, chain, scope, stopped=lambda: next(asked))
    assert (got.count, got.present, got.fetched) == (3, 2, 1)
    settle(fetcher, store, ex)
    assert store.tiers[0].written == names[:3]


def test_two_fetches_of_one_chain_at_once_read_each_block_once(tmp_path):
    gate = threading.Barrier(2, timeout=HANG_S)
    first: list[str] = []

    def hold(name: str) -> None:
        with lock:
            lead = not first
            first.append(name)
        if lead or len(first) == 2:  # the first GET waits until a second one is in flight: the fetches overlap
            gate.wait()

    lock = threading.Lock()
    fetcher, store, scope, chain, ex = setup(tmp_path, 6, hold=hold, gets=3)
    with cf.ThreadPoolExecutor(2) as two:
        a = two.submit(fetcher.fetch_chain, chain, scope)
        b = two.submit(fetcher.fetch_chain, chain, scope)
        assert a.result(HANG_S) == (6, None) and b.result(HANG_S) == (6, None)
    names = scope.names(chain)
    assert sorted(store.tiers[1].names) == sorted(names)  # each block read once, by one fetch or the other
    settle(fetcher, store, ex)
    assert store.tiers[0].written == names


def test_a_closed_fetcher_asks_nothing(tmp_path):
    fetcher, store, scope, chain, ex = setup(tmp_path, 3)
    fetcher.close()
    got = returns(fetcher.copy_chain, chain, scope)
    assert got.count == 0 and store.tiers[1].names == [] and store.tiers[0].written == []
    settle(fetcher, store, ex)


def test_closing_while_a_chain_waits_on_its_gets_ends_it_without_an_error(tmp_path):
    """One GET thread: the chain's GETs ahead queue behind the first; a close cancels them and
    the copy ends where it was, landing nothing after (no exception reaches the caller)."""
    release = threading.Event()

    def hold(name: str) -> None:
        assert release.wait(HANG_S)

    cfg_fetcher, store, scope, chain, ex = setup(tmp_path, 4, hold=hold, gets=4)
    fetcher = RemoteFetcher(store, ACME, LoaderMetrics(store=store.stats), ex, timeout_s=HANG_S, backoff_s=3600,
                            gets=4, get_threads=1)
    cfg_fetcher.close()
    with cf.ThreadPoolExecutor(1) as one:
        fut = one.submit(fetcher.copy_chain, chain, scope)
        far = store.tiers[1]
        deadline = time.monotonic() + HANG_S  # a hang guard
        while far.inflight < 2:  # the first queued GET runs, the chain's own block on its thread
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fetcher.close()  # the two GETs still queued are cancelled
        release.set()
        got = fut.result(HANG_S)
    assert got.reason is None and got.count <= 2
    assert store.tiers[0].written == scope.names(chain)[:got.count]
    settle(fetcher, store, ex)
