"""Small factories of the fleet-memory tests: names, a local tier, a recorder on a fixed clock."""
from __future__ import annotations

import secrets

from store.serving.fleet import FleetRecorder
from store.tiers.base import object_name
from store.tiers.local import LocalTier

T0 = 1_700_000_000.0


def names(ns: str, n: int) -> list[str]:
    return [object_name(ns, secrets.token_hex(32)) for _ in range(n)]


def local(tmp_path, name: str = "nvme") -> LocalTier:
    return LocalTier(tmp_path / name, cap_bytes=1 << 30)


def recorder(tiers, node: str = "node-a", **kw) -> FleetRecorder:
    kw.setdefault("clock", lambda: T0)
    return FleetRecorder(tiers, node, **kw)
