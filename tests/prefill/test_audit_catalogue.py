"""The audit's choice of what to recompute, on hand-made catalogues: order by source, filters, one path per chain."""
from __future__ import annotations

import random

from prefill.audit_catalogue import Catalogue, Stored, plan_paths, select
from store.tiers.base import object_name

ROOT = "0" * 64
NOW = 1000.0


def _key(i: int) -> str:
    return f"{i:064x}"


def _chain(cat: Catalogue, first: int, n: int, origin: str, *, model: str = "m", expires: float = 2 * NOW,
           adapter: str = "", ns: str = "acme") -> list[Stored]:
    """``n`` blocks keyed first, first+1, ... each the parent of the next."""
    out, parent = [], ROOT
    for i in range(first, first + n):
        s = Stored(ns, _key(i), parent, ROOT, origin, model, adapter, expires, (0,))
        cat.entries[object_name(ns, s.key)] = s
        out.append(s)
        parent = s.key
    return out


def test_write_back_comes_first_then_unknown_then_prefill_and_the_rest_are_counted() -> None:
    cat = Catalogue()
    _chain(cat, 1, 3, "prefill")
    _chain(cat, 10, 2, "unknown")
    _chain(cat, 20, 3, "write-back")
    _chain(cat, 30, 2, "write-back", model="other")
    _chain(cat, 40, 1, "write-back", adapter="lora-1")
    _chain(cat, 50, 1, "write-back", expires=NOW)
    picked = select(cat, model_fingerprint="m", sample=4, now=NOW, rng=random.Random(0))
    assert [s.origin for s in picked.targets] == ["write-back"] * 3 + ["unknown"]
    assert picked.other_models == {"other": 2}
    assert picked.skipped == {"adapter": 1, "expired": 1, "not_sampled": 4}
    only = select(cat, model_fingerprint="m", sources=("prefill",), now=NOW, rng=random.Random(0))
    assert [s.origin for s in only.targets] == ["prefill"] * 3 and only.other_models == {}


def test_public_snapshots_come_first_whatever_their_source() -> None:
    cat = Catalogue()
    _chain(cat, 1, 3, "write-back")
    _chain(cat, 10, 2, "prefill", ns="public")  # every tenant loads these: checked before anything else
    _chain(cat, 20, 2, "unknown")
    picked = select(cat, model_fingerprint="m", sample=3, now=NOW, rng=random.Random(0))
    assert [(s.namespace, s.origin) for s in picked.targets] == [("public", "prefill")] * 2 + [("acme", "write-back")]


def test_one_seed_one_order_and_another_seed_another() -> None:
    cat = Catalogue()
    _chain(cat, 1, 8, "write-back")
    order = [[s.key for s in select(cat, model_fingerprint="m", now=NOW, rng=random.Random(seed)).targets]
             for seed in (1, 1, 2)]
    assert order[0] == order[1] != order[2] and sorted(order[0]) == sorted(order[2])


def test_picks_on_one_chain_share_one_path_and_a_broken_chain_is_an_orphan() -> None:
    cat = Catalogue()
    a = _chain(cat, 1, 4, "write-back")
    b = _chain(cat, 10, 2, "write-back")
    orphaned = _chain(cat, 20, 3, "write-back")
    del cat.entries[object_name("acme", orphaned[0].key)]  # block 0 evicted: the others cannot be recomputed
    paths, orphans = plan_paths(cat, [a[1], b[1], a[3], a[0], orphaned[2]])
    assert [[s.key for s in p.chain] for p in paths] == [[s.key for s in a], [s.key for s in b]]
    assert [sorted(p.targets) for p in paths] == [[0, 1, 3], [1]]
    assert orphans == [orphaned[2]]
    assert cat.chain(a[2]) == tuple(a[:3]) and cat.chain(orphaned[1]) is None


def test_the_descendants_of_a_block_are_every_block_after_it_on_any_chain() -> None:
    cat = Catalogue()
    a = _chain(cat, 1, 4, "write-back")
    branch = Stored("acme", _key(9), a[1].key, ROOT, "prefill", "m", "", 2 * NOW, (0,))  # a second child of a[1]
    cat.entries[branch.name] = branch
    _chain(cat, 20, 2, "write-back")
    assert sorted(s.key for s in cat.descendants({a[1].name})) == sorted([a[2].key, a[3].key, branch.key])
    assert cat.descendants({a[3].name}) == [] and cat.descendants(set()) == []
