"""The node's copies into its tier: checked as verify checks, opened with the tenant's key, a chain stopped at
its first failure. A second local directory stands in for S3 (the copier asks only read())."""
from __future__ import annotations

import dataclasses
import os
import threading

from store.format.encode import snapshot_bytes
from store.identity.tenant import Tenant
from store.node.copier import Copier
from store.tiers.base import object_name
from store.tiers.crypto import seal
from store.tiers.local import LocalTier
from tests.hang_guard import HANG_S
from tests.store.factories import ACME, make_chain, make_root, make_snapshot

KEY = os.urandom(32)
SEALED = dataclasses.replace(Tenant.derive("acme", "acme-secret"), encryption_key=KEY)


def tiers(tmp_path) -> tuple[LocalTier, LocalTier]:  # type: ignore[no-untyped-def]
    return LocalTier(tmp_path / "node", cap_bytes=1 << 30), LocalTier(tmp_path / "shared", cap_bytes=1 << 30)


def put(tier: LocalTier, name: str, data: bytes) -> None:
    tier.write(name, data, expires_at=2e9)


def test_a_chain_is_copied_in_order_and_checked(tmp_path):
    node, shared = tiers(tmp_path)
    root = make_root(ACME)
    chain = make_chain(root, 4)
    names = [object_name("acme", b.key) for b in chain]
    for block, name in zip(chain[:3], names[:3]):
        put(shared, name, snapshot_bytes(make_snapshot(root, block)))
    put(node, names[0], snapshot_bytes(make_snapshot(root, chain[0])))
    copier = Copier(node, [shared], {})
    try:
        assert copier.add(names) == 4
        assert copier.wait_idle(60)
        assert [node.exists(n) for n in names] == [True, True, True, False]
        assert dict(copier.counts) == {"present": 1, "copied": 2, "absent": 1}
        # the copy is the shared tier's file, byte for byte
        assert node.read(names[1]).to_pybytes() == shared.read(names[1]).to_pybytes()
    finally:
        copier.close()


def test_a_misnamed_expired_or_sealed_object_is_not_copied_and_stops_its_chain(tmp_path):
    node, shared = tiers(tmp_path)
    root = make_root(ACME)
    a, b, c, d = make_chain(root, 4)
    misnamed = object_name("acme", b.key)
    put(shared, misnamed, snapshot_bytes(make_snapshot(root, a)))  # a's bytes under b's name
    expired = object_name("acme", c.key)
    put(shared, expired, snapshot_bytes(make_snapshot(root, c, ttl_s=1, created_at=0.0)))
    sealed = object_name("acme", d.key)
    open_bytes = snapshot_bytes(make_snapshot(root, d))
    put(shared, sealed, seal(KEY, sealed, open_bytes))
    after = object_name("acme", make_chain(root, 5)[4].key)
    put(shared, after, snapshot_bytes(make_snapshot(root, make_chain(root, 5)[4])))
    alone = Copier(node, [shared], {})
    try:
        for name in (misnamed, expired, sealed):
            alone.add([name, after])
        assert alone.wait_idle(60)
        assert dict(alone.counts) == {"mismatch": 1, "expired": 1, "refused": 1}  # `after` never tried
        assert not any(node.exists(n) for n in (misnamed, expired, sealed, after))
    finally:
        alone.close()
    keyed = Copier(node, [shared], {"acme": SEALED})
    try:
        keyed.add([sealed])
        assert keyed.wait_idle(60)
        assert dict(keyed.counts) == {"copied": 1}
        assert node.read(sealed).to_pybytes() == open_bytes  # stored open: mappable
    finally:
        keyed.close()


def test_without_a_shared_tier_a_hint_queues_nothing_and_an_order_finds_nothing(tmp_path):
    node, shared = tiers(tmp_path)
    copier = Copier(node, [], {})
    try:
        assert copier.add([object_name("acme", "ab" * 32)]) == 0
        copier.replace([[object_name("acme", "cd" * 32)]])
        assert copier.wait_idle(60)
        assert dict(copier.counts) == {"absent": 1}
    finally:
        copier.close()



class HeldDir(LocalTier):
    """A shared tier whose reads wait until the test lets them through (``entered``: one is waiting)."""

    def __init__(self, root) -> None:  # type: ignore[no-untyped-def]
        super().__init__(root, cap_bytes=1 << 30)
        self.gate, self.entered = threading.Event(), threading.Event()

    def read(self, name, *, readahead=False):  # type: ignore[no-untyped-def]
        self.entered.set()
        assert self.gate.wait(60), "the test never let the reads through"
        return super().read(name, readahead=readahead)


def test_pending_counts_what_is_still_to_come_and_a_new_order_keeps_the_hints(tmp_path):
    node = LocalTier(tmp_path / "node", cap_bytes=1 << 30)
    shared = HeldDir(tmp_path / "shared")
    root = make_root(ACME)
    chains = {"busy": make_chain(root, 1, start=300), "planned": make_chain(root, 2),
              "hinted": make_chain(root, 2, start=100), "absent": make_chain(root, 2, start=200)}
    names = {k: [object_name("acme", b.key) for b in c] for k, c in chains.items()}
    for block in chains["busy"] + chains["planned"] + chains["hinted"]:
        put(shared, object_name("acme", block.key), snapshot_bytes(make_snapshot(root, block)))
    copier = Copier(node, [shared], {})
    try:
        copier.replace([names["busy"]])
        assert shared.entered.wait(60)  # the copier is busy with it: what follows stays queued
        copier.replace([names["planned"]])
        assert copier.add(names["hinted"]) == 2 and copier.add(names["absent"]) == 2
        assert copier.add(names["planned"]) == 0  # queued by the order already: not queued twice
        assert [copier.pending(names[k]) for k in ("busy", "planned", "hinted", "absent")] == [1, 2, 2, 2]
        copier.replace([])  # a new order drops the agent's chains, never the clients' hints
        assert [copier.pending(names[k]) for k in ("planned", "hinted", "absent")] == [0, 2, 2]
        shared.gate.set()
        assert copier.wait_idle(60)
        assert [copier.pending(names[k]) for k in ("busy", "hinted", "absent")] == [0, 0, 0]
        assert [node.exists(n) for n in names["hinted"]] == [True, True]
        assert not any(node.exists(n) for n in names["planned"])
        # the absent chain's first block stops it: its second is not asked, and not pending
        assert dict(copier.counts) == {"copied": 3, "absent": 1, "superseded": 2}
    finally:
        copier.close()


class _Together(LocalTier):
    """A shared tier whose reads wait (a hang guard's while) until ``want`` of them are in flight at once."""

    def __init__(self, path, want: int) -> None:  # type: ignore[no-untyped-def]
        super().__init__(path, cap_bytes=1 << 30)
        self.want, self.inflight, self.most = want, 0, 0
        self._cv = threading.Condition()

    def read(self, name, *a, **kw):  # type: ignore[no-untyped-def]
        with self._cv:
            self.inflight += 1
            self.most = max(self.most, self.inflight)
            self._cv.notify_all()
            self._cv.wait_for(lambda: self.most >= self.want, timeout=HANG_S)
            self.inflight -= 1
        return super().read(name, *a, **kw)


def test_streams_copy_several_chains_at_once_each_in_prefix_order(tmp_path):
    node = LocalTier(tmp_path / "node", cap_bytes=1 << 30)
    shared = _Together(tmp_path / "shared", want=3)
    root = make_root(ACME)
    chains = [make_chain(root, 3, start=1000 * s) for s in range(4)]
    names = [[object_name("acme", b.key) for b in chain] for chain in chains]
    for chain, ns in zip(chains, names):
        for block, name in zip(chain, ns):
            put(shared, name, snapshot_bytes(make_snapshot(root, block)))
    copier = Copier(node, [shared], {}, streams=4)
    try:
        copier.replace(names)
        assert copier.wait_idle(HANG_S)
        assert shared.most >= 3  # one thread would have read them one at a time
        assert all(node.exists(n) for ns in names for n in ns)
        assert dict(copier.counts) == {"copied": 12}
    finally:
        copier.close()
