"""A loader's prefetch: which plan entries become block chains, and the streams that copy them.

The streams are tested over two directories on disk, the second taken by the store for a
remote tier (its reads counted, and held where a test needs reads in flight together),
then through the loader against a real S3 (SeaweedFS).
"""
from __future__ import annotations

import collections
import concurrent.futures as cf
import hashlib
import threading
import time
import uuid

from store.config import parse_config
from store.format.precision import Precision
from store.identity.keys import KeyRoot, block_chain
from store.identity.tenant import Tenant
from store.plan import Plan, PlanEntry, plan_from_prefixes
from store.serving.fetch import RemoteFetcher, Scope
from store.serving.loader import KVLoader
from store.serving.metrics import LoaderMetrics
from store.serving.prefetch import Prefetcher, plan_chains
from store.tiers.local import LocalTier
from store.tiers.s3 import S3Tier
from store.tiers.store import Store
from tests.hang_guard import HANG_S, returns
from tests.store.pool_workers import ACME, TINY, config, prompt, synthetic_prefix

BS = 16


def test_prefill_and_retain_entries_are_prefetched_and_hash_id_entries_are_skipped() -> None:
    p = Precision()
    root = KeyRoot("model", "rev", p.kv_dtype, p.scheme_id(), 4, Tenant.derive("acme").salt)
    scope = Scope(root, "acme")
    plan = Plan(entries=(PlanEntry("acme", token_ids=tuple(range(8)), score=2.0),
                         PlanEntry("acme", token_ids=tuple(range(12)), action="retain", score=1.0),
                         PlanEntry("acme", hash_ids=(1, 2), action="retain"),
                         PlanEntry("acme", text="no tokenizer given"),
                         PlanEntry("other", token_ids=(1, 2, 3, 4))))
    chains, skipped = plan_chains(plan, scope, {"acme": scope}, None)
    assert [(len(c), score) for c, score, _ in chains] == [(2, 2.0), (3, 1.0)]
    assert skipped == 3
    chains, skipped = plan_chains(plan, scope, {"acme": scope}, lambda text: list(range(4)))
    assert len(chains) == 3 and skipped == 2  # with a tokenizer the text entry is keyed; hash ids never


# -- the streams, over tiers on disk (a directory the store takes for a remote tier) ----------

class Gate:
    """Counts the reads in flight in a tier. A read waits until ``hold_until`` are in flight
    together (or the test opens the gate); the wait's bound is a hang guard, never a measure of speed."""

    def __init__(self, hold_until: int = 0) -> None:
        self.hold_until = hold_until
        self.inflight = self.most = 0
        self.names: list[str] = []
        self.open = threading.Event()
        if not hold_until:
            self.open.set()
        self._lock = threading.Lock()

    def __enter__(self) -> None:
        with self._lock:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            if self.inflight >= self.hold_until:
                self.open.set()
        if not self.open.wait(HANG_S):
            self.open.set()  # never came: let the rest through, and the test fail on `most`

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            self.inflight -= 1


class FarDir(LocalTier):
    """A directory that the store treats as a remote tier; its reads go through a :class:`Gate`."""

    remote = True
    kind = "far"

    def __init__(self, root, gate: Gate) -> None:
        super().__init__(root, cap_bytes=1 << 30)
        self.gate = gate

    def read(self, name, *, readahead=False):
        with self.gate._lock:
            self.gate.names.append(name)
        with self.gate:
            return super().read(name, readahead=readahead)


def far_setup(tmp_path, prefixes, gate: Gate, streams: int):
    """Prefixes written to the far directory; a Prefetcher over an empty NVMe tier in front of it."""
    cfg = config(BS, "bf16")
    writer = Store([LocalTier(tmp_path / "far", cap_bytes=1 << 30)])
    for ids in prefixes:
        synthetic_prefix(writer, cfg, ids, layers=1, heads=1, head_dim=8)
    writer.close()
    store = Store([LocalTier(tmp_path / "nvme", cap_bytes=1 << 30), FarDir(tmp_path / "far", gate)])
    metrics = LoaderMetrics(store=store.stats)
    ex = cf.ThreadPoolExecutor(1)
    fetcher = RemoteFetcher(store, ACME, metrics, ex, timeout_s=60, backoff_s=3600)
    root = TINY.key_root(cfg.kv_cache.precision(), BS, ACME.salt)
    scope = Scope(root, "acme")
    pf = Prefetcher(streams, probe=lambda c, s: store.probe(ACME, c, s.root, local_only=True).count,
                    fetcher=fetcher, metrics=metrics)
    chains = [(block_chain(root, ids), None, scope) for ids in prefixes]
    return pf, chains, store, ex


def test_streams_copy_chains_at_once(tmp_path):
    """Four streams, four chains: four reads are in flight together (one stream never gets past one)."""
    gate = Gate(hold_until=4)
    pf, chains, store, ex = far_setup(tmp_path, [prompt(3 * BS, seed=s) for s in range(4)], gate, 4)
    res = pf.run(chains, 0, map_ahead=None).result(timeout=HANG_S)
    assert gate.most == 4
    assert (res.fetched, res.present, res.failed) == (12, 0, {})
    pf.close()
    ex.shutdown()
    store.close()


def test_more_streams_than_chains_and_a_shared_head_copied_once(tmp_path):
    head = prompt(2 * BS, seed=9)
    gate = Gate()
    prefixes = [head + prompt(BS, seed=10), head + prompt(2 * BS, seed=11)]
    pf, chains, store, ex = far_setup(tmp_path, prefixes, gate, 8)
    res = pf.run(chains, 1, map_ahead=None).result(timeout=HANG_S)
    assert sorted(collections.Counter(gate.names).values()) == [1] * 5  # 2 shared + 1 + 2 blocks, each read once
    assert (res.prefixes, res.skipped, res.fetched, res.present, res.failed) == (2, 1, 5, 2, {})
    assert gate.most <= 2  # at most one stream per chain: the other six had nothing to take
    pf.close()
    ex.shutdown()
    store.close()


def test_close_stops_the_streams_after_their_block_and_the_future_resolves(tmp_path):
    gate = Gate(hold_until=10 ** 6)  # every read waits until the test lets them go
    pf, chains, store, ex = far_setup(tmp_path, [prompt(3 * BS, seed=s) for s in range(4)], gate, 2)
    fut = pf.run(chains, 0, map_ahead=None)
    deadline = time.monotonic() + HANG_S  # a hang guard
    while gate.inflight < 2:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    closing = threading.Thread(target=pf.close)
    closing.start()
    while not all(r.stopped.is_set() for r in list(pf._runs)):  # close has asked the streams to stop
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not fut.done()  # the two blocks in flight are still being copied
    gate.open.set()
    closing.join(HANG_S)
    assert not closing.is_alive() and fut.done()  # close joined the streams
    res = fut.result()
    assert (res.fetched, res.failed) == (2, {})  # the blocks in flight landed; nothing after them was asked
    assert len(gate.names) == 2 and sum(1 for _ in store.tiers[0].entries()) == 2
    ex.shutdown()
    store.close()


# -- against a real S3 (SeaweedFS), through the loader ----------------------------------------

def s3_cfg(s3: dict):
    return parse_config({"kv_cache": {"block_size": BS, "compression": "bf16"}, "store": {"s3": s3}})


def s3_loader(tmp_path, cfg, url: str, sub: str, tenant: Tenant = ACME, **kw) -> KVLoader:
    return KVLoader(f"file://{tmp_path}/{sub},{url}", tenant=tenant, model=TINY, config=cfg, pool_bytes=1 << 30,
                    pool_dir=tmp_path / f"pool-{sub}", **kw)


def write_to_s3(tmp_path, cfg, url: str, prefixes) -> None:
    writer = Store.open(f"file://{tmp_path}/writer,{url}", cfg, create_bucket=True)
    for ids in prefixes:
        synthetic_prefix(writer, cfg, ids, layers=1, heads=1, head_dim=8)
    writer.close()


def record_gets(monkeypatch, before=None, after=None) -> list[str]:
    """Every S3 GET of a snapshot this process makes, by name (``before``/``after`` hooks around each)."""
    gets: list[str] = []
    real = S3Tier.read

    def read(self, name, *, readahead=False):  # type: ignore[no-untyped-def]
        gets.append(name)
        if before is not None:
            before(name)
        out = real(self, name, readahead=readahead)
        if after is not None:
            after(name)
        return out

    monkeypatch.setattr(S3Tier, "read", read)
    return gets


def nvme(ld: KVLoader) -> dict[str, str]:
    return {e.name: hashlib.sha256(ld.local.path(e.name).read_bytes()).hexdigest() for e in ld.local.entries()}


def test_one_and_four_streams_copy_the_same_blocks_and_a_shared_head_once(tmp_path, s3_url, s3_config, monkeypatch):
    cfg = s3_cfg(s3_config.model_dump())
    head = prompt(3 * BS, seed=1)  # a system prompt two plan prefixes share
    a, b, c, d = head + prompt(2 * BS, seed=2), head + prompt(3 * BS, seed=3), prompt(4 * BS, seed=4), prompt(2 * BS, seed=5)
    write_to_s3(tmp_path, cfg, s3_url, [a, b, c, d[:BS]])  # d: S3 holds its first block only
    plan = Plan(entries=tuple(PlanEntry("acme", token_ids=tuple(p), score=s) for p, s in zip((a, b, c, d), (4, 3, 2, 1))))
    gets = record_gets(monkeypatch)
    done = {}
    for n in (1, 4):
        gets.clear()
        ld = s3_loader(tmp_path, cfg, s3_url, f"nvme-{n}", prefetch_streams=n)
        res = ld.prefetch(plan).result(timeout=HANG_S)
        done[n] = (res, nvme(ld))
        assert len(gets) == 14 and len(set(gets)) == 14  # 13 stored blocks, each once, and d's missing second
        ld.close()
    assert done[1] == done[4]
    res, files = done[4]
    # 3 + 2 + 3 + 4 + 1 blocks copied; the shared head found present by the chain that did not copy it
    assert (res.prefixes, res.fetched, res.present, res.mapped, res.failed) == (4, 13, 3, 16, {})
    assert len(files) == 13


def test_s3_failing_mid_prefetch_counts_failures_and_backs_off(tmp_path, own_s3, monkeypatch):
    s3 = {"endpoint_url": own_s3.endpoint, "access_key_env": "KVWARM_TEST_KEY", "secret_key_env": "KVWARM_TEST_SECRET",
          "op_timeout_s": 60, "connect_timeout_s": 10, "read_timeout_s": 30, "retries": 0}
    cfg = s3_cfg(s3)
    url = f"s3://kvwarm-prefetch/{uuid.uuid4().hex[:8]}"
    prefixes = [prompt(4 * BS, seed=20 + s) for s in range(4)]
    write_to_s3(tmp_path, cfg, url, prefixes)
    ld = s3_loader(tmp_path, cfg, url, "nvme", prefetch_streams=4, s3_backoff_s=3600.0)
    landed, in_backoff = [], []
    lock = threading.Lock()

    def before(name):  # type: ignore[no-untyped-def]
        in_backoff.append(not ld.fetcher.usable())

    def after(name):  # type: ignore[no-untyped-def]
        with lock:
            landed.append(name)
            if len(landed) == 5:
                own_s3.stop()  # S3 goes away after five blocks came

    gets = record_gets(monkeypatch, before, after)
    res = returns(lambda: ld.prefetch(plan_from_prefixes("acme", prefixes)).result(timeout=HANG_S))
    assert res.failed.get("store_unavailable", 0) >= 1 and set(res.failed) == {"store_unavailable"}
    assert 5 <= res.fetched < 16 and res.fetched == len(nvme(ld))  # what was counted fetched is in NVMe
    assert ld.stats()["s3_backoff"]
    assert sum(in_backoff) <= 3  # at most the other streams' next GET, already past their check
    for ids in prefixes:  # each chain copied in prefix order: what NVMe holds of it is a leading run
        held = [ld.local.exists(n) for n in ld._own.names(block_chain(ld.root, ids))]
        assert held == sorted(held, reverse=True)
    asked = len(gets)
    again = ld.prefetch(plan_from_prefixes("acme", prefixes)).result(timeout=HANG_S)
    assert len(gets) == asked, "a prefetch in the backoff asked S3"
    assert (again.fetched, again.present) == (0, res.fetched)
    ld.close()


def test_tenants_stay_apart_with_streams(tmp_path, s3_url, s3_config, monkeypatch):
    cfg = s3_cfg(s3_config.model_dump())
    prefixes = [prompt(2 * BS, seed=30 + s) for s in range(3)]
    write_to_s3(tmp_path, cfg, s3_url, prefixes)
    plan = plan_from_prefixes("acme", prefixes)
    gets = record_gets(monkeypatch)
    impostor = s3_loader(tmp_path, cfg, s3_url, "imp", tenant=Tenant.derive("acme", "a-guessed-secret"),
                         prefetch_streams=4)
    res = impostor.prefetch(plan).result(timeout=HANG_S)
    assert (res.fetched, res.mapped, res.failed) == (0, 0, {"tenant_refused": 3})
    assert impostor.stats()["refused_cross_tenant"] == 3 and nvme(impostor) == {} and gets == []
    impostor.close()
    bolt = s3_loader(tmp_path, cfg, s3_url, "bolt", tenant=Tenant.derive("bolt", "bolt-secret"), prefetch_streams=4)
    res = bolt.prefetch(plan).result(timeout=HANG_S)
    assert (res.prefixes, res.skipped, res.fetched) == (0, 3, 0) and gets == []  # another tenant's entries
    bolt.close()
